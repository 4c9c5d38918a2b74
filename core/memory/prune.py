"""Exact selection from one matrix-vector product: every event's score estimated at BLAS speed,
only the events that can matter scored exactly. Pure math.

The exact score (`memory.scores_in_blocks`) reads each representative key three times and writes
it out twice in float32 so that a score's bits depend on its row alone; one generated token scans
every event of every layer that way (0.64 ms a layer for 2,278 events, against 0.09 ms for
`torch.mv` over the same rows held in float32, measured on the project's CPU). `torch.mv` rounds
a row differently with the rows around it, so its scores cannot select by themselves; but both
are float32 sums of the same products, so they differ by at most

    |mv - exact| <= (gamma(dim) + score_error(dim)) * sum_i |q_i x_i|
                 <= (gamma(dim) + score_error(dim)) * |q| |x|

(Higham 3.1, any order of summation, fused or not). With |x| kept per event, that is an upper
bound for every event's exact score from its estimate; `select` then scores exactly the
best-estimated events and every event whose bound reaches their stopper, and selects what the
full scan selects, bit for bit (the same rows, the same exact scores).
"""

from __future__ import annotations

import torch
from torch import Tensor

from emllm.memory.selection import Selection, event_scores, gamma, score_error, select_events, work_buffer
from emllm.memory.sketch import candidates, stopper


# Below this many events, scoring every one exactly costs less than the estimate, the bound and
# the extra selection steps (measured on the project's CPU, SmolLM2's 576 dims: 251 events 0.12
# against 0.37 ms, 2,278 events 0.71 against 0.5 ms).
PRUNE_FROM = 2048


def norms_up(x: Tensor) -> Tensor:
    """x [n, dim] -> |x| [n] float32, rounded up (computed in float64): bounds built on it hold."""
    n64 = x.double().norm(dim=1)
    up = n64.float()
    return torch.where(up.double() < n64, torch.nextafter(up, torch.tensor(float("inf"))), up)


# Rows kept in a half dtype (a half store's) are widened a block at a time into a buffer that stays
# in the processor's cache, and each block is one float32 mv: the products and sums are float32 as
# for float32 rows (widening is exact), so the same bound holds. Not faster than one float32 mv
# (measured at 18.9k events x 576, 30 layers' rows: 2.08 ms against 1.94 at blocks of 512, the
# best of 256..4096; a decode step at 256k ~9% slower), but half the RAM.
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


def upper_bound(est: Tensor, norms: Tensor, query: Tensor) -> Tensor:
    """The most each event's exact score can be, given its estimate: est [n], norms [n] (|x|,
    rounded up), query [dim] -> [n] float32.

    In float32 (a generated token computes this for every event of every layer): the slack is
    taken 2^-10 wider and |est| 2^-20 wider than it is, which covers the rounding of the three
    float32 operations here (each within 2^-24 relative) many times over."""
    q = query.reshape(-1).double()
    dim = q.numel()
    slack = (gamma(dim) + score_error(dim)) * float(q.norm()) * (1 + 2.0**-10)
    out = est.abs().mul_(2.0**-20)
    out.add_(norms, alpha=slack).add_(est)
    return out.add_(2.0**-100)  # (an est of 0 with norms of 0: still >= the exact 0)


def select(rows: Tensor, norms: Tensor, query: Tensor, lengths: Tensor, budget: int,
           tail: Tensor | None = None) -> Selection:
    """`select_events(event_scores(rows, query), lengths, budget)` from an mv estimate.

    rows [R, dim] float32, or bfloat16/float16 (every event's representative key, as a store of
    that format holds it), norms [R] from `norms_up`; tail [T] (optional): the exact scores of T
    more events after those (a store's events past what stays resident, scanned from its file);
    lengths [R + T]. The selection is the one of all R + T exact scores, bit for bit."""
    tail = torch.zeros(0) if tail is None else tail.float()
    n = rows.shape[0]
    if n + tail.numel() == 0 or budget <= 0:
        return select_events(torch.zeros(0), lengths, 0)
    est = estimate(rows, query) if n >= PRUNE_FROM else None
    # few events; or a NaN/inf key (its estimate, hence the sum, is not finite): no bound holds.
    # (A sum that overflows with finite terms also takes the scan: slower, still exact.)
    if est is None or not bool(torch.isfinite(est.sum() + tail.sum())):
        return select_events(torch.cat((event_scores(rows, query), tail)), lengths, budget)
    # a tail event's bound and estimate are its exact score
    ub = torch.cat((upper_bound(est, norms, query), tail))
    est = torch.cat((est, tail))

    def exact(ids: Tensor) -> Tensor:  # ids [m] (sorted) -> their exact scores [m]
        held = ids < n
        if bool(held.all()):
            return event_scores(rows[ids], query)  # a score's bits depend on its row alone
        out = torch.empty(ids.numel(), dtype=torch.float32)
        out[held] = event_scores(rows[ids[held]], query)
        out[~held] = tail[ids[~held] - n]
        return out

    # One round of `sketch.exact_selection` (its loop exists for loose bounds): score the
    # best-estimated events that hold the budget, then every event whose bound reaches their
    # stopper. The stopper of a subset is at most the full ranking's, so an event left out ranks
    # after the full ranking's stopper: neither selected nor stopping it.
    first = candidates(est, lengths, budget + 1).sort().values  # more than the budget: one cannot fit
    first_scores = exact(first)
    bar = stopper(first_scores, lengths[first], budget)
    ids = torch.unique(torch.cat((torch.nonzero(ub >= bar).squeeze(1), first)))
    if ids.numel() == first.numel():  # nothing beyond the first candidates can matter
        ids, scores = first, first_scores
    else:
        scores = exact(ids)
    sel = select_events(scores, lengths[ids], budget)
    return Selection(ids[sel.ids], sel.scores)


__all__ = ["PRUNE_FROM", "ESTIMATE_BLOCK", "norms_up", "estimate", "upper_bound", "select"]
