"""Event segmentation: boundaries (F, S, random), refinement (M, C) and graph metrics.

Pure tensor math (paper §3.2-3.3, Algorithm 1, Table 2; spec §2-§3). No I/O.

Conventions
-----------
* A segmentation of ``n`` tokens is ``starts``: 1-D ``torch.long``, strictly increasing,
  ``starts[0] == 0``, all ``< n``. Event ``i`` covers ``[starts[i], starts[i+1])``; the last one
  ends at ``n``.
* A similarity graph is a dense symmetric float ``A [n, n]``. Entry ``A_ij`` (i != j) is the weight
  of the undirected edge {i, j}; ``A_ii`` is the weight of a self-loop on i.

Self-loops
----------
Keys have a large self-similarity ``|k_i|^2`` on the diagonal. All metrics treat ``A_ii`` the way
``networkx`` treats a self-loop of weight ``A_ii`` in an undirected graph built by
``nx.from_numpy_array(A)``: it adds ``2 * A_ii`` to node i's weighted degree (and hence to the
volume and to 2m), and ``A_ii`` once to the internal weight of i's community. In matrix terms,
modularity and volumes are those of ``A' = A + diag(diag(A))``; the cut of a set never involves
the diagonal. So our values equal networkx's on every graph with non-negative weights.

Negative similarities
---------------------
Dot products of keys can be negative; networkx (and the graph reading of modularity and
conductance) needs non-negative weights. ``key_adjacency`` therefore clamps the summed
similarity at 0 by default (``A = relu(sum_h K_h K_h^T)``): an anti-aligned pair is "no edge",
not a repulsive one. The reference implementation used the raw, possibly negative sums; pass
``clamp_negative=False`` for that. The metric functions and ``refine`` accept any symmetric A and
evaluate the same closed formulas, but only for ``A >= 0`` do the values mean what their names say
(e.g. a negative volume makes conductance meaningless).

Precision
---------
Block sums come from 2-D prefix sums accumulated in float64 (float32 on MPS, which has no
float64), so differences of large prefix sums stay exact enough to rank candidate boundaries.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

METRICS = ("modularity", "conductance")


# -- boundaries ---------------------------------------------------------------------------------
def fixed_starts(n: int, block: int, device: torch.device | str | None = None) -> Tensor:
    """Starts of fixed-size blocks (InfLLM, variant F): 0, block, 2*block, ... < n."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    return torch.arange(0, n, block, dtype=torch.long, device=device)


def surprise_starts(flags: Tensor, min_block: int, max_block: int) -> Tensor:
    """Event starts from boundary-candidate flags, with event sizes in [min_block, max_block].

    flags: bool [n]; flags[t] means token t may start a new event (flags[0] is ignored: token 0
    always starts one). Greedy left to right from the current start s: the next start is the first
    candidate t >= s + min_block (closer candidates are ignored, so the short piece merges into
    the following event), unless that is further than max_block, in which case the event is cut at
    s + max_block. Every event but the last has a length in [min_block, max_block]; the last one
    (still open in a stream) may be shorter than min_block. Returns long [k] on flags' device.

    One loop step per event (searchsorted over the candidate positions), none per token.
    """
    if not 1 <= min_block <= max_block:
        raise ValueError(f"need 1 <= min_block <= max_block, got {min_block}, {max_block}")
    n = int(flags.shape[0])
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=flags.device)
    cand = torch.nonzero(flags.reshape(-1)).reshape(-1).cpu().numpy()  # sorted candidate positions
    out = [0]
    s = 0
    while True:
        j = int(np.searchsorted(cand, s + min_block))  # first candidate far enough from s
        t = int(cand[j]) if j < cand.size else n
        t = min(t, s + max_block)  # a run longer than max_block is cut
        if t >= n:
            break
        out.append(t)
        s = t
    return torch.tensor(out, dtype=torch.long, device=flags.device)


def enforce_block_sizes(starts: Tensor, n: int, min_block: int, max_block: int) -> Tensor:
    """Apply surprise_starts' min/max rule to an existing segmentation (e.g. after refinement).

    Each start is a candidate; starts that would leave an event shorter than min_block are
    dropped (the piece merges into the next event) and events longer than max_block are cut.
    A segmentation that already satisfies the rule comes back unchanged.
    """
    flags = torch.zeros(n, dtype=torch.bool, device=starts.device)
    flags[starts] = True
    return surprise_starts(flags, min_block, max_block)


def refined_max_block(method: str, max_block: int) -> int:
    """The longest event a segmentation method leaves (F, S: max_block).

    Surprise events (SM, SC) keep max_block. Fixed blocks (FM, FC) are all max_block long, and a
    boundary only moves left, growing the next event: held to max_block, no boundary could ever
    move and FM, FC would equal F. They may grow to twice max_block, the window the authors' code
    lets a refined event span.
    """
    return 2 * max_block if method in ("FM", "FC") else max_block


def random_starts(n: int, k: int, generator: torch.Generator, min_block: int = 1) -> Tensor:
    """k events of at least min_block tokens each, uniformly at random among all such splits.

    The baseline segmentation of paper Table 2 (same number of events as the method compared).
    Stars and bars: a split of n into k parts >= min_block is a split of n' = n - k*(min_block-1)
    into k parts >= 1, i.e. k-1 distinct cut points in 1..n'-1 drawn uniformly; event j then
    starts at c_j + j*(min_block-1). Returns long [k] on the generator's device.
    """
    if k < 1 or min_block < 1 or k * min_block > n:
        raise ValueError(f"cannot place {k} events of >= {min_block} tokens in {n}")
    n1 = n - k * (min_block - 1)
    dev = generator.device
    cuts = torch.randperm(n1 - 1, generator=generator, device=dev)[: k - 1] + 1  # distinct in 1..n1-1
    cuts = torch.sort(cuts).values + torch.arange(1, k, device=dev) * (min_block - 1)
    return torch.cat((torch.zeros(1, dtype=torch.long, device=dev), cuts))


# -- graph --------------------------------------------------------------------------------------
def key_adjacency(keys: Tensor, clamp_negative: bool = True) -> Tensor:
    """Similarity graph of a chunk's keys: A = sum over leading dims of K K^T (paper eq. 2).

    keys: [..., n, d] un-rotated keys (e.g. [layers, kv_heads, n, d]); the sum over heads/layers
    is the dot product of the concatenated key vectors, one matmul in float32.
    clamp_negative: set negative similarities to 0 so A is a valid weighted graph (module doc).
    Returns float32 [n, n], symmetric, diagonal = sum of squared key norms.
    """
    n, d = keys.shape[-2], keys.shape[-1]
    k = keys.reshape(-1, n, d).transpose(0, 1).reshape(n, -1).float()  # [n, heads*d]
    a = k @ k.T
    a = (a + a.T) * 0.5  # exact symmetry despite matmul blocking
    return a.clamp_min(0) if clamp_negative else a


def _acc_dtype(a: Tensor) -> torch.dtype:
    return torch.float32 if a.device.type == "mps" else torch.float64


def _prefix2d(w: Tensor) -> Tensor:
    """P[x, y] = sum_{i<x, j<y} w_ij, [n+1, n+1], so any block sum is 4 lookups."""
    return F.pad(w.cumsum(0).cumsum(1), (1, 0, 1, 0))


def _prefix1d(v: Tensor) -> Tensor:
    return F.pad(v.cumsum(0), (1, 0))  # [n+1]


def _check(a: Tensor, starts: Tensor) -> tuple[int, list[int]]:
    """Validate A and starts (one host sync); returns n and the starts as Python ints."""
    if a.dim() != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"A must be square [n, n], got {tuple(a.shape)}")
    n = a.shape[0]
    s = starts.reshape(-1).tolist()
    if not s or s[0] != 0 or s[-1] >= n or any(b <= x for x, b in zip(s, s[1:])):
        raise ValueError("starts must be strictly increasing, start at 0 and stay below n")
    return n, s


class _EventSums:
    """Per-event sums of a graph, in the accumulation dtype.

    intra [k]: sum_{i,j in S} A_ij (diagonal once); rows [k]: sum_{i in S} sum_j A_ij;
    diag [k]: sum_{i in S} A_ii; size [k]; total: sum_ij A_ij + trace (= networkx's 2m).
    """

    def __init__(self, a: Tensor, starts: Tensor):
        n, _ = _check(a, starts)
        w = a.to(_acc_dtype(a))
        st = starts.to(w.device)
        en = torch.cat((st[1:], st.new_tensor([n])))
        p = _prefix2d(w)
        self.intra = p[en, en] - p[st, en] - p[en, st] + p[st, st]  # diagonal blocks
        self.rows = (lambda c: c[en] - c[st])(_prefix1d(w.sum(1)))
        self.diag = (lambda c: c[en] - c[st])(_prefix1d(w.diagonal()))
        self.size = (en - st).to(w.dtype)
        self.n = n
        self.total = w.sum() + w.diagonal().sum()


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den with 0 where den == 0 (an event whose smaller side has no volume)."""
    zero = den == 0
    return torch.where(zero, torch.zeros_like(num), num / torch.where(zero, torch.ones_like(den), den))


# -- metrics ------------------------------------------------------------------------------------
def modularity(A: Tensor, starts: Tensor) -> float:
    """Newman modularity of the segmentation, exactly as networkx computes it.

    Q = 1/(2m) * sum_ij [A'_ij - k_i k_j / (2m)] delta(c_i, c_j), with A' = A + diag(diag(A))
    (self-loops counted as networkx does: module doc), k_i = sum_j A'_ij, 2m = sum_ij A'_ij.
    Equals ``networkx.algorithms.community.modularity(nx.from_numpy_array(A), events)``.

    Relation to the paper's f_M = 1/(4m) * sum_ij [A_ij - k_i k_j / (2m)] delta(c_i, c_j) with
    m = sum_ij A_ij / 2 (as the authors' code computes it): for a zero diagonal f_M = Q / 2. The
    paper's extra factor 1/2 is a constant and changes no argmax; we report the standard value.
    Returns 0.0 for a graph without weight. O(n^2), vectorised (per-event block sums).
    """
    e = _EventSums(A, starts)
    if e.total == 0:
        return 0.0
    intra = e.intra + e.diag  # sum over S x S of A'
    deg = e.rows + e.diag  # sum over S of k_i
    return float((intra.sum() - (deg * deg).sum() / e.total) / e.total)


def event_conductance(A: Tensor, starts: Tensor) -> Tensor:
    """Conductance of each event S, as networkx.algorithms.cuts.conductance(G, S) computes it.

    phi(S) = cut(S, V\\S) / min(vol(S), vol(V\\S)), cut = sum_{i in S, j not in S} A_ij,
    vol(S) = sum_{i in S} k_i with networkx's weighted degree k_i (self-loops twice).
    The paper's formula divides by vo(S) = sum_{i,j in S} A_ij instead, and the authors' code by
    min(vo(S), sum(A) - vo(S)); the spec asks for agreement with networkx, so we use volumes.
    0/0 (an event with no volume, or a single event with an empty complement, where networkx
    raises ZeroDivisionError) is defined as 0. Returns float64 [k].
    """
    e = _EventSums(A, starts)
    cut = e.rows - e.intra
    vol = e.rows + e.diag
    return _safe_div(cut, torch.minimum(vol, e.total - vol))


def conductance(A: Tensor, starts: Tensor, reduce: str = "mean") -> float:
    """Conductance of the segmentation: the mean over events of event_conductance (lower is better).

    The paper writes f_C = min over events S of phi(S). As the objective of refinement that is
    degenerate: the minimum is usually held by an event far from the boundary being moved, so
    every candidate ties and nothing moves. The mean (one of the aggregates the authors' code
    reports) changes with every boundary through exactly its two adjacent events, so it is what
    ``refine(metric="conductance")`` minimises. reduce="min" gives the paper's literal formula,
    "max" the worst event.
    """
    phi = event_conductance(A, starts)
    if reduce == "mean":
        return float(phi.mean())
    if reduce == "min":
        return float(phi.min())
    if reduce == "max":
        return float(phi.max())
    raise ValueError(f"reduce must be mean, min or max, got {reduce!r}")


def intra_inter_similarity(A: Tensor, starts: Tensor) -> float:
    """I/IS of paper §4.2 / Table 2: mean over events of intra(S) / inter(S) (higher is better).

    intra(S) = mean_{i,j in S} A_ij (diagonal included), inter(S) = mean_{i in S, j not in S} A_ij.
    The paper's equation writes sums; the authors' code takes means over the pairs (without that,
    the ratio mostly measures event size: |S|^2 vs |S|(n-|S|) pairs) and averages the per-event
    ratios over events, which is what we do. Raw A (no self-loop doubling: no graph reading here).
    NaN for a single event (no inter pairs); inf where an event has zero inter similarity.
    """
    e = _EventSums(A, starts)
    intra = e.intra / (e.size * e.size)
    inter = (e.rows - e.intra) / (e.size * (e.n - e.size))
    return float((intra / inter).mean())


# -- refinement (paper Algorithm 1) ------------------------------------------------------------
def refine(
    A: Tensor,
    starts: Tensor,
    metric: str = "modularity",
    min_block: int = 1,
    tol: float = 1e-9,
    max_block: int | None = None,
) -> Tensor:
    """Move each boundary to its best position (paper Algorithm 1, spec §3).

    Left to right over i >= 1: with alpha = the (already refined) start i-1 and beta = starts[i],
    move beta to the position p in (alpha, beta] that maximises modularity (metric="modularity")
    or minimises mean conductance (metric="conductance") of the whole segmentation with only that
    boundary moved. Only events [alpha, p) and [p, gamma) change, so candidates are ranked by their
    contribution, computed for all p at once from 2-D prefix sums of A.
    Sizes: a candidate p must leave both changed events [alpha, p) and [p, gamma) at least
    min_block and, if max_block is given, at most max_block long; the original position beta stays
    a candidate regardless. Moving a boundary left grows the right event, so without max_block a
    valid segmentation can come out with an event longer than max_block, and cutting that
    afterwards (enforce_block_sizes) leaves a piece shorter than min_block. With max_block, a
    segmentation whose events all lie in [min_block, max_block] keeps that property: the right
    event [p, gamma) is checked here, and afterwards gamma can only move left to a position that
    leaves it >= min_block (it is the next step's left event), so it never leaves the bounds. (For an input that already violates the bounds only
    the moved positions are checked; e.g. a short last event of a document can stay short.)

    Ties: scores closer than ``tol`` (in metric units: modularity, or mean conductance) count as
    equal, so rounding never decides and plateaus (common: conductance is flat in p while both
    events are the smaller side of their cut) do not move boundaries at random. The original
    position is kept unless the best candidate beats it by more than tol; then the smallest
    position scoring within tol of the best wins. So refinement never makes the metric worse and
    the result is deterministic.

    Cost: O(n^2) once for the prefix sums, O(n) vector ops per boundary; one host sync to read the
    initial starts, none per boundary or candidate. Returns long [k] on starts' device.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    if min_block < 1:
        raise ValueError(f"min_block must be >= 1, got {min_block}")
    if max_block is not None and max_block < min_block:
        raise ValueError(f"need min_block <= max_block, got {min_block}, {max_block}")
    n, s = _check(A, starts)
    k = len(s)
    out = starts.reshape(-1).to(A.device).clone()
    if k < 2:
        return out.to(starts.device)
    w = A.to(_acc_dtype(A))
    rows = w.sum(1)  # [n] sum_j A_ij
    diag = w.diagonal()  # [n]
    p2 = _prefix2d(w)  # [n+1, n+1]
    pd = p2.diagonal()  # [n+1] P[x, x]: intra weight of [0, x)
    cr = _prefix1d(rows)  # [n+1]
    ct = _prefix1d(diag)  # [n+1]
    cd = cr + ct  # [n+1] networkx degree prefix
    total = cd[-1]  # 2m
    total_nz = torch.where(total == 0, torch.ones_like(total), total)
    pos = torch.arange(n + 1, device=w.device)
    # tol in the units of the per-boundary score: Q * 2m for modularity, k * mean for conductance
    tol_s = tol * total_nz.abs() if metric == "modularity" else total.new_tensor(tol * k)
    neg_inf = torch.tensor(float("-inf"), dtype=w.dtype, device=w.device)

    for i in range(1, k):
        beta = s[i]
        gamma = s[i + 1] if i + 1 < k else n
        a1 = out[i - 1 : i]  # [1] alpha on the device (already refined; >= i-1, <= s[i-1])
        lo = i  # every p > alpha satisfies p >= i: a fixed host-side window, no sync needed
        p = pos[lo : beta + 1]  # [c] candidate starts of the right event
        # left event [alpha, p), right event [p, gamma)
        pap = p2.index_select(0, a1)[0, lo : beta + 1]  # [c] P[alpha, p]
        ppa = p2[lo : beta + 1].index_select(1, a1)[:, 0]  # [c] P[p, alpha] (== if A symmetric)
        paa = pd.index_select(0, a1)  # [1]
        intra_l = pd[lo : beta + 1] - pap - ppa + paa
        intra_r = pd[gamma] - p2[lo : beta + 1, gamma] - p2[gamma, lo : beta + 1] + pd[lo : beta + 1]
        deg_l = cd[lo : beta + 1] - cd.index_select(0, a1)
        deg_r = cd[gamma] - cd[lo : beta + 1]
        if metric == "modularity":
            tr_l = ct[lo : beta + 1] - ct.index_select(0, a1)
            tr_r = ct[gamma] - ct[lo : beta + 1]
            # Q * 2m restricted to the two events (the rest of the sum is constant in p)
            score = (intra_l + tr_l) + (intra_r + tr_r) - (deg_l * deg_l + deg_r * deg_r) / total_nz
        else:
            cut_l = cr[lo : beta + 1] - cr.index_select(0, a1) - intra_l
            cut_r = cr[gamma] - cr[lo : beta + 1] - intra_r
            phi_l = _safe_div(cut_l, torch.minimum(deg_l, total - deg_l))
            phi_r = _safe_div(cut_r, torch.minimum(deg_r, total - deg_r))
            score = -(phi_l + phi_r)  # k * mean conductance, up to a constant; maximise its negative
        size_l, size_r = p - a1, gamma - p  # [c] sizes of the two changed events
        valid = (size_l >= min_block) & (size_r >= min_block)
        if max_block is not None:
            valid &= (size_l <= max_block) & (size_r <= max_block)
        valid |= p == beta  # the original position is always allowed (keeps the input's sizes)
        score = torch.where(valid, score, neg_inf)
        best = score.max()
        j = torch.argmax((score >= best - tol_s).to(torch.uint8))  # smallest p within tol of best
        better = best > score[-1] + tol_s  # score[-1] is the original position beta
        out[i] = torch.where(better, p[j], p[-1])
    return out.to(starts.device)
