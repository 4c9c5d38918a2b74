"""Exact selection from one matrix-vector product: every event's score estimated at BLAS speed,
only the events that can matter scored exactly. Pure math.

The exact score (`memory.scores_in_blocks`) reads each representative key three times and writes
it out twice in float32 so that a score's bits depend on its row alone; one generated token scans
every event of every layer that way, several times slower than `torch.mv` over the same rows
held in float32 (docs/benchmark-log.md). `torch.mv` rounds
a row differently with the rows around it, so its scores cannot select by themselves; but both
are float32 sums of the same products, so they differ by at most

    |mv - exact| <= (gamma(dim) + score_error(dim)) * sum_i |q_i x_i|
                 <= (gamma(dim) + score_error(dim)) * |q| |x|

(Higham 3.1, any order of summation, fused or not). With |x| kept per event, that bounds every
event's exact score from its estimate, above and below (`bounds`; bfloat16 rows are estimated in
bfloat16, with a wider slack: `split_estimate`). The lower bounds alone give a floor of the
score where the full ranking stops (`stopper_floor`); `select` scores exactly every event whose
upper bound reaches it, and selects what the full scan selects, bit for bit (the same rows, the
same exact scores). After the product, the bookkeeping runs in numpy on the host: a few dozen
operations on a few thousand numbers, each of which costs torch several microseconds more (a
generated token runs one selection per layer). Rows live in host memory (a store's resident keys).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from emllm.memory.selection import (Selection, event_scores, events_past, gamma, score_error, select_events,
                                    select_positions, work_buffer)


# Below this many events, scoring every one exactly costs less than the estimate, the bound and
# the extra selection steps (the crossover measured on the project's CPU, for keys per query head
# and per KV head: docs/benchmark-log.md).
PRUNE_FROM = 2048

SAMPLE = 2048  # estimates a selection samples for its first threshold (`_candidates`)


NORM_BLOCK = 1024  # rows widened to float64 at a time by `norms_up`


def norms_up(x: Tensor) -> Tensor:
    """x [n, dim] -> |x| [n] float32, rounded up (computed in float64): bounds built on it hold.

    In blocks of rows: a float64 copy of a whole store's resident keys is fresh memory every
    call, and its page faults made this a large share of a large store's first question (each
    row's norm is the same bits either way)."""
    n64 = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    for a in range(0, x.shape[0], NORM_BLOCK):
        n64[a : a + NORM_BLOCK] = x[a : a + NORM_BLOCK].double().norm(dim=1)
    up = n64.float()
    return torch.where(up.double() < n64, torch.nextafter(up, torch.tensor(float("inf"))), up)


# float16 rows (and half rows off the CPU; bfloat16 rows on it take `split_estimate`) are widened
# a block at a time into a buffer that stays in the processor's cache, and each block is one
# float32 mv: the products and sums are float32 as
# for float32 rows (widening is exact), so the same bound holds. A little slower than one float32
# mv (512 the best block measured: docs/benchmark-log.md), but half the RAM.
ESTIMATE_BLOCK = 512


def estimate(rows: Tensor, query: Tensor) -> Tensor:
    """rows [n, dim] (float32, or bfloat16/float16: widened exactly), query [dim] -> estimated
    scores [n] float32 (BLAS mv, one per block of half rows)."""
    q = query.reshape(-1).float()
    if rows.dtype == torch.float32:
        return torch.mv(rows, q)
    n, dim = rows.shape
    out = torch.empty(n, dtype=torch.float32, device=rows.device)
    for a in range(0, n, ESTIMATE_BLOCK):
        b = min(n, a + ESTIMATE_BLOCK)
        w = work_buffer(b - a, dim, rows.device, slot=2)
        w.copy_(rows[a:b])
        torch.mv(w, q, out=out[a:b])
    return out


def _norm64(query: Tensor) -> float:
    return float(np.linalg.norm(query.reshape(-1).float().numpy().astype(np.float64)))


def bounds(rows: Tensor, norms: Tensor, query: Tensor) -> tuple[Tensor, Tensor]:
    """rows [n, dim], norms [n] (`norms_up`), query [dim] -> (lower, upper) [n] float32: each
    event's exact score (`event_scores`) lies between them; the bounds `select` uses.

    bfloat16 rows: one bfloat16 matrix product against the query split in two
    (`split_estimate`); float32 rows: one float32 mv (`estimate`), within
    (gamma(dim) + score_error(dim)) |q| |x| (Higham 3.1), taken a little wider for the float32
    arithmetic of the bound itself; float16 rows: widened a block at a time (`estimate`), the same."""
    est, terms = _estimate(rows, query)
    slack = _slack(est, norms.numpy(), terms)
    return torch.from_numpy(est - slack), torch.from_numpy(est + slack)


def split_estimate(rows: Tensor, norms: Tensor, query: Tensor) -> tuple[Tensor, Tensor]:
    """bfloat16 rows [n, dim] -> (estimates, slack) [n] float32, |exact score - estimate| <= slack.

    The query is split into two bfloat16 vectors, q = hi + lo + r with |lo_i| <= 2^-8 |q_i| and
    |r_i| <= 2^-16 |q_i|, and both are scored in one bfloat16 matrix product ([n, dim] x
    [dim, 2]): the products of two bfloat16 numbers are exact in float32 and summed in float32
    (gamma(dim)), but each result o is rounded to bfloat16, within 2^-8 |o| of its sum. With
    |o_hi| + |o_lo| <= |est| + 2 |o_lo| and |o_lo| <= 2^-8 (1 + 2^-7) |q| |x|, per event:

        |est - exact| <= 2^-8 |est| + (2^-15 + 2^-16 + gamma(dim) + score_error(dim)) |q| |x|

    (the last term the exact score's own rounding), plus flushed subnormals, a few 2^-126 per sum
    (`tiny`). Every factor is taken a little wider than that, which covers the float32 arithmetic
    of the estimate and of the slack itself. Measured on a store's question, it leaves about as
    many events to score exactly as the float32 mv's bound, in less time than widening the rows
    block by block (docs/benchmark-log.md)."""
    est = _split_product(rows, query)
    return torch.from_numpy(est), torch.from_numpy(_slack(est, norms.numpy(), _slack_terms(query.numel(), _norm64(query))))


def _split_product(rows: Tensor, query: Tensor) -> np.ndarray:
    """The estimates [n] float32 of `split_estimate`: one bfloat16 product against hi and lo."""
    q = query.reshape(-1).float()
    hi = q.to(torch.bfloat16)
    lo = (q - hi.float()).to(torch.bfloat16)  # (q - hi is exact: they are within a factor of 2)
    # [2, dim] x [dim, n] (rows read transposed, no copy): faster than [n, dim] x [dim, 2], and
    # each result row is contiguous for the sum
    o = torch.mm(torch.stack((hi, lo)), rows.t()).float().numpy()  # [2, n]
    return o[0] + o[1]


def _slack_terms(dim: int, qn: float) -> tuple[np.float32, np.float32, np.float32]:
    """(a, b, c): the slack of `split_estimate` is a |est| + b |x| + c, each event's."""
    tiny = dim * 2.0**-120 * (1 + qn)
    per_norm = ((2.0**-15 + 2.0**-16) * (1 + 2.0**-5) + gamma(dim) * (1 + 2.0**-7) + score_error(dim)) * qn * (1 + 2.0**-10)
    return np.float32(2.0**-8 * (1 + 2.0**-5)), np.float32(per_norm + tiny), np.float32(tiny + 2.0**-100)


def _slack(est: np.ndarray, norms: np.ndarray, terms: tuple[np.float32, np.float32, np.float32]) -> np.ndarray:
    a, b, c = terms
    slack = np.abs(est) * a
    slack += norms * b
    slack += c
    return slack


def stopper_floor(lower: Tensor, lengths: Tensor, budget: int) -> float:
    """A score at or below the exact ranking's stopper, from lower bounds alone (-inf when every
    event fits): the lower bound of the event at which the best lower bounds first hold more
    than `budget` tokens. Those events all score at least that much and cannot all be selected,
    so the ranking stops at one of them or before."""
    return _floor(lower.numpy(), lengths.numpy(), budget)


def _floor(lower: np.ndarray, lengths: np.ndarray, budget: int) -> float:
    n = lower.size
    if n == 0:
        return float("-inf")
    k = events_past(budget, int(lengths.min()), n)
    top = np.argpartition(lower, n - k)[n - k :] if k < n else np.arange(n)
    top = top[np.argsort(-lower[top], kind="stable")]  # best first
    m = int(np.searchsorted(np.cumsum(lengths[top]), budget, side="right"))  # the first past the budget
    return float(lower[top[m]]) if m < top.size else float("-inf")


def _estimate(rows: Tensor, query: Tensor) -> tuple[np.ndarray, tuple[np.float32, np.float32, np.float32]]:
    """(estimates [n] float32, (a, b, c)): every event's exact score lies within
    a |est| + b |x| + c of its estimate. bfloat16 rows: `split_estimate`. float32 and float16
    rows: `estimate`, off by at most (gamma(dim) + score_error(dim)) |q| |x|, taken 2^-10 wider,
    plus 2^-20 |est| and 2^-100: that covers the rounding of the float32 operations on the bounds
    (each within 2^-24 relative) many times over, and an estimate of 0 with |x| = 0."""
    qn = _norm64(query)
    if rows.dtype == torch.bfloat16:
        return _split_product(rows, query), _slack_terms(query.numel(), qn)
    b = (gamma(query.numel()) + score_error(query.numel())) * qn * (1 + 2.0**-10)
    return estimate(rows, query).numpy(), (np.float32(2.0**-20), np.float32(b), np.float32(2.0**-100))


def select(rows: Tensor, norms: Tensor, query: Tensor, lengths: Tensor, budget: int,
           tail: Tensor | None = None) -> Selection:
    """`select_events(event_scores(rows, query), lengths, budget)` from an estimate.

    rows [R, dim] float32, or bfloat16/float16 (every event's representative key, as a store of
    that format holds it), norms [R] from `norms_up`; tail [T] (optional): the exact scores of T
    more events after those (a store's events past what stays resident, scanned from its file);
    lengths [R + T]. All on the host. The selection is the one of all R + T exact scores, bit for
    bit.

    Every event's score is estimated within a slack a |est| + b |x| + c (`_estimate`; a tail
    event's estimate is its exact score, |x| taken 0: the slack still holds). Since the slack is
    at most a |est| + b max|x| + c, both bounds increase with the estimate, so the bounds are
    computed only for the events near the top (`_candidates`); every event whose upper bound
    reaches a floor of the stopper is scored exactly, and the selection over those stops where the
    full ranking stops."""
    tail_np = np.zeros(0, dtype=np.float32) if tail is None else tail.float().numpy()
    n = rows.shape[0]
    if n + tail_np.size == 0 or budget <= 0:
        return select_events(torch.zeros(0), lengths, 0)
    if n >= PRUNE_FROM:
        est, terms = _estimate(rows, query)
        nrm = norms.numpy()
        if tail_np.size:
            est, nrm = np.concatenate((est, tail_np)), np.concatenate((nrm, np.zeros(tail_np.size, np.float32)))
        # (a NaN or infinite key or norm: no bound holds; a sum that overflows with finite terms
        # takes the scan too: slower, still exact)
        if math.isfinite(float(est.sum()) + float(nrm.max())):
            lens = lengths.numpy()
            ids = _candidates(est, nrm, terms, lens, budget)
            held = ids < n
            scores = np.empty(ids.size, dtype=np.float32)
            # a score's bits depend on its row alone
            scores[held] = event_scores(rows[torch.from_numpy(ids[held])], query).numpy()
            scores[~held] = tail_np[ids[~held] - n]
            pos = select_positions(scores, lens[ids], budget)
            return Selection(torch.from_numpy(ids[pos]), torch.from_numpy(scores[pos]))
    # few events (scoring them all costs less), or no bound holds
    return select_events(torch.cat((event_scores(rows, query), torch.from_numpy(tail_np))), lengths, budget)


def _candidates(est: np.ndarray, nrm: np.ndarray, terms: tuple[np.float32, np.float32, np.float32],
                lens: np.ndarray, budget: int) -> np.ndarray:
    """The events [m] (increasing) whose upper bound reaches a floor of the stopper: the
    selection over their exact scores is the full ranking's.

    (1) The floor comes from the events estimated above a threshold T read off a sample of every
    s-th estimate, about 2k events (any events whose lower bounds hold more than the budget give
    a floor: they cannot all be selected); only where they hold too few tokens are the best k
    estimates partitioned out of all of them. (2) An event estimated below the t where
    t + a |t| + b max|x| + c reaches the floor cannot reach it: only the events at or above t
    get their own bounds. At 17k events a layer, a few passes over the estimates instead of a
    dozen and a partition of all of them (docs/benchmark-log.md)."""
    n = est.size

    def lower(ids: np.ndarray) -> np.ndarray:
        e = est[ids]
        return e - _slack(e, nrm[ids], terms)

    k = events_past(budget, int(lens.min()), n)
    stride = max(1, n // SAMPLE)
    sample = est[::stride]
    r = -(-2 * k // stride)  # the sample's r-th best: about 2k events estimated at least as well
    floor = float("-inf")
    if r < sample.size:
        near = np.flatnonzero(est >= np.partition(sample, sample.size - r)[sample.size - r])
        floor = _floor(lower(near), lens[near], budget)
    if floor == float("-inf"):  # they hold too few tokens (or there are few events): the best k
        top = np.argpartition(est, n - k)[n - k :] if k < n else np.arange(n)
        floor = _floor(lower(top), lens[top], budget)
    if floor == float("-inf"):  # everything fits
        return np.arange(n)
    a, b, c = (float(x) for x in terms)
    d = floor - (b * float(nrm.max()) + c)  # an event reaching the floor has est + a |est| >= d
    t = d / (1 + a) if d >= 0 else d / (1 - a)
    t -= (abs(t) + abs(floor) + abs(d)) * 2.0**-12 + 2.0**-120  # (room for the bounds' float32 arithmetic)
    near = np.flatnonzero(est >= np.float32(t))
    e = est[near]
    return near[e + _slack(e, nrm[near], terms) >= floor]


__all__ = ["PRUNE_FROM", "ESTIMATE_BLOCK", "norms_up", "estimate", "bounds", "split_estimate",
           "stopper_floor", "select"]
