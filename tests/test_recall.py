"""Needle recall (core/evals/recall.py): what the question's retrieval did with each needle, checked
against the layers' own selections and a brute-force ranking; a chunk retriever's recall at a budget."""

from __future__ import annotations

import torch

from emllm.engine.stream import Engine
from emllm.evals.recall import RecallProbe, chunk_recall, needle_recall
from emllm.memory.selection import event_scores
from tests.conftest import tiny_model, tiny_profile


def test_needles_in_memory_window_and_initial_tokens():
    model = tiny_model("llama3.1")
    prof = tiny_profile(segmentation="F", max_block=8, min_block=8, n_mem=16)  # fixed events of 8 tokens from 4
    eng = Engine(model, prof)
    g = torch.Generator().manual_seed(0)
    eng.feed(torch.randint(0, 300, (200,), generator=g))
    selected: dict[int, list[int]] = {}
    def outer(layer, sel, query):  # a listener set before the probe still hears every retrieval
        selected[layer] = sel.ids.tolist()
    eng.on_retrieval = outer
    probe = RecallProbe(eng)
    eng.feed(torch.randint(0, 300, (5,), generator=g))
    probe.detach()
    assert eng.on_retrieval is outer and set(selected) == {0, 1}
    needles = [(1, 3), (21, 25), (30, 38), (eng.n_tokens - 10, eng.n_tokens - 8)]
    got = needle_recall(eng, probe, needles)
    assert got[0].where == "init" and got[0].layers == 2 and got[0].ranks == []
    assert got[3].where == "window" and got[3].share == 1.0
    lengths = eng.windows[0].events.event_lengths()
    assert bool((lengths == 8).all())
    for r, (s, e) in zip(got[1:3], needles[1:3]):
        ev = list(range((s - 4) // 8, (e - 1 - 4) // 8 + 1))  # events [4 + 8i, 12 + 8i)
        assert r.where == "memory" and r.events == len(ev)
        assert r.layers == sum(any(i in selected[layer] for i in ev) for layer in (0, 1))
        for layer in (0, 1):  # brute force: 1 + events scoring higher, ties to the lower id
            sel, q = probe.last[layer]
            sc = event_scores(eng.windows[layer].events.repr_keys(), q).tolist()
            rank = min(1 + sum(x > sc[i] or (x == sc[i] and j < i) for j, x in enumerate(sc)) for i in ev)
            assert r.ranks[layer] == rank
            if any(i in selected[layer] for i in ev):  # held: within the selection's size
                assert rank <= len(selected[layer])


def test_chunk_recall_at_a_budget():
    spans = [(0, 10), (10, 20), (20, 25), (25, 40)]
    ranked = [3, 0, 2, 1]  # best first
    assert chunk_recall(ranked, spans, (22, 24), budget=40) == (3, True)  # 15 + 10 + 5 tokens fit
    assert chunk_recall(ranked, spans, (22, 24), budget=29) == (3, False)  # the prefix stops at chunk 0
    assert chunk_recall(ranked, spans, (12, 14), budget=100) == (4, True)
    assert chunk_recall(ranked, spans, (50, 52), budget=100) == (0, False)
