"""Re-read answers: the memory chooses, the model reads what it chose as one ordinary context.

emllm's layers attend to the events they retrieve all at one distance (spec §1). That finds the
needle (held by 97-100% of layers at 8k), but a small model then binds a question's key to the
wrong one of several similar needles more often than when it reads the same text in order
(docs/benchmarks.md, recall: "why the misreads"). A re-read answer keeps emllm's retrieval and
changes the reading:

1. the question is read against the memory as usual, and every layer's selection is recorded;
2. the stream is cut into passages (`memory.passages`), ranked by the layers' votes, and the best
   taken while they fit in emllm's attention span (n_init + n_mem + n_local tokens). The local
   window's tokens are in no event and have no votes: they are read again only where room is left,
   so a question about the last n_local tokens before it is better asked without re-reading;
3. a fresh engine whose window holds all of it reads the initial tokens, those passages in stream
   order, and the question (the plain model, exactly), and answers.

It costs one more forward over about the span's tokens. The store is not changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from emllm.engine.stream import Engine
from emllm.memory.passages import chunk_spans, choose_passages, event_votes, passage_order, token_votes
from emllm.memory.selection import Selection

PASSAGE_TOKENS = 128  # the retrieval baseline's chunk: long enough to hold a needle's sentence whole
PASSAGES_AT_LEAST = 8  # a small span (a test's profile) gets shorter passages, so that several fit


def sentence_ends(tok: Any, ids: Sequence[int] | Tensor) -> Tensor:
    """[n] bool, per token: whether its text ends a sentence (. ! ? or a newline). Each distinct
    token is decoded once."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    uniq, inverse = torch.unique(ids, return_inverse=True)
    pieces = tok.convert_ids_to_tokens(uniq.tolist())
    ends = torch.tensor([tok.convert_tokens_to_string([p]).rstrip(" ").endswith((".", "!", "?", "\n")) for p in pieces])
    return ends[inverse]


def passage_spans(tok: Any, stream: Tensor, start: int, room: int) -> list[tuple[int, int]]:
    """The passages of `stream` [n] from `start`: PASSAGE_TOKENS long at most, shorter where the
    room would not hold PASSAGES_AT_LEAST of them, ending after a sentence where they can."""
    size = max(1, min(PASSAGE_TOKENS, room // PASSAGES_AT_LEAST))
    return chunk_spans(len(stream), size, start=start, sentence_ends=sentence_ends(tok, stream))


class SelectionRecorder:
    """Keeps each layer's last selection while attached (chained to any callback already set)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last: dict[int, Tensor] = {}  # layer -> event ids [k]
        self._before: Callable | None = engine.on_retrieval
        engine.on_retrieval = self._record

    def _record(self, layer: int, sel: Selection, query: Tensor) -> None:
        self.last[layer] = sel.ids.cpu()
        if self._before is not None:
            self._before(layer, sel, query)

    def detach(self) -> None:
        self.engine.on_retrieval = self._before


@dataclass(frozen=True)
class Reread:
    ids: list[int]  # the context to read: initial tokens, passages in stream order (the question follows)
    passages: list[tuple[int, int]]  # stream spans [start, end) taken, in stream order


def reread_context(engine: Engine, selections: dict[int, Tensor], tok: Any, n_stream: int, room: int,
                   window: bool = False) -> Reread:
    """The initial tokens, then the passages of the stream's first `n_stream` tokens that the
    layers' `selections` vote for, best first while they fit in `room` more tokens.

    The local window's tokens are in no event, so they have no votes: its passages are read only
    where room is left. window=True counts them as every layer's instead (each layer attends to
    them), so its passages come first; measured, that answered fewer RULER-style questions (the
    window takes half the room: docs/benchmarks.md, re-read answers)."""
    pr = engine.profile
    stream = engine.ids.view()[:n_stream]  # [n] the stream's tokens (the question after them is not re-read)
    lengths = engine.windows[0].events.event_lengths().cpu()
    ends = torch.cumsum(lengths, 0) + pr.n_init
    spans_e = torch.stack((ends - lengths, ends), 1)  # [E, 2]
    votes = event_votes(list(selections.values()), len(lengths))
    n_init = min(pr.n_init, n_stream)
    # the local window, as the question's step saw it, is read by every layer
    local = (max(n_init, n_stream - pr.n_local), n_stream)
    tv = token_votes(spans_e, votes, n_stream, attended=[local] if window else [], layers=len(engine.windows))
    spans = passage_spans(tok, stream, n_init, room)
    kept = choose_passages(passage_order(tv, spans), spans, room)
    taken = [spans[i] for i in kept]
    ids = stream[:n_init].tolist()
    for s, e in taken:
        ids.extend(stream[s:e].tolist())
    return Reread(ids, taken)


def reader(model: Any, profile: Any, tokens: int) -> Engine:
    """An engine whose local window holds `tokens`: nothing reaches its memory, so it reads as the
    plain model does (tests/test_exact.py)."""
    return Engine(model, profile.replace(n_local=max(profile.n_local, tokens)))


def reread(engine: Engine, question: list[int], tok: Any, max_new_tokens: int,
           read_question: Callable[[list[int]], Any] | None = None, window: bool = False) -> tuple[Engine, Reread]:
    """Read `question` against the engine's memory (`read_question`, by default as a question of
    its own: begin_question, feed), recording each layer's selection; then return a reader engine
    that has read the initial tokens, the passages voted for and the question, ready to answer,
    and what it read. The passages fill emllm's attention span, n_init + n_mem + n_local tokens,
    with the question."""
    rec = SelectionRecorder(engine)
    try:
        if read_question is None:
            engine.begin_question()
            engine.feed(question)
        else:
            read_question(question)
    finally:
        rec.detach()
    pr = engine.profile
    n_stream = engine.n_tokens - len(question)
    span = pr.n_init + pr.n_mem + pr.n_local
    rr = reread_context(engine, rec.last, tok, n_stream, max(0, span - min(pr.n_init, n_stream) - len(question)), window)
    eng = reader(engine.model, pr, len(rr.ids) + len(question) + max_new_tokens)
    if rr.ids:
        eng.feed(rr.ids)
    eng.begin_question()
    eng.feed(question)
    return eng, rr


__all__ = ["PASSAGE_TOKENS", "Reread", "SelectionRecorder", "passage_spans", "reader", "reread", "reread_context", "sentence_ends"]
