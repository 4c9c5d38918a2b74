"""Segmentation: metrics against networkx and brute force, refinement against a naive reference."""

from __future__ import annotations

import random

import networkx as nx
import pytest
import torch

from emllm.math.segmentation import (
    conductance,
    enforce_block_sizes,
    event_conductance,
    fixed_starts,
    intra_inter_similarity,
    key_adjacency,
    modularity,
    random_starts,
    refine,
    surprise_starts,
)


# -- helpers ------------------------------------------------------------------------------------
def rand_graph(n: int, seed: int, zero_frac: float = 0.2, diag: bool = True) -> torch.Tensor:
    """Random symmetric non-negative float64 [n, n], some zero entries, self-loops if diag."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, n, generator=g, dtype=torch.float64)
    w = w * (torch.rand(n, n, generator=g, dtype=torch.float64) > zero_frac)
    a = torch.triu(w, 1)
    a = a + a.T
    if diag:
        a = a + torch.diag(torch.rand(n, generator=g, dtype=torch.float64) * 2)
    return a


def rand_starts(n: int, rng: random.Random, k: int | None = None) -> torch.Tensor:
    k = k if k is not None else rng.randint(1, max(1, n // 3))
    return torch.tensor([0] + sorted(rng.sample(range(1, n), k - 1)), dtype=torch.long)


def events(starts: torch.Tensor, n: int) -> list[list[int]]:
    s = starts.tolist() + [n]
    return [list(range(a, b)) for a, b in zip(s, s[1:])]


def nx_graph(a: torch.Tensor) -> nx.Graph:
    return nx.from_numpy_array(a.numpy())


def ref_surprise_starts(flags: list[bool], mn: int, mx: int) -> list[int]:
    """Token-by-token reference: cut at t if flagged and far enough, or if the event is full."""
    out, s = [0], 0
    for t in range(1, len(flags)):
        if (flags[t] and t - s >= mn) or t - s == mx:
            out.append(t)
            s = t
    return out


def metric_value(a: torch.Tensor, starts: torch.Tensor, metric: str) -> float:
    """Higher is better."""
    return modularity(a, starts) if metric == "modularity" else -conductance(a, starts)


def naive_refine(
    a: torch.Tensor,
    starts: torch.Tensor,
    metric: str,
    min_block: int = 1,
    tol: float = 1e-9,
    max_block: int | None = None,
) -> list[int]:
    """Algorithm 1 by brute force: every candidate scored by recomputing the metric from scratch.

    A candidate p must keep both changed events [alpha, p) and [p, gamma) within
    [min_block, max_block]; the original position is always a candidate.
    """
    n = a.shape[0]
    cur = starts.tolist()
    hi = max_block if max_block is not None else n

    def fits(size: int) -> bool:
        return min_block <= size <= hi

    for i in range(1, len(cur)):
        alpha, beta = cur[i - 1], cur[i]
        gamma = cur[i + 1] if i + 1 < len(cur) else n
        cands = [p for p in range(alpha + 1, beta + 1) if (fits(p - alpha) and fits(gamma - p)) or p == beta]
        score = {p: metric_value(a, torch.tensor(cur[:i] + [p] + cur[i + 1 :]), metric) for p in cands}
        best = max(score.values())
        if best > score[beta] + tol:  # keep the original unless beaten by > tol
            cur[i] = min(p for p in cands if score[p] >= best - tol)  # then the smallest near-best
    return cur


# -- boundaries ---------------------------------------------------------------------------------
def test_fixed_starts():
    assert fixed_starts(10, 4).tolist() == [0, 4, 8]
    assert fixed_starts(8, 4).tolist() == [0, 4]
    assert fixed_starts(3, 128).tolist() == [0]


@pytest.mark.parametrize("seed", range(40))
def test_surprise_starts_matches_token_loop(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 300)
    mn = rng.randint(1, 10)
    mx = rng.randint(mn, 40)
    p = rng.choice([0.0, 0.05, 0.3, 0.9])
    flags = [rng.random() < p for _ in range(n)]
    got = surprise_starts(torch.tensor(flags), mn, mx).tolist()
    assert got == ref_surprise_starts(flags, mn, mx)
    lengths = [b - a for a, b in zip(got, got[1:] + [n])]
    assert all(mn <= x <= mx for x in lengths[:-1])
    assert 1 <= lengths[-1] <= mx
    for t in got[1:]:  # every start is a candidate or a forced max_block cut
        prev = got[got.index(t) - 1]
        assert flags[t] or t - prev == mx


def test_surprise_starts_examples():
    f = torch.zeros(20, dtype=torch.bool)
    f[[2, 5, 6, 15]] = True
    # 2 is too close to 0 (min 4); 5 ok; 6 too close to 5; 15 > 5 + 8 so cut at 13 first
    assert surprise_starts(f, 4, 8).tolist() == [0, 5, 13]
    assert surprise_starts(torch.zeros(0, dtype=torch.bool), 1, 4).tolist() == []
    with pytest.raises(ValueError):
        surprise_starts(f, 9, 8)


@pytest.mark.parametrize("seed", range(20))
def test_enforce_block_sizes(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 200)
    st = rand_starts(n, rng, k=rng.randint(1, min(n, 40)))
    mn, mx = rng.randint(1, 6), rng.randint(6, 30)
    flags = [False] * n
    for t in st.tolist():
        flags[t] = True
    got = enforce_block_sizes(st, n, mn, mx)
    assert got.tolist() == ref_surprise_starts(flags, mn, mx)
    assert enforce_block_sizes(got, n, mn, mx).tolist() == got.tolist()  # idempotent


def test_random_starts():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        st = random_starts(100, 7, g, min_block=8)
        s = st.tolist()
        assert len(s) == 7 and s[0] == 0
        lengths = [b - a for a, b in zip(s, s[1:] + [100])]
        assert min(lengths) >= 8
    # uniform over splits: n=5, k=2 has 4 splits, each should appear ~1/4 of the time
    counts = {}
    for _ in range(4000):
        b = random_starts(5, 2, g)[1].item()
        counts[b] = counts.get(b, 0) + 1
    assert sorted(counts) == [1, 2, 3, 4]
    assert all(800 < c < 1200 for c in counts.values())
    assert random_starts(9, 3, g, min_block=3).tolist() == [0, 3, 6]  # the only split
    with pytest.raises(ValueError):
        random_starts(10, 3, g, min_block=4)


# -- graph --------------------------------------------------------------------------------------
def test_key_adjacency_sums_heads_and_clamps_negatives():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 12, 5, generator=g)  # [layers, heads, n, d]
    raw = sum(keys[l, h] @ keys[l, h].T for l in range(2) for h in range(3))
    assert (raw < 0).any()  # the test must exercise negatives
    a = key_adjacency(keys)
    assert a.shape == (12, 12) and a.dtype == torch.float32
    torch.testing.assert_close(a, raw.clamp_min(0), rtol=1e-5, atol=1e-5)
    assert (a >= 0).all() and torch.equal(a, a.T)
    assert torch.all(a[raw < -1e-4] == 0)
    torch.testing.assert_close(a.diagonal(), (keys**2).sum((0, 1, 3)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(key_adjacency(keys, clamp_negative=False), raw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(key_adjacency(keys[0, 0]), (keys[0, 0] @ keys[0, 0].T).clamp_min(0))


# -- metrics ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_modularity_matches_networkx(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 40)
    a = rand_graph(n, seed, diag=seed % 3 != 0)
    st = rand_starts(n, rng)
    want = nx.algorithms.community.modularity(nx_graph(a), events(st, n), weight="weight")
    assert modularity(a, st) == pytest.approx(want, abs=1e-6)
    assert modularity(a.float(), st) == pytest.approx(want, abs=1e-5)  # float32 input


def test_modularity_is_twice_paper_fm_without_self_loops():
    a = rand_graph(30, 1, diag=False)
    st = torch.tensor([0, 7, 19])
    m = a.sum() / 2
    k = a.sum(1)
    c = torch.zeros(30, dtype=torch.long)
    c[7:], c[19:] = 1, 2
    delta = (c[:, None] == c[None, :]).double()
    f_m = ((a - k[:, None] * k[None, :] / (2 * m)) * delta).sum() / (4 * m)  # paper's formula
    assert modularity(a, st) == pytest.approx(2 * float(f_m), abs=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_conductance_matches_networkx(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 40)
    a = rand_graph(n, 100 + seed, diag=seed % 2 == 0)
    st = rand_starts(n, rng, k=rng.randint(2, max(2, n // 3)))
    g = nx_graph(a)
    want = [nx.algorithms.cuts.conductance(g, ev, weight="weight") for ev in events(st, n)]
    got = event_conductance(a, st).tolist()
    assert got == pytest.approx(want, abs=1e-6)
    assert conductance(a, st) == pytest.approx(sum(want) / len(want), abs=1e-6)
    assert conductance(a, st, reduce="min") == pytest.approx(min(want), abs=1e-6)
    assert conductance(a, st, reduce="max") == pytest.approx(max(want), abs=1e-6)


def test_conductance_single_event_is_zero():
    a = rand_graph(10, 0)
    assert conductance(a, torch.tensor([0])) == 0.0
    assert modularity(a, torch.tensor([0])) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_intra_inter_similarity_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 40)
    a = rand_graph(n, 200 + seed, zero_frac=0.0)
    st = rand_starts(n, rng, k=rng.randint(2, max(2, n // 3)))
    ratios = []
    for ev in events(st, n):
        intra = [a[i, j].item() for i in ev for j in ev]
        inter = [a[i, j].item() for i in ev for j in range(n) if j not in ev]
        ratios.append((sum(intra) / len(intra)) / (sum(inter) / len(inter)))
    assert intra_inter_similarity(a, st) == pytest.approx(sum(ratios) / len(ratios), rel=1e-9)


def test_metrics_reject_bad_starts():
    a = rand_graph(10, 0)
    for bad in ([1, 4], [0, 4, 4], [0, 10], [0, 5, 3]):
        with pytest.raises(ValueError):
            modularity(a, torch.tensor(bad))
        with pytest.raises(ValueError):
            refine(a, torch.tensor(bad))


# -- refinement ---------------------------------------------------------------------------------
@pytest.mark.parametrize("metric", ["modularity", "conductance"])
def test_refine_matches_naive(metric):
    rng = random.Random(7)
    cases = 0
    moved = 0
    for seed in range(60):
        n = rng.randint(10, 60)
        a = rand_graph(n, 1000 + seed, zero_frac=rng.choice([0.0, 0.5]), diag=seed % 4 != 0)
        st = rand_starts(n, rng, k=rng.randint(2, max(2, n // 4)))
        mb = rng.choice([1, 1, 2, 3])
        got = refine(a, st, metric, min_block=mb).tolist()
        assert got == naive_refine(a, st, metric, min_block=mb), (seed, st.tolist())
        cases += 1
        moved += got != st.tolist()
    assert moved > cases // 2  # the comparison is not vacuous


def rand_sized_starts(rng: random.Random, mn: int, mx: int, k: int) -> tuple[torch.Tensor, int]:
    """k events with sizes uniform in [mn, mx] (the last one too); returns (starts, n)."""
    sizes = [rng.randint(mn, mx) for _ in range(k)]
    starts = [0]
    for x in sizes[:-1]:
        starts.append(starts[-1] + x)
    return torch.tensor(starts, dtype=torch.long), sum(sizes)


def sizes_of(starts: torch.Tensor, n: int) -> list[int]:
    s = starts.tolist() + [n]
    return [b - a for a, b in zip(s, s[1:])]


@pytest.mark.parametrize("metric", ["modularity", "conductance"])
def test_refine_keeps_every_event_within_block_sizes(metric):
    # The engine's closed stretch: every event, the last one included, is in [min, max]; after
    # refinement they all must still be (moving a boundary left grows the event to its right).
    rng = random.Random(11)
    grew = 0  # cases where refinement without max_block would have produced an event > max
    for seed in range(80):
        mn = rng.randint(1, 5)
        mx = rng.randint(mn, mn + rng.choice([0, 1, 3, 8]))
        st, n = rand_sized_starts(rng, mn, mx, rng.randint(1, max(1, 70 // mx)))
        a = rand_graph(n, 9000 + seed, zero_frac=rng.choice([0.0, 0.5]), diag=rng.random() < 0.7)
        if rng.random() < 0.3:
            a = a.float()
        got = refine(a, st, metric, min_block=mn, max_block=mx)
        assert got.dtype == torch.long and got.numel() == st.numel() and torch.all(got <= st)
        assert all(mn <= x <= mx for x in sizes_of(got, n)), (seed, st.tolist(), got.tolist(), mn, mx)
        assert got.tolist() == naive_refine(a, st, metric, min_block=mn, max_block=mx), (seed, st.tolist())
        assert metric_value(a, got, metric) >= metric_value(a, st, metric) - 1e-9
        assert enforce_block_sizes(got, n, mn, mx).tolist() == got.tolist()  # the engine's safety net: a no-op
        grew += max(sizes_of(refine(a, st, metric, min_block=mn), n)) > mx
    assert grew > 5  # the bound is exercised, not vacuous


@pytest.mark.parametrize("metric", ["modularity", "conductance"])
def test_refine_max_block_examples(metric):
    # Two planted blocks, [0, 6) and [6, 24); events of 4, 8, 8, 4 tokens. Unbounded, the boundary
    # at 12 moves to the block edge 6 and leaves [8 or 14, 24) longer than 8 (enforce_block_sizes
    # would then cut it, leaving a short piece). With max_block 8 no move keeps [p, 20) <= 8, so
    # nothing moves; with 10, 12 may go down to 10 and does, as close to the edge as allowed.
    a = torch.full((24, 24), 0.05, dtype=torch.float64)
    a[:6, :6] += 1
    a[6:, 6:] += 1
    st = torch.tensor([0, 4, 12, 20])
    assert refine(a, st, metric, min_block=2).tolist()[:3] == [0, 4, 6]
    assert refine(a, st, metric, min_block=2, max_block=8).tolist() == [0, 4, 12, 20]
    assert refine(a, st, metric, min_block=2, max_block=10).tolist() == [0, 4, 10, 20]
    for mx in (8, 10):
        assert refine(a, st, metric, min_block=2, max_block=mx).tolist() == naive_refine(a, st, metric, 2, max_block=mx)
    with pytest.raises(ValueError):
        refine(a, st, min_block=5, max_block=4)


@pytest.mark.parametrize("metric", ["modularity", "conductance"])
def test_refine_ties_keep_original_or_smallest(metric):
    # Constant weights (exact in float64): scores are symmetric in the two event sizes, so there
    # are exact ties; the vectorised and naive tie rules must agree.
    for n in (12, 17, 24):
        a = torch.ones(n, n, dtype=torch.float64)
        for st in ([0, 3, 9], [0, 5, 6, 11], [0, n - 1], [0, 2, 4, 6, 8, 10]):
            st = torch.tensor(st)
            assert refine(a, st, metric).tolist() == naive_refine(a, st, metric)
    # Hand-derived, n = 24, all weights 1 (self-loops too). Modularity of two adjacent events with
    # fixed total T is T - (L_l^2 + L_r^2)/n + const: the balanced split wins, the smaller on a tie.
    a = torch.ones(24, 24, dtype=torch.float64)
    assert refine(a, torch.tensor([0, 4, 20]), "modularity").tolist() == [0, 4, 14]
    assert refine(a, torch.tensor([0, 3, 20]), "modularity").tolist() == [0, 3, 13]  # 10|11 vs 11|10
    # Tilt that tie towards p = 14 (node 13 joins the left event): below tol it stays a tie, above
    # it decides. (Plain argmax would follow the 1e-14 tilt.)
    for eps, want in ((1e-12, 13), (1e-3, 14)):
        b = a.clone()
        b[13, 3:13] += eps
        b[3:13, 13] += eps
        got = refine(b, torch.tensor([0, 3, 20]), "modularity").tolist()
        assert got == [0, 3, want] == naive_refine(b, torch.tensor([0, 3, 20]), "modularity")
    # Conductance of an event of L tokens is max(L, n-L)/(n+1): flat while both events are <= n/2,
    # so from [4, 20) | [20, 24) every p in 12..16 is optimal and the smallest, 12, wins.
    assert refine(a, torch.tensor([0, 4, 20]), "conductance").tolist() == [0, 4, 12]
    assert refine(a, torch.tensor([0, 4, 14]), "conductance").tolist() == [0, 4, 14]  # on the plateau
    a = torch.zeros(8, 8, dtype=torch.float64)  # no weight at all: nothing can be better
    assert refine(a, torch.tensor([0, 3, 6]), metric).tolist() == [0, 3, 6]


@pytest.mark.parametrize("metric", ["modularity", "conductance"])
def test_refine_never_worse(metric):
    rng = random.Random(3)
    for seed in range(150):
        n = rng.randint(5, 120)
        a = rand_graph(n, 5000 + seed, zero_frac=rng.random() * 0.8, diag=rng.random() < 0.7)
        if rng.random() < 0.5:
            a = a.float()
        st = rand_starts(n, rng, k=rng.randint(1, max(1, n // 3)))
        r = refine(a, st, metric, min_block=rng.randint(1, 4))
        assert r.dtype == torch.long and r[0] == 0 and torch.all(r[1:] > r[:-1]) and r.numel() == st.numel()
        assert torch.all(r <= st)  # boundaries only move left, into (alpha, beta]
        assert metric_value(a, r, metric) >= metric_value(a, st, metric) - 1e-9


@pytest.mark.parametrize("metric", ["modularity", "conductance"])
def test_refine_recovers_planted_events(metric):
    # Three dense blocks, weak noise between them; boundaries start a few tokens too late.
    g = torch.Generator().manual_seed(0)
    n, true = 60, [0, 20, 35]
    a = torch.rand(n, n, generator=g, dtype=torch.float64) * 0.05
    for s, e in zip(true, true[1:] + [n]):
        a[s:e, s:e] += 1.0
    a = (a + a.T) / 2
    r = refine(a, torch.tensor([0, 24, 41]), metric)
    assert r.tolist() == true
    assert refine(a, torch.tensor(true), metric).tolist() == true  # already optimal: unchanged


def test_refine_key_adjacency_end_to_end():
    # Keys from two clusters, with negative dot products across clusters (clamped to 0).
    g = torch.Generator().manual_seed(1)
    c = torch.randn(2, 16, generator=g) * 3
    lab = torch.tensor([0] * 30 + [1] * 34)
    c[1] = -c[0]
    keys = (c[lab] + 0.3 * torch.randn(64, 16, generator=g))[None]  # [1, n, d]
    a = key_adjacency(keys)
    assert a[:30, 30:].max() == 0  # anti-aligned clusters: no edges between them
    for metric in ("modularity", "conductance"):
        assert refine(a, torch.tensor([0, 40]), metric).tolist() == [0, 30]
