"""EventIndex (core/memory/index.py): the exact path is select_events(event_scores(...)) bit for bit; the
faiss path equals it when the graph finds the true top-k, and finds it often on model-like data."""

from __future__ import annotations

import math

import pytest
import torch

from emllm.memory.selection import event_scores, select_events
from emllm.memory.index import DEFAULT_EF_CONSTRUCTION, DEFAULT_EF_SEARCH, DEFAULT_M, EventIndex
from .helpers import model_like

H_Q, H_KV, D = 9, 3, 64  # SmolLM2-135M


def assert_same(a, b):
    assert torch.equal(a.ids, b.ids), (a.ids, b.ids)
    assert torch.equal(a.scores, b.scores)




def exact(reprs, query, lengths, budget):
    return select_events(event_scores(reprs, query), lengths, budget)


# -- exact path ------------------------------------------------------------------------------------


def test_exact_path_matches_select_events_with_ties_and_incremental_adds():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(300, H_Q, D, generator=g).bfloat16()
    dup = base[torch.randint(0, 300, (200,), generator=g)]  # duplicate reprs: exactly tied scores
    reprs = torch.cat((base, dup))[torch.randperm(500, generator=g)]
    lengths = torch.randint(1, 40, (500,), generator=g)
    index = EventIndex(H_Q, D, threshold=None)
    stops = [0, 1, 7, 100, 101, 350, 500]
    for a, b in zip(stops, stops[1:]):
        index.add(reprs[a:b])
        assert len(index) == b
        for _ in range(3):
            q = torch.randn(H_Q, D, generator=g).bfloat16()
            for budget in (0, 1, 50, 300, 5000, 10**6):
                assert_same(index.select(q, lengths[:b], budget), exact(reprs[:b], q, lengths[:b], budget))
    assert index.vectors().dtype == torch.float32
    # Ties really occurred: some duplicate pair was selected together.
    q = torch.randn(H_Q, D, generator=g)
    sel = index.select(q, lengths, 10**6)
    assert sel.scores.unique().numel() < sel.scores.numel()


def test_budget_below_one_event_and_empty_index():
    index = EventIndex(H_Q, D, threshold=None)
    q = torch.randn(H_Q, D)
    empty = index.select(q, torch.empty(0, dtype=torch.long), 100)
    assert empty.ids.numel() == 0 and empty.ids.dtype == torch.long
    assert empty.scores.numel() == 0 and empty.scores.dtype == torch.float32
    # (event_scores itself cannot take 0 events: reshape(0, -1) is ambiguous; select_events of
    # empty scores gives exactly this.)
    assert_same(empty, select_events(torch.empty(0), torch.empty(0, dtype=torch.long), 100))
    index.add(torch.randn(5, H_Q, D))
    lengths = torch.full((5,), 32)
    sel = index.select(q, lengths, 31)  # the best event alone does not fit
    assert sel.ids.numel() == 0 and sel.ids.dtype == torch.long
    assert_same(sel, exact(index.vectors(), q, lengths, 31))
    with pytest.raises(ValueError):
        index.add(torch.randn(2, H_Q, D + 1))
    with pytest.raises(ValueError):
        index.select(q, torch.full((4,), 32), 100)


def test_threshold_builds_faiss_only_from_the_threshold_on():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(H_Q, D, generator=g)
    # warmup=1: nothing at all below the threshold, everything at it.
    index = EventIndex(H_Q, D, threshold=1000, warmup=1.0)
    index.add(torch.randn(600, H_Q, D, generator=g))
    index.add(torch.randn(399, H_Q, D, generator=g))
    assert index.faiss_index is None
    index.select(q, torch.full((999,), 32), 1024)
    assert index.last_k is None
    index.add(torch.randn(1, H_Q, D, generator=g))
    assert index.faiss_index is not None and index.n_indexed == 1000
    index.add(torch.randn(50, H_Q, D, generator=g))
    assert index.n_indexed == 1050
    index.select(q, torch.full((1050,), 32), 1024)
    assert index.last_k == 1024 // 32 + 1 + index.margin
    # Default warmup 0.5: no graph below 500 events, filled gradually up to 1000, searched from 1000.
    index = EventIndex(H_Q, D, threshold=1000)
    index.add(torch.randn(499, H_Q, D, generator=g))
    assert index.faiss_index is None
    filled = []
    for _ in range(6):
        index.add(torch.randn(100, H_Q, D, generator=g))
        filled.append(index.n_indexed)
        if len(index) < 1000:
            assert 0 < index.n_indexed <= len(index)
            index.select(q, torch.full((len(index),), 32), 1024)
            assert index.last_k is None  # exact path
    assert filled[0] < 599 and filled == sorted(filled) and filled[-1] == 1099  # complete from 1000 on
    index.select(q, torch.full((1099,), 32), 1024)
    assert index.last_k is not None
    assert EventIndex(H_Q, D, threshold=None).faiss_index is None


def test_norm_growth_rebuilds_graph():
    g = torch.Generator().manual_seed(5)
    index = EventIndex(H_Q, D, threshold=100)
    index.add(torch.randn(150, H_Q, D, generator=g))
    r = index.radius
    index.add(3 * r / math.sqrt(H_Q * D) * torch.randn(2, H_Q, D, generator=g))  # norm ~3R
    assert index.rebuilds == 1 and index.radius > r and index.n_indexed == 152
    lengths = torch.full((152,), 8)
    q = index.vectors()[151]
    sel = index.select(q, lengths, 8)  # the longest vector is its own best match
    assert sel.ids.tolist() == [151]


# -- faiss path ------------------------------------------------------------------------------------


def separated(seed: int, n_clusters: int = 20, per: int = 100):
    """Documents far apart: 20 runs of 100 consecutive events, each around its own centre (norm
    ~240) and spread along one direction of its own (+-5) plus noise (0.1 per dim). A query near a
    centre and along its direction ranks that document's events first, in a clear order."""
    g = torch.Generator().manual_seed(seed)
    centres = 10.0 * torch.randn(n_clusters, H_Q * D, generator=g)
    dirs = torch.nn.functional.normalize(torch.randn(n_clusters, H_Q * D, generator=g), dim=1)
    t = torch.rand(n_clusters * per, 1, generator=g) * 10 - 5
    x = centres.repeat_interleave(per, 0) + t * dirs.repeat_interleave(per, 0)
    x = x + 0.1 * torch.randn(n_clusters * per, H_Q * D, generator=g)
    lengths = torch.randint(8, 64, (n_clusters * per,), generator=g)
    queries = centres / centres.norm(dim=1, keepdim=True) + dirs + 0.01 * torch.randn(n_clusters, H_Q * D, generator=g)
    return x.reshape(-1, H_Q, D), lengths, queries.reshape(-1, H_Q, D)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_faiss_path_equals_exact_on_separated_clusters(seed):
    """The graph finds the true top-k here, so the result is the exact one: ids exactly, scores to
    float32 rounding (a subset is re-scored). Budgets from empty to ~2/3 of one document."""
    reprs, lengths, queries = separated(seed)
    index = EventIndex(H_Q, D, threshold=1000)
    for part in reprs.split(300):  # graph started at 600 events, complete at 1200, then grown
        index.add(part)
    assert index.n_indexed == len(index) == 2000
    for q in queries:
        for budget in (0, 7, 100, 1024, 2048):
            got, want = index.select(q, lengths, budget), exact(reprs, q, lengths, budget)
            assert torch.equal(got.ids, want.ids), budget
            torch.testing.assert_close(got.scores, want.scores, rtol=1e-5, atol=1e-4)
            assert budget == 0 or index.last_k < len(index)


def test_faiss_path_widens_when_candidates_cannot_fill_budget():
    """A budget larger than all events: k reaches E and the answer is the exact path's, bit for bit."""
    g = torch.Generator().manual_seed(4)
    reprs = torch.randn(1200, H_Q, D, generator=g)
    lengths = torch.randint(8, 64, (1200,), generator=g)
    index = EventIndex(H_Q, D, threshold=1000)
    index.add(reprs)
    q = torch.randn(H_Q, D, generator=g)
    budget = int(lengths.sum()) - 1
    assert_same(index.select(q, lengths, budget), exact(reprs, q, lengths, budget))
    assert index.last_k == 1200


def test_faiss_recall_on_model_like_data():
    """Recall@64 of the HNSW top-k against the exact top-k, default parameters, 20k events."""
    n, k = 20_000, 64
    reprs, queries, lengths = model_like(n, 50)
    index = EventIndex(H_Q, D, threshold=1)
    index.add(reprs)
    flat = index.vectors().reshape(n, -1)
    found = [index.search(q, k) for q in queries]
    truth = (queries.reshape(50, -1) @ flat.T).topk(k, dim=1).indices
    hits = sum(len(set(found[i].tolist()) & set(truth[i].tolist())) for i in range(50))
    recall = hits / (50 * k)
    # And the selections themselves (budget 1024): share of the exact selection's events found.
    sel_hits = sel_total = same = 0
    for q in queries:
        got, want = index.select(q, lengths, 1024), exact(reprs, q, lengths, 1024)
        sel_hits += int(torch.isin(want.ids, got.ids).sum())
        sel_total += want.ids.numel()
        same += torch.equal(got.ids, want.ids)
    print(f"\nrecall@{k} = {recall:.4f} (HNSW M={DEFAULT_M}, efConstruction={DEFAULT_EF_CONSTRUCTION}, "
          f"efSearch={max(DEFAULT_EF_SEARCH, 2 * k)}, {n} events, 50 queries); budget 1024 (k={index.last_k}): "
          f"selection recall {sel_hits / sel_total:.4f}, identical selections {same}/50")
    assert recall >= 0.95
    assert sel_hits / sel_total >= 0.95
