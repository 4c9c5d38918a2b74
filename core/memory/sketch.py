"""A sketch of one layer's representative keys, so a retrieval over a large store reads a few
percent of `layers/NN.r` instead of all of it, and still selects exactly what the scan selects.
Pure math; the store keeps the arrays (store.py).

- Fit once, on the layer's first `trained_on` events: their mean and the `dims` principal
  directions (float64 eigen-decomposition of their covariance; the same events give the same
  basis). Every event is then kept as its `dims` coordinates in that basis, in float16 (128 bytes
  instead of 2,304 for SmolLM2's 9 x 64 floats), and three norms (12 bytes): its residual outside
  the basis, its residual inside it (the float16 rounding), and its own length.
- A query q scores every sketch: est = q . mean + (B^T q) . coords. The exact score differs by
  q . residual, at most |q_perp| |r_out| + |B^T q| |r_in|, plus the float32 rounding of both
  products (bounded for any order of summation): an upper bound for every event from its sketch
  alone (`upper_bound`).
- The best-estimated events until they hold the token budget are scored exactly; `select_events`
  on them stops at some event that does not fit (the stopper). An event whose upper bound is
  below the stopper's score can be neither selected nor an earlier stopper; the others are scored
  too, highest bound first, and the stopper rises as they come in (`exact_selection`). The
  selection is the scan's, bit for bit: a score's bits depend on its row alone
  (`memory.scores_in_blocks`), so the few rows scored here round as they do in the scan.

The bound replaces an earlier guard (a list of outliers: events whose residual exceeded every
training event's) that grew to half the events in the deep layers of a 1M-token passkey store
(the filler after the needle drifted off the basis fitted before it) and made a cold question
slower than the scan. On that store a question now scores a fraction of the events exactly (most
in the layers where thousands of copies of the filler tie within the bound); docs/benchmark-log.md
has the figures, and those of this bound's first version.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from emllm.memory.selection import Selection, gamma, score_error, select_events, work_buffer

DIMS = 64
FACTOR = 1
EST_BLOCK_ROWS = 1 << 14  # coordinates per matrix-vector product (2 MiB of float16 at 64 dims)
FIT_BLOCK_ROWS = 1 << 12  # events per block when fitting or projecting (18 MiB of float64 at 576 dims)


def fit(x: Tensor, dims: int = DIMS) -> tuple[Tensor, Tensor]:
    """x [n, dim] -> (mean [dim], basis [dim, dims]) float32: the top principal directions."""
    return fit_blocks(x.shape[0], lambda a, b: x[a:b], dims)


def fit_blocks(n: int, block: Callable[[int, int], Tensor], dims: int = DIMS) -> tuple[Tensor, Tensor]:
    """`fit` over rows 0..n-1 that block(start, stop) -> [stop - start, dim] gives a block at a time.

    Two passes (the mean, then the scatter matrix), float64, `FIT_BLOCK_ROWS` rows at a time: the
    memory is a block's, not the whole sample's in float64 twice over (fitting it at once raised
    an ingest's peak RSS markedly)."""
    total: Tensor | None = None
    for a in range(0, n, FIT_BLOCK_ROWS):
        part = block(a, min(n, a + FIT_BLOCK_ROWS)).detach().cpu().double().sum(0)
        total = part if total is None else total + part
    assert total is not None, "fit needs at least one row"
    mean = total / n
    scatter = torch.zeros(mean.numel(), mean.numel(), dtype=torch.float64)
    for a in range(0, n, FIT_BLOCK_ROWS):
        c = block(a, min(n, a + FIT_BLOCK_ROWS)).detach().cpu().double() - mean
        scatter += c.T @ c
    _, vecs = torch.linalg.eigh(scatter)  # ascending eigenvalues
    basis = vecs[:, -min(dims, vecs.shape[1]) :].flip(1)
    return mean.float(), basis.float().contiguous()


def project(x: Tensor, mean: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """Events x [n, dim] -> (coordinates [n, dims] float16, norms [n, 3] float32).

    norms: the residual outside the basis, the residual inside it (float16 rounding of the
    coordinates), the event's length |x|; rounded up, so bounds built on them hold.
    float64 row by row, so an event's sketch does not depend on the batch it came in (a resumed
    or appended ingest writes the same bytes as one run)."""
    xd = x.detach().double().cpu()
    c = xd - mean.double()
    b = basis.double()
    coords = (c @ b).half()
    r = c - coords.double() @ b.T  # [n, dim]
    r_in = r @ b  # [n, dims]
    r_out = r - r_in @ b.T
    norms = torch.stack((r_out.norm(dim=1), r_in.norm(dim=1), xd.norm(dim=1)), 1)
    up = norms.float()
    return coords, torch.where(up.double() < norms, torch.nextafter(up, torch.tensor(float("inf"))), up)


def estimate(n: int, block: Callable[[int, int], Tensor], query: Tensor, mean: Tensor, basis: Tensor) -> Tensor:
    """Estimated scores of events 0..n-1 from their coordinates [n] float64: q . mean + (B^T q) . coords.

    block(start, stop) -> coords [stop - start, dims] (float16). B^T q and q . mean in float64;
    only the product over the coordinates is float32, a matrix-vector product (its rounding,
    whatever the order of summation, is in `upper_bound`; the estimate's bits need not match
    anything, unlike exact scores)."""
    q = query.reshape(-1).double()
    u = (basis.double().T @ q).float()  # [dims]
    out = torch.empty(n, dtype=torch.float32)
    for start in range(0, n, EST_BLOCK_ROWS):
        stop = min(n, start + EST_BLOCK_ROWS)
        w = work_buffer(stop - start, u.numel(), out.device)
        w.copy_(block(start, stop))
        torch.mv(w, u, out=out[start:stop])
    return out.double() + float(q @ mean.double())


def upper_bound(est: Tensor, norms: Tensor, query: Tensor, mean: Tensor, basis: Tensor) -> Tensor:
    """The most each event's score, as the scan computes it (float32), can be, from its sketch alone.

    est [n] from `estimate`; norms [n, 3] as `project`; query [dim] -> [n] float64.
    exact = q . mean + u . coords + q . r, with r = B r_i + r_o (r_i = B^T r, |r_i| = r_in,
    |r_o| = r_out): q . r = u . r_i + (q - B u) . r_o + u . (B^T r_o), and B^T r_o = (I - B^T B) r_i
    is not quite 0 (a float32 basis is orthonormal to rounding). So exact <= est + |q_perp| r_out
    + |u| r_in (1 + |I - B^T B|) + the rounding of the estimate's float32 product (u rounded to
    float32: one more ulp; |coords| <= |x| + |mean| + r_in) + the rounding of the scan's own
    float32 score (`memory.score_error(dim)` |q| |x|) + float64 crumbs."""
    q = query.reshape(-1).double()
    b = basis.double()
    u = b.T @ q
    q_perp = float((q - b @ u).norm())
    off = float(torch.linalg.matrix_norm(torch.eye(b.shape[1], dtype=torch.float64) - b.T @ b))  # Frobenius >= 2-norm
    qn, un, mn = float(q.norm()), float(u.norm()), float(mean.double().norm())
    r_out, r_in, length = norms.double().unbind(1)
    coords = length + mn + r_in
    rounding = score_error(q.numel()) * qn * length + (gamma(b.shape[1]) + 2.0**-23) * un * coords
    crumbs = 2.0**-40 * (est.abs() + qn * (length + mn))
    return est + q_perp * r_out + un * (1 + off) * r_in + rounding + crumbs


def stopper(scores: Tensor, lengths: Tensor, budget: int) -> float:
    """The score of the first event, best first, that no longer fits in `budget` tokens
    (select_events stops there); -inf when everything fits."""
    rest = torch.ones(scores.numel(), dtype=torch.bool)
    rest[select_events(scores, lengths, budget).ids] = False  # the selection is a prefix of the ranking
    return float(scores[rest].max()) if bool(rest.any()) else float("-inf")


def candidates(est: Tensor, lengths: Tensor, budget: int, factor: int = FACTOR) -> Tensor:
    """The best-estimated events until they hold `factor` x `budget` tokens (one more, so the
    first that crosses is in). est [n] float32, lengths [n] long -> ids [m] long, unsorted."""
    n = est.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    need = factor * budget
    k = min(n, need // max(1, int(lengths.min())) + 1)  # k events surely hold `need` tokens
    top = torch.topk(est, k).indices  # best first
    reach = torch.cumsum(lengths[top], 0)
    m = min(k, int(torch.searchsorted(reach, need)) + 1)
    return top[:m]


def exact_selection(est: Tensor, ub: Tensor, lengths: Tensor, budget: int,
                    score: Callable[[Tensor], Tensor], unsketched: Tensor, factor: int | None = None) -> Selection:
    """`select_events` over every event, scoring exactly only the events that can change it.

    est, ub [n_s]: the sketched events' estimates and bounds; lengths [E] (E >= n_s: events
    n_s.. have no sketch and are always scored); score(ids [m] increasing) -> exact scores [m];
    unsketched: ids n_s..E-1. The best-estimated events until they hold factor x budget tokens
    are scored first; then, while a sketched event's bound reaches the stopper of what is scored,
    the ones with the highest bounds are scored (a batch that doubles), and the stopper, which
    only rises as events are added, is recomputed. Whatever is left out has a bound below the
    final stopper: it is neither selected nor a stopper in the full ranking either."""
    n_s = est.numel()
    ids = torch.unique(torch.cat((candidates(est, lengths[:n_s], budget, FACTOR if factor is None else factor), unsketched)))
    scores = score(ids)
    open_ = torch.ones(n_s, dtype=torch.bool)
    open_[ids[ids < n_s]] = False
    batch = max(64, ids.numel())
    while True:
        reach = torch.nonzero(open_ & (ub >= stopper(scores, lengths[ids], budget))).squeeze(1)
        if reach.numel() == 0:
            break
        if reach.numel() > batch:
            reach = reach[torch.topk(ub[reach], batch).indices].sort().values
            batch *= 2
        open_[reach] = False
        ids, scores = torch.cat((ids, reach)), torch.cat((scores, score(reach)))
    order = torch.argsort(ids)  # ties break by id, as in the scan
    ids, scores = ids[order], scores[order]
    sel = select_events(scores, lengths[ids], budget)
    return Selection(ids[sel.ids], sel.scores)


__all__ = ["fit", "fit_blocks", "project", "estimate", "upper_bound", "candidates", "stopper", "exact_selection", "DIMS", "FACTOR", "FIT_BLOCK_ROWS"]
