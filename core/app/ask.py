"""Asking a store: the read path behind `emllm ask`.

The question continues the store's stream on a copy of its tail state: the engine is built on the
store opened read-only, so events it closes while answering stay in RAM and the files are never
written. Every question sees the same memory.

    store = Store.open(path)
    session = Session(store, model, tok)
    for token_id in session.answer("who hid the key?", max_new_tokens=128): ...
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from emllm.errors import Cancelled
from emllm.engine.sampling import Sampling, TokenLogprob, greedy, recording, token_logprobs
from emllm.engine.stream import Engine
from emllm.app.stream import SEPARATOR, decode_after, encode, encode_framing, open_engine, opens_a_turn, pending_tokens
from emllm.models import stop_token_ids
from emllm.store import Store, StoreError


class Session:
    """One question against a store (read-only)."""

    def __init__(self, store: Store, model: Any, tok: Any, kv_cache_mb: int | None = None, reread: bool = False,
                 raw: bool = False) -> None:
        info = store.info
        job = info.job
        # An ingest under way (or interrupted): the answer comes from the last commit, the part of
        # its job read so far; what it has not read yet is left out, not read here.
        self.unfinished: tuple[int, int] | None = (job.done, job.tokens) if job is not None and not job.complete else None
        self.tail: list[int] = [] if self.unfinished else pending_tokens(store)
        if info.stream is None:
            raise StoreError(f"{store.path} records no stream layout: it was not written by an ingest")
        # An empty store (a conversation's first question): the stream starts here, with the
        # template's opening of a user turn, which the store does not hold yet (`lead`).
        self.empty = store.tokens.rows == 0 and not self.tail
        prefix = info.stream.prefix
        self.lead: list[int] = encode_framing(tok, prefix) if self.empty and prefix and not raw else []
        self.tail = self.tail + self.lead
        # A question opening a user turn of its own (an empty store's first, or one after a
        # remembered answer) is the turn's text as the chat template has it; after a document it
        # is set apart from it by SEPARATOR.
        self.turn_start = self.empty or opens_a_turn(store, tok, self.tail)
        self.store, self.model, self.tok = store, model, tok
        self.engine: Engine = open_engine(store, model, kv_cache_mb)
        self.reread = reread  # answer by re-reading what the memory selected (`app.reread`)
        self.passages: list[tuple[int, int]] = []  # with reread: the stream spans read again
        # With top_logprobs set (0: the chosen tokens' alone), each answer token's log probability
        # and its likeliest alternatives, as they are chosen
        self.top_logprobs: int | None = None
        self.logprobs: list[TokenLogprob] = []
        self.shown_tokens = 0  # of the answer being given, the tokens whose text has started to be given out
        # raw: the question is a prompt that continues the stream as it is (a completion: no
        # separator, no turn's framing; text or token ids)
        self.raw = raw
        self._raw_ids: tuple[str, list[int]] | None = None  # (a text prompt, its tokens)
        # With echo set (alternatives, 0 or more): the prompt's tokens' log probabilities as it is
        # read (a first token that nothing predicts, an empty store's, has None)
        self.echo: int | None = None
        self.prompt_logprobs: list[TokenLogprob] = []
        # Whether the answer being given was cancelled (`Answer.cancel`, from any thread): reading
        # stops at the next chunk or token
        self.cancelled: Callable[[], bool] = lambda: False

    def question_ids(self, question: str | list[int]) -> list[int]:
        """The question closing the user turn (without the stream's pending tail); raw: the
        prompt's tokens (its text's special tokens count, as the user wrote them)."""
        if self.raw:
            if isinstance(question, list):
                return list(question)
            if self._raw_ids is None or self._raw_ids[0] is not question:  # (a long prompt: tokenized once)
                self._raw_ids = (question, encode_framing(self.tok, question))
            return list(self._raw_ids[1])
        fmt = self.store.info.stream
        sep = "" if self.turn_start else SEPARATOR
        if fmt.chat:  # the template's closing is emllm's framing: its special tokens count
            return encode(self.tok, sep + question.strip()) + encode_framing(self.tok, fmt.suffix)
        return encode(self.tok, sep + question.strip() + fmt.suffix)

    def read_question(self, question: str) -> Tensor:
        """Feed the pending tail, then the question; returns the logits that predict the answer's
        first token [V].

        The question starts a chunk of its own (spec §4): a chunk's retrieval query is the mean of
        its tokens' queries, and a question sharing its chunk with up to chunk_size - 1 tokens of
        document retrieves for the document (the 1M passkey was missed so: docs/benchmark-log.md).
        """
        return self.read_question_ids(self.question_ids(question))

    def read_question_ids(self, ids: list[int]) -> Tensor:
        """As `read_question`, for a question already tokenized (benchmarks with their own form)."""
        self.feed_pending()
        self.engine.begin_question()
        if self.echo is None:
            return self.engine.feed(ids, self._unless_cancelled)
        return self._feed_scored(ids, self.echo)

    def _unless_cancelled(self, _report: object = None) -> None:
        """Between chunks and tokens: a cancelled answer stops there (a long prompt included)."""
        if self.cancelled():
            raise Cancelled("the answer was cancelled")

    def _feed_scored(self, ids: list[int], top: int) -> Tensor:
        """`engine.feed(ids)`, recording each token's log probability (`prompt_logprobs`) from the
        logits that predict it: the stream's last for the first, then each chunk's [c, V]."""
        engine = self.engine
        x = torch.as_tensor(ids, dtype=torch.long)  # [n]
        before = engine.last_logits
        self.prompt_logprobs = [TokenLogprob(int(x[0]), None)] if before is None else token_logprobs(before[None], x[:1], top)
        cs = engine.profile.chunk_size
        for off in range(0, x.numel(), cs):
            self._unless_cancelled()
            logits = engine.step(x[off:off + cs], every_logit=True)  # [c, V]: row i predicts token off + i + 1
            # (a shortlist head's profile: every row computed here, the prompt's surprise then exact)
            following = x[off + 1:off + cs + 1]
            self.prompt_logprobs += token_logprobs(logits[: following.numel()], following, top)
        return engine.last_logits

    def feed_pending(self) -> None:
        """The stream's pending tail (tokens after the store's last chunk), once."""
        if self.tail:
            self.engine.feed(self.tail, self._unless_cancelled)
            self.tail = []

    def answer(self, question: str, max_new_tokens: int = 256, sampling: Sampling | None = None) -> Iterator[int]:
        """The answer, token by token, from the memory (profile answer_retrieval): greedy, or as
        `sampling` says (its repetition penalty counts the question's tokens and the answer's)."""
        yield from self.answer_ids(self.question_ids(question), max_new_tokens, sampling)

    def answer_ids(self, ids: list[int], max_new_tokens: int = 256, sampling: Sampling | None = None) -> Iterator[int]:
        """As `answer`, for a question already tokenized as the stream continues (`question_ids`,
        or a benchmark's own form)."""
        engine = self.engine
        if self.reread:
            engine = self._reread(ids, max_new_tokens)
        else:
            self.read_question_ids(ids)
        choose = sampling.chooser(context=ids) if sampling is not None else greedy
        self.logprobs.clear()
        if self.top_logprobs is not None:
            choose = recording(choose, self.top_logprobs, self.logprobs)
        yield from engine.generate_iter(max_new_tokens, set(stop_token_ids(self.tok, self.model)), choose)

    def _reread(self, ids: list[int], max_new_tokens: int) -> Engine:
        """Read the question against the memory, then return a reader engine that has read the
        passages the layers voted for and the question (`app.reread`)."""
        from emllm.app.reread import reread

        self.feed_pending()  # first, unrecorded: its chunks' retrievals are not the question's
        named = [(d.start, d.start + d.tokens, encode(self.tok, d.header)) for d in self.store.info.documents if d.header]
        eng, rr = reread(self.engine, ids, self.tok, max_new_tokens, named=named)
        self.passages = rr.passages
        return eng

    def answer_text(self, question: str, max_new_tokens: int = 256, sampling: Sampling | None = None,
                    stop: list[str] | None = None) -> Iterator[str]:
        """The answer as text, a piece at a time, as it is generated. It ends at a stop token, after
        max_new_tokens, or before the first of the `stop` strings (not included). Text that could
        still become a stop string, or half a multi-byte character, is held back until it is known."""
        stop = [x for x in (stop or []) if x]
        ids: list[int] = []
        starts: list[int] = []  # where each token's text starts in the answer's
        shown, text = 0, ""
        self.answered = ids  # the answer's token ids as they come (up to a stop string: all generated)
        # a completion's text is what its tokens add to the prompt's last ones (`decode_after`)
        before = self.question_ids(question)[-4:] if self.raw else []
        self.tokens = 0  # generated (for reports)
        self.shown_tokens = 0
        for t in self.answer(question, max_new_tokens, sampling):
            self._unless_cancelled()
            ids.append(t)
            self.tokens += 1
            starts.append(len(text))
            text = decode_after(self.tok, before, ids)
            cut = min((i for i in (text.find(x, max(0, shown - len(x))) for x in stop) if i >= 0), default=-1)
            if cut >= 0:
                # the tokens whose text starts before the stop string (their log probabilities stay)
                self.shown_tokens = bisect.bisect_left(starts, cut)
                del self.logprobs[self.shown_tokens:]
                if cut > shown:
                    yield text[shown:cut]
                return
            safe = len(text) - (1 if text.endswith("\ufffd") else 0)
            for x in stop:  # hold back a tail that is the start of a stop string
                for k in range(min(len(x) - 1, safe - shown), 0, -1):
                    if text[safe - k:safe] == x[:k]:
                        safe -= k
                        break
            if safe > shown:
                self.shown_tokens = bisect.bisect_left(starts, safe)
                yield text[shown:safe]
                shown = safe
        text = decode_after(self.tok, before, ids)
        self.shown_tokens = len(ids)
        if len(text) > shown:
            yield text[shown:]


__all__ = ["Session"]
