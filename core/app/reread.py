"""Re-read answers: the memory chooses, the model reads what it chose as one ordinary context.

emllm's layers attend to the events they retrieve all at one distance (spec §1). That finds the
needle (held by nearly every layer: docs/benchmarks.md, answers), but a small model then binds a question's key to the
wrong one of several similar needles more often than when it reads the same text in order
(docs/benchmarks.md, recall: "why the misreads"). A re-read answer keeps emllm's retrieval and
changes the reading:

1. the question is read against the memory as usual, and every layer's selection is recorded,
   with the tokens in no event yet (the remainder and the local window, which every layer attends
   to) scored as if they were events (`SelectionRecorder`);
2. the stream is cut into passages (`memory.passages`), ranked by the layers' votes fused with the
   few that best match the question's words (where the votes passed over the passage a
   question names, it is read all the same), and the best taken while they fit in emllm's
   attention span (n_init + n_mem + n_local tokens);
3. a fresh engine whose window holds all of it reads the initial tokens, those passages ordered by
   their words' match with the question (BM25), the best last, next to the question (measured:
   stream order read the passkey's filler wrongly and fewer code questions right; by the votes'
   rank, the asked one of several look-alike needles was often not last, as the votes tie on
   them), and the question (the plain model, exactly), and answers.

It costs one more forward over about the span's tokens. The store is not changed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import snowballstemmer
import torch
from torch import Tensor

from emllm.engine.stream import Engine, RetrievalListener
from emllm.math.segmentation import surprise_starts
from emllm.memory.distinct import span_groups
from emllm.memory.passages import (chunk_spans, choose_passages, event_spans, event_votes, fuse_orders,
                                  lexical_scores, passage_order, passage_votes, token_votes)
from emllm.memory.selection import TOKEN_SCORINGS, Selection, mean_keys, select_events, token_scores, unit_keys

PASSAGE_TOKENS = 128  # the retrieval baseline's chunk: long enough to hold a needle's sentence whole
PASSAGES_AT_LEAST = 8  # a small span (a test's profile) gets shorter passages, so that several fit


def _texts(tok: Any, ids: Tensor) -> list[str | None]:
    """The text of each token id of `ids` [n] alone (None: an id past the tokenizer's)."""
    return [None if p is None else tok.convert_tokens_to_string([p]) for p in tok.convert_ids_to_tokens(ids.tolist())]


def sentence_ends(tok: Any, ids: Sequence[int] | Tensor) -> Tensor:
    """[n] bool, per token: whether its text ends a sentence (. ! ? or a newline). Each distinct
    token is decoded once."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    uniq, inverse = torch.unique(ids, return_inverse=True)
    ends = torch.tensor([t is not None and t.rstrip(" ").endswith((".", "!", "?", "\n")) for t in _texts(tok, uniq)])
    return ends[inverse]


def _word(text: str, stems: Callable[[str], str]) -> str:
    w = text.strip().lower()
    return stems(w) if w.isalpha() else w


def word_ids(tok: Any, *seqs: Sequence[int] | Tensor, stem: bool = True) -> list[Tensor]:
    """Each of `seqs` (token ids) with every id replaced by one that stands for its text without
    the whitespace around it, in lower case, the same in all of them: to the re-read's BM25,
    " class", "class" and "Class" are one word (a question says "the class X", a file "\\nclass X").
    With `stem`, a token that is a word of letters stands for its English stem (Snowball's): a
    question's "leave" finds a text's "leaves". A token that is part of a character (its text alone
    a replacement character), or an id the tokenizer lacks, stays its own word. Each distinct token
    is decoded once."""
    flat = [torch.as_tensor(s, dtype=torch.long).flatten() for s in seqs]
    uniq, inverse = torch.unique(torch.cat(flat), return_inverse=True)
    first: dict[str, int] = {}  # a word's text -> its id: the first token's (an index into uniq) with that text
    stems = snowballstemmer.stemmer("english").stemWord if stem else (lambda w: w)
    words = [i if t is None or "\ufffd" in t else first.setdefault(_word(t, stems), i)
             for i, t in enumerate(_texts(tok, uniq))]
    return list(torch.tensor(words, dtype=torch.long)[inverse].split([len(f) for f in flat]))


def passage_spans(tok: Any, stream: Tensor, start: int, room: int) -> list[tuple[int, int]]:
    """The passages of `stream` [n] from `start`: PASSAGE_TOKENS long at most, shorter where the
    room would not hold PASSAGES_AT_LEAST of them, ending after a sentence where they can."""
    size = max(1, min(PASSAGE_TOKENS, room // PASSAGES_AT_LEAST))
    return chunk_spans(len(stream), size, start=start, sentence_ends=sentence_ends(tok, stream))


def tail_lengths(flags: Tensor, min_block: int, max_block: int) -> Tensor:
    """[P] lengths of the pieces the stream's tail (tokens in no event yet; `flags` [n] their
    boundary candidates) would be cut into as events, the last piece still open (may be short)."""
    n = int(flags.numel())
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    starts = surprise_starts(flags.cpu(), min_block, max_block)
    return torch.diff(starts, append=torch.tensor([n]))


def tail_selection(window: Any, query: Tensor, tail_keys: Tensor, tail: Tensor, budget: int, scoring: str,
                   normalise: bool, event_scores: Tensor | None = None, groups: Tensor | None = None) -> Selection:
    """The layer's selection had the tail's pieces (`tail` [P] lengths of consecutive tokens,
    `tail_keys` [H_kv, sum, D] their pre-RoPE keys) been events: their mean keys (the profile's
    representative) scored with the events' by the retrieval's `query` ([T, H_r, D] a question's
    tokens, combined by `scoring`; [H_r, D] one query), the best taken within `budget` tokens.
    `event_scores` [T, E]: the events' scores for those tokens where the retrieval computed them
    (`Selection.token_scores`; at 1M tokens a second scoring cost seconds), else computed here.
    `groups` [E + P]: identical events and pieces take one place (`select_events`).
    Returns ids [k] into the events, then the pieces (E + i: piece i), and their scores."""
    events = window.events
    reprs = mean_keys(tail_keys, tail.to(tail_keys.device), events.repr_heads)  # [P, H_r, D]
    if normalise:
        reprs = unit_keys(reprs)
    flat = reprs.reshape(len(tail), -1)
    q = query if query.dim() == 3 else query[None]  # [T, H_r, D]
    if event_scores is None:
        event_scores = events.token_scores(q)
    raw = torch.cat((event_scores, token_scores(flat.shape[0], flat.shape[1], lambda a, b: flat[a:b], q).to(event_scores.device)), 1)
    scores = TOKEN_SCORINGS[scoring](raw) if query.dim() == 3 else raw[0]  # [E + P]
    lengths = torch.cat((events.event_lengths().cpu(), tail.cpu()))
    sel = select_events(scores, lengths, budget, groups)
    return Selection(sel.ids.cpu(), sel.scores.cpu())


@dataclass(frozen=True)
class Votes:
    """What every layer selected when the question was read: ids into `spans`."""
    spans: Tensor  # [E + P, 2] stream positions [start, end): the events, then the tail's pieces (P = 0 without)
    selections: dict[int, Tensor]  # layer -> ids [k]


class SelectionRecorder(RetrievalListener):
    """Keeps each layer's last selection while attached (chained to any callback already set).

    tail=True (the default) also scores the tokens in no event yet, the remainder and the local
    window, as events: cut where the stream's surprise would cut them, each piece represented and
    scored as an event is (`tail_selection`). Every layer attends to those tokens, so emllm's own
    selection says nothing of them; without this a needle among the last n_local tokens before
    the question had no votes and was read again only where room was left (docs/benchmarks.md,
    re-read answers). It costs one more scoring of the events per layer."""

    def __init__(self, engine: Engine, tail: bool = True) -> None:
        super().__init__(engine)
        self.tail = tail
        self.last: dict[int, Tensor] = {}  # layer -> event ids [k] (then tail pieces, E + i)
        self.scores: dict[int, Tensor] = {}  # layer -> [k] their scores
        self._spans = torch.zeros(0, 2, dtype=torch.long)
        self._tail = torch.zeros(0, dtype=torch.long)  # lengths of the tail's pieces at the last retrieval
        self._at = -1  # the engine's n_tokens when the tail was cut
        self._groups: Tensor | None = None  # [E + P] identical spans' labels (profile distinct_events)

    def _cut(self) -> None:
        """Once per forward (retrievals happen before the step closes events): the events' spans
        and the pieces of the tail [rem_start, n_tokens)."""
        eng, pr = self.engine, self.engine.profile
        if self._at == eng.n_tokens:
            return
        self._at = eng.n_tokens
        events = event_spans(eng.windows[0].events.event_lengths(), pr.n_init)
        flags = eng.flags.view()[eng.rem_start : eng.n_tokens] if self.tail else eng.flags.view()[:0]
        self._tail = tail_lengths(flags, pr.min_block, pr.max_block)
        ends = torch.cumsum(self._tail, 0) + eng.rem_start
        self._spans = torch.cat((events, torch.stack((ends - self._tail, ends), 1)))
        self._groups = None  # (computed by the first retrieval that needs them)

    def heard(self, layer: int, sel: Selection, query: Tensor) -> None:
        self._cut()
        if len(self._tail):
            eng, pr = self.engine, self.engine.profile
            w = eng.layers[layer]
            # A layer retrieves only once it has events, so the window no longer holds initial tokens:
            # the tail is the remainder, then the window (during the step: its last n_local tokens,
            # then the step's chunk)
            keys = torch.cat((w.rem_k, w.local_k[:, : pr.n_local]), 1)  # [H_kv, n, D]
            n = int(self._tail.sum())
            if keys.shape[1] != n:
                raise RuntimeError(f"layer {layer}: {keys.shape[1]} tokens after the events, expected {n}")
            groups = None
            if pr.distinct_events and query.dim() == 3:  # as the engine's question selection (`select_events`)
                if self._groups is None:
                    self._groups = span_groups(eng.ids.view(), self._spans)
                groups = self._groups
            sel = tail_selection(w, query, keys, self._tail, eng.similarity_budget, pr.question_scoring,
                                 pr.repr_normalise, sel.token_scores, groups)
        self.last[layer] = sel.ids.cpu()
        self.scores[layer] = sel.scores.detach().float().cpu()

    def votes(self) -> Votes:
        return Votes(self._spans, dict(self.last))


@dataclass(frozen=True)
class Reread:
    ids: list[int]  # the context to read: initial tokens, then the passages (the question follows)
    passages: list[tuple[int, int]]  # stream spans [start, end) taken, in the order read


WORDS_TOP = 4  # the BM25 ranking's best 4 are fused with the votes', a quarter of the ~16 passages of a span: a
# question whose words mislead costs at most these; a name the question asks about is in its best few


# (start, end, ids): a document of the stream at [start, end) whose text opens with a line naming
# it (a folder's file), that line's token ids
Named = tuple[int, int, Sequence[int]]


def reread_context(engine: Engine, votes: Votes, tok: Any, n_stream: int, room: int,
                   question: Sequence[int] = (), named: Sequence[Named] = ()) -> Reread:
    """The initial tokens, then the passages of the stream's first `n_stream` tokens that the
    layers' `votes` and the `question`'s words favour, while they fit in `room` more tokens
    (`context_from_votes`)."""
    pr = engine.profile
    return context_from_votes(engine.ids.view()[:n_stream], votes, tok, pr.n_init, room, question, named)


def naming_lines(spans: Sequence[tuple[int, int]], named: Sequence[Named]) -> list[Sequence[int]]:
    """[P] the ids to read before each passage: the line naming the document it starts in, where
    that document has one (`named`, sorted by start) and the passage does not start with it."""
    starts = [n[0] for n in named]
    out: list[Sequence[int]] = []
    for s, _ in spans:
        i = bisect.bisect_right(starts, s) - 1
        out.append(named[i][2] if i >= 0 and named[i][0] < s < named[i][1] else ())
    return out


def context_from_votes(stream: Tensor, votes: Votes, tok: Any, n_init: int, room: int,
                       question: Sequence[int] = (), named: Sequence[Named] = ()) -> Reread:
    """`reread_context` from what it needs (`stream` [n] the tokens before the question): the first
    `n_init` tokens, then passages while they fit in `room`.

    Which passages: a token scores its event's votes (the layers that selected it); the passages
    are ranked by the reciprocal rank fusion (`fuse_orders`) of the votes' ranking (those with any
    vote) and the `WORDS_TOP` best by BM25 for the `question`'s words (`word_ids`: its tokens,
    blind to case and the spaces around them, stemmed) and their consecutive pairs (of those with any of
    its words), so that a passage the question's rare words point to is read even where the
    layers' votes passed it over (hybrid retrieval). In what order: by their BM25 for the
    question, the best last, next to the question, ties by rank (the votes choose, the words
    order). Where every passage fits, the stream is read in its order. A passage that starts inside
    a document `named` (a folder's file, whose first line names it) is read after that line,
    unless it goes on from the passage read before it: the model reads which file each passage is
    from."""
    n_stream = len(stream)
    weights = event_votes(list(votes.selections.values()), len(votes.spans))
    tv = token_votes(votes.spans, weights, n_stream)
    n_init = min(n_init, n_stream)
    spans = passage_spans(tok, stream, n_init, room)
    pv = passage_votes(tv, spans) if spans else None  # ([P] most, [P] mean) votes of each passage
    order = passage_order(tv, spans, pv)
    # [P] (the stream's passages are the collection: the words' rarity)
    stream_words, question_words = word_ids(tok, stream, question)
    words = lexical_scores(stream_words, spans, question_words)
    if spans:
        by_votes = torch.as_tensor(order)
        by_votes = by_votes[pv[0][by_votes] > 0]
        by_words = torch.sort(-words, stable=True).indices
        order = fuse_orders([by_votes.tolist(), by_words[words[by_words] > 0][:WORDS_TOP].tolist()], len(spans))
    lines = naming_lines(spans, named)
    fits = sum(e - s for s, e in spans) <= room  # every passage: read in order, each going on from the last (no lines)
    kept = choose_passages(order, spans, room, None if fits or not named else [len(x) for x in lines])
    if len(kept) < len(spans):  # worst first: by the words first, then by rank
        rank = {i: r for r, i in enumerate(order)}
        kept = [i for _, _, i in sorted(zip(words[kept].tolist(), [-rank[i] for i in kept], kept))]
    ids = stream[:n_init].tolist()
    end = n_init
    for i in kept:
        s, e = spans[i]
        if s != end:  # (a passage that goes on from the one before needs no name: it was read)
            ids.extend(lines[i])
        ids.extend(stream[s:e].tolist())
        end = e
    return Reread(ids, [spans[i] for i in kept])


def reader(model: Any, profile: Any, tokens: int) -> Engine:
    """An engine whose local window holds `tokens`: nothing reaches its memory, so it reads as the
    plain model does (tests/test_exact.py)."""
    return Engine(model, profile.replace(n_local=max(profile.n_local, tokens)))


def reread(engine: Engine, question: list[int], tok: Any, max_new_tokens: int,
           read_question: Callable[[list[int]], Any] | None = None, named: Sequence[Named] = ()) -> tuple[Engine, Reread]:
    """Read `question` against the engine's memory (`read_question`, by default as a question of
    its own: begin_question, feed), recording each layer's selection; then return a reader engine
    that has read the initial tokens, the passages voted for and the question, ready to answer,
    and what it read. The passages fill emllm's attention span, n_init + n_mem + n_local tokens,
    with the question; `named`: the stream's documents that a line names (`context_from_votes`)."""
    rec = SelectionRecorder(engine)
    try:
        if read_question is None:
            engine.begin_question()
            engine.feed(question)
        else:
            read_question(question)
    finally:
        rec.detach()
    n_stream = engine.n_tokens - len(question)
    room = reread_room(engine.profile, n_stream, len(question))
    rr = reread_context(engine, rec.votes(), tok, n_stream, room, question, named)
    return read_again(engine.model, engine.profile, rr.ids, question, max_new_tokens), rr


def reread_room(profile: Any, n_stream: int, n_question: int) -> int:
    """Tokens of passages a re-read takes: emllm's attention span (n_init + n_mem + n_local) less
    the initial tokens and the question."""
    span = profile.n_init + profile.n_mem + profile.n_local
    return max(0, span - min(profile.n_init, n_stream) - n_question)


def read_again(model: Any, profile: Any, context: list[int], question: list[int], max_new_tokens: int) -> Engine:
    """A `reader` that has read `context` and then `question`, ready to answer in up to
    `max_new_tokens` tokens."""
    eng = reader(model, profile, len(context) + len(question) + max_new_tokens)
    # (no surprise: the reader closes no events, and its head then computes only the last token's logits)
    if context:
        eng.feed(context, surprise=False)
    eng.begin_question()
    eng.feed(question, surprise=False)
    return eng


__all__ = ["PASSAGE_TOKENS", "Named", "Reread", "naming_lines", "WORDS_TOP", "word_ids", "SelectionRecorder", "Votes", "passage_spans", "read_again", "reader", "reread",
           "context_from_votes", "reread_context", "reread_room", "sentence_ends", "tail_lengths", "tail_selection"]
