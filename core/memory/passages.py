"""Passages for a re-read answer, pure math: the layers' selections at the question, mapped onto
contiguous passages of the stream, to be read again as one ordinary context (`app/reread.py`).

At the question every layer selects the events it attends to (spec §4). An event that more layers
selected is likelier to hold what is asked: a token's *votes* are the layers whose selection held
its event (tokens in no event have none, unless the caller counts a span, such as the local
window, as every layer's). The stream is cut into passages of up to `size` tokens, each ending after a sentence where
its second half has one (`chunk_spans`: the retrieval baseline's chunks, so a needle is rarely cut).
A passage scores its most-voted token, then its mean votes; passages are taken best first while
they fit in the room, and read in stream order.

Why passages and not the events themselves: emllm's events average ~14 tokens; read again alone,
a needle loses the sentence around it. Why the votes and not a separate embedder: the memory's own
selection holds the asked needle in nearly every layer (docs/benchmarks.md, answers).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def chunk_spans(n: int, size: int, start: int = 0, sentence_ends: Sequence[bool] | Tensor | None = None) -> list[tuple[int, int]]:
    """[start, n) cut into consecutive spans of at most `size` tokens that cover it. With
    `sentence_ends` (per token: does a sentence end with it), each span ends after the last sentence
    end in its second half when there is one, so that a sentence (a needle) is rarely cut in two."""
    if size < 1:
        raise ValueError("chunk size must be >= 1")
    last_end = None
    if sentence_ends is not None:
        ends = torch.as_tensor(sentence_ends, dtype=torch.bool)[:n]
        # last_end[j]: the latest position <= j after which a sentence ends (-1: none)
        last_end = torch.where(ends, torch.arange(len(ends)), -1).cummax(0).values.tolist()
    spans, s = [], start
    while s < n:
        e = min(s + size, n)
        if last_end is not None and e < n:
            j = last_end[e - 1]
            if j >= s + size // 2:
                e = j + 1
        spans.append((s, e))
        s = e
    return spans


def event_spans(lengths: Tensor, first: int) -> Tensor:
    """[E, 2] stream positions [start, end) of consecutive events of `lengths` [E], the first
    starting at `first` (the memory's events follow the n_init initial tokens)."""
    lengths = lengths.long().cpu()
    ends = torch.cumsum(lengths, 0) + first
    return torch.stack((ends - lengths, ends), 1)


def event_votes(selections: Sequence[Tensor], n_events: int) -> Tensor:
    """[E] how many of the selections (one per layer: event ids) hold each event."""
    if not selections:
        return torch.zeros(n_events, dtype=torch.long)
    ids = torch.cat([s.flatten().long().cpu() for s in selections])
    return torch.bincount(ids, minlength=n_events)[:n_events]


RRF_K = 60  # reciprocal rank fusion's constant (Cormack et al., SIGIR 2009): a rank's weight 1 / (60 + rank)


def token_votes(event_spans: Tensor, votes: Tensor, n: int) -> Tensor:
    """[n] float votes per stream token: its event's (`event_spans` [E, 2] stream positions
    [start, end), events disjoint; `votes` [E], counts or any weight)."""
    diff = torch.zeros(n + 1, dtype=torch.float64)
    if len(votes):
        s, e = event_spans[:, 0].long().clamp(0, n), event_spans[:, 1].long().clamp(0, n)
        diff.index_add_(0, s, votes.double())
        diff.index_add_(0, e, -votes.double())
    return diff.cumsum(0)[:n]


def passage_votes(tv: Tensor, spans: Sequence[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """([P] the most votes of any token, [P] the mean votes of the tokens) of each passage (`spans`
    of the stream, disjoint, in stream order; `tv` [n] votes per token, `token_votes`)."""
    lengths = torch.tensor([e - s for s, e in spans])
    first, last = spans[0][0], spans[-1][1]
    seg = torch.repeat_interleave(torch.arange(len(spans)), lengths)  # [tokens] passage of each token
    part = tv[first:last]
    most = torch.zeros(len(spans), dtype=tv.dtype).scatter_reduce(0, seg, part, "amax", include_self=False)
    mean = torch.zeros(len(spans), dtype=tv.dtype).index_add_(0, seg, part) / lengths
    return most, mean


def passage_order(tv: Tensor, spans: Sequence[tuple[int, int]],
                  votes: tuple[Tensor, Tensor] | None = None) -> list[int]:
    """Passage indices best first: by the most votes of any of their tokens, then by mean votes,
    then the earlier passage. `votes`: `passage_votes(tv, spans)`, where the caller has it."""
    if not spans:
        return []
    most, mean = votes if votes is not None else passage_votes(tv, spans)
    # lexsort: the last key is the primary one; stable sorts keep index order for ties
    order = torch.arange(len(spans))
    for key in (mean, most):
        order = order[torch.sort(-key[order], stable=True).indices]
    return order.tolist()


BM25_K1, BM25_B = 1.2, 0.75  # Okapi BM25's usual constants (Robertson and Zaragoza, 2009)


def lexical_scores(stream: Tensor, spans: Sequence[tuple[int, int]], query: Sequence[int] | Tensor,
                   k1: float = BM25_K1, b: float = BM25_B, pairs: bool = True) -> Tensor:
    """[P] float64 Okapi BM25 of each passage (`spans` of `stream` [n] token ids, disjoint) for the
    distinct token ids of `query` and its distinct pairs of consecutive ids, the passages their own
    collection: sum over the query's terms in a passage of idf * tf * (k1 + 1) / (tf + k1 * (1 - b
    + b * len / mean len)), with idf = ln(1 + (P - df + 0.5) / (df + 0.5)); a pair counts where a
    passage holds its two ids in a row (`pairs`; False: the ids alone, as before, for comparison).

    Why: the layers' votes find the look-alike needles of a multi-key question but tie on them
    (every layer selects all four); the asked key's name is in the question and in one passage.
    Why pairs: a name is several tokens, and the passages that use it share them; those that hold
    the question's words in its order ("class SlidingRows", "the value 12345") rank above those
    that hold them apart (the phrase terms of Metzler and Croft's sequential dependence model).
    docs/benchmarks.md, re-read answers."""
    p = len(spans)
    if p == 0:
        return torch.zeros(0, dtype=torch.float64)
    q = torch.as_tensor(query, dtype=torch.long).cpu().flatten()
    lengths = torch.tensor([e - s for s, e in spans])
    first, last = spans[0][0], spans[-1][1]
    seg = torch.repeat_interleave(torch.arange(p), lengths)  # [tokens] passage of each token
    toks = stream[first:last].long().cpu()
    norm = k1 * (1 - b + b * lengths.double() / lengths.double().mean())  # [P]

    def bm25(terms: Tensor, seen: Tensor, where: Tensor) -> Tensor:
        """terms [Q] sorted distinct; seen [m] the collection's terms, in passages `where` [m]
        (-1: in none)."""
        tf = torch.zeros(p, max(len(terms), 1), dtype=torch.float64)  # [P, Q]
        if len(terms):
            at = torch.searchsorted(terms, seen).clamp_max_(len(terms) - 1)
            hit = (terms[at] == seen) & (where >= 0)
            tf.view(-1).index_add_(0, where[hit] * len(terms) + at[hit], torch.ones(int(hit.sum()), dtype=torch.float64))
        df = (tf > 0).sum(0).double()
        idf = torch.log1p((p - df + 0.5) / (df + 0.5))
        return (idf * tf * (k1 + 1) / (tf + norm[:, None])).sum(1)

    scores = bm25(torch.unique(q), toks, seg)
    if pairs and len(q) > 1 and len(toks) > 1:  # pairs as one id each (v: past every id of both)
        v = max(int(toks.max()), int(q.max())) + 1
        within = torch.where(seg[:-1] == seg[1:], seg[:-1], -1)  # (a pair across two passages is in neither)
        scores += bm25(torch.unique(q[:-1] * v + q[1:]), toks[:-1] * v + toks[1:], within)
    return scores


def fuse_orders(orders: Sequence[Sequence[int]], n: int, k: int = RRF_K) -> list[int]:
    """The `n` items best first by the reciprocal rank fusion of `orders` (each a best-first list of
    the items it ranks; an item a list leaves out adds nothing to its score there): an item scores
    the sum of 1 / (k + its rank in each list, 0 first). Ties (the items no list ranks, too) keep
    the order of the first list, then the item's index."""
    score = torch.zeros(n, dtype=torch.float64)
    for order in orders:
        idx = torch.as_tensor(list(order), dtype=torch.long)
        score.index_add_(0, idx, 1.0 / (k + torch.arange(len(idx), dtype=torch.float64)))
    base = list(orders[0]) if orders else []
    seen = torch.zeros(n, dtype=torch.bool)
    seen[torch.as_tensor(base, dtype=torch.long)] = True
    base = torch.cat((torch.as_tensor(base, dtype=torch.long), torch.nonzero(~seen).flatten()))  # [n]
    return base[torch.sort(-score[base], stable=True).indices].tolist()


def choose_passages(order: Sequence[int], spans: Sequence[tuple[int, int]], room: int,
                    extra: Sequence[int] | None = None) -> list[int]:
    """The passages taken best first while they fit in `room` tokens (one that does not fit is
    passed over: a shorter one after it may), in stream order. extra: tokens each passage costs
    besides its own (a line naming its document), none if not given."""
    kept, used = [], 0
    for i in order:
        s, e = spans[i]
        cost = e - s + (extra[i] if extra is not None else 0)
        if used + cost <= room:
            kept.append(i)
            used += cost
    return sorted(kept)


__all__ = ["RRF_K", "chunk_spans", "event_spans", "event_votes", "fuse_orders", "lexical_scores", "token_votes", "passage_order", "passage_votes", "choose_passages"]
