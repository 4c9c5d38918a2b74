"""A sketch of one layer's representative keys, so a retrieval over a large store reads a few
percent of `layers/NN.r` instead of all of it, and still selects exactly what the scan selects.
Pure math; the store keeps the arrays (store.py).

- Fit once, on the layer's first `trained_on` events: their mean and the `dims` principal
  directions (float64 eigen-decomposition of their covariance; the same events give the same
  basis). Every event is then kept as its `dims` coordinates in that basis, in float16 (128 bytes
  instead of 2,304 for SmolLM2's 9 x 64 floats), and three norms (12 bytes): its residual outside
  the basis, its residual inside it (the float16 rounding), and its own length.
- A query q scores every sketch: est = q . mean + (B^T q) . coords. The exact score differs by
  q . residual, at most |q_perp| |r_out| + |B^T q| |r_in| (q_perp: q outside the basis), plus
  float32 rounding: an upper bound for every event from its sketch alone.
- The best-estimated events until they hold `factor` x the token budget are scored exactly;
  `select_events` on them stops at some event that does not fit (the stopper). An event whose
  upper bound is below the stopper's score can be neither selected nor an earlier stopper, so
  only the others are scored exactly too, and the selection is the scan's, exactly.

The bound replaces an earlier guard (a list of outliers: events whose residual exceeded every
training event's) that grew to half the events in the deep layers of a 1M-token passkey store
(the filler after the needle drifted off the basis fitted before it) and made a cold question
slower than the scan. Measured there, the bound left 4-30 events to score in most layers and up
to 30k in a few (near-identical filler events within the bound of the stopper), against 42k
outliers; and the factor-8 candidates alone missed up to 8 of a layer's selected events, which
the bound brings back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .memory import select_events

DIMS = 64
FACTOR = 8


def fit(x: Tensor, dims: int = DIMS) -> tuple[Tensor, Tensor]:
    """x [n, dim] -> (mean [dim], basis [dim, dims]) float32: the top principal directions."""
    xd = x.detach().double().cpu()
    mean = xd.mean(0)
    c = xd - mean
    _, vecs = torch.linalg.eigh(c.T @ c)  # ascending eigenvalues
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


def slack(dim: int) -> float:
    """Relative float32 rounding of a dot product over `dim` terms (dim * 2^-24), doubled: it
    covers the exact score and the estimate it is compared with."""
    return 2 * dim * 2.0**-24


def upper_bound(est: Tensor, norms: Tensor, query: Tensor, mean: Tensor, basis: Tensor) -> Tensor:
    """The most each event's exact score can be, from its sketch alone.

    est [n] = q . mean + (B^T q) . coords (float32); norms [n, 3] as `project`; query [dim]."""
    q = query.double()
    u = basis.double().T @ q
    q_perp = float((q - basis.double() @ u).norm())
    qn, mn = float(q.norm()), float(mean.double().norm())
    r_out, r_in, length = norms.unbind(1)
    return est + q_perp * r_out + float(u.norm()) * r_in + slack(q.numel()) * qn * (length + mn)


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


__all__ = ["fit", "project", "candidates", "upper_bound", "stopper", "slack", "DIMS", "FACTOR"]
