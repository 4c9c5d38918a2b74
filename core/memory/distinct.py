"""Identical events counted once in a question's selection (profile `distinct_events`).

A conversation repeats itself: the chat template frames every turn with the same tokens, and a
small model gives the same reply again and again. Each copy is an event of its own, it scores
as its copies do, and a question's selection filled much of its token budget with copies of one
event, crowding out the facts (docs/benchmarks.md, a remembered conversation). Spans of the
stream with the same token ids form a group; a selection ranks the best-scoring span of each
first, and the other copies only after every group (`selection.select_events`).

Pure math: token ids and spans in, group labels and positions out.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

_P = (1 << 31) - 1  # a prime: each hash is a polynomial in the token ids modulo it
_SEEDS = (0x5EED, 0xD15C)  # two hashes with weights of fixed seeds: the same groups in every process


def _weights(n: int, seed: int) -> Tensor:
    """[n] int64 weights in [1, P) for the offsets 0..n-1 inside a span (fixed by `seed`)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, _P, (max(n, 1),), generator=g, dtype=torch.int64)


def span_groups(ids: Tensor, spans: Tensor) -> Tensor:
    """ids [N] the stream's token ids, spans [K, 2] stream positions [start, end) -> [K] int64
    group labels, equal for spans of the same length holding the same ids (0..G-1, G groups).

    Each span's ids are hashed twice, (length * w_L + sum_j (id_j + 1) * w_j) mod P with random
    weights w per offset j: two different spans collide in both with probability ~P^-2 ~ 2^-62.
    Vectorised over all tokens of all spans (no loop over spans); the two hashes make one int64
    key, so the grouping is a 1-D unique (a unique over [K, 3] rows is slow at 1M tokens)."""
    spans = spans.long().cpu()
    k = spans.shape[0]
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    lengths = (spans[:, 1] - spans[:, 0]).clamp_min(0)  # [K]
    n = int(lengths.sum())
    owner = torch.repeat_interleave(torch.arange(k), lengths)  # [n] the span of each token
    first = torch.cumsum(lengths, 0) - lengths  # [K] where each span's tokens begin in the flat list
    offset = torch.arange(n) - first[owner]  # [n] offset inside its span
    tok = ids.long().cpu()[spans[owner, 0] + offset] + 1  # [n] (+1: an id 0 still counts)
    width = int(lengths.max())
    hashes = []
    for seed in _SEEDS:
        w = _weights(width + 1, seed)  # (the last weight is the length's)
        terms = tok * w[offset] % _P  # [n] each < P: a span's sum fits in int64
        h = torch.zeros(k, dtype=torch.int64).index_add_(0, owner, terms)
        hashes.append((h + lengths * w[-1]) % _P)
    return torch.unique(hashes[0] * _P + hashes[1], return_inverse=True)[1]  # (< P^2 < 2^62)


def best_of_groups(scores: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """scores [n], groups [n] -> positions [g] (int64, increasing): each group's best-scoring
    member, the earliest among equal scores (a NaN score counts as the best, as in
    `selection.select_positions`)."""
    if scores.size == 0:
        return np.zeros(0, dtype=np.int64)
    key = np.where(np.isnan(scores), np.inf, scores)
    order = np.lexsort((np.arange(scores.size), -key, groups))  # by group, then best first, then earliest
    g = groups[order]
    head = np.ones(order.size, dtype=bool)
    head[1:] = g[1:] != g[:-1]
    return np.sort(order[head]).astype(np.int64)


__all__ = ["span_groups", "best_of_groups"]
