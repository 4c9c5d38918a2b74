"""Identical events counted once in a question's selection (profile distinct_events,
`emllm.memory.distinct`): the groups against a brute force over the token ids, the selection
against a brute force over the groups' best, and an engine reading a stream that repeats itself."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from emllm.engine.stream import Engine
from emllm.memory.distinct import best_of_groups, span_groups
from emllm.memory.passages import event_spans
from emllm.memory.selection import select_events
from tests.helpers import brute_select
from tests.conftest import tiny_model, tiny_profile


def brute_groups(ids: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """Spans labelled by the first span with the same ids."""
    first: dict[tuple[int, ...], int] = {}
    return [first.setdefault(tuple(ids[s:e]), i) for i, (s, e) in enumerate(spans)]


def brute_distinct_select(scores: list[float], lengths: list[int], groups: list[int], budget: int) -> list[int]:
    """The best of each group (the earliest of equal scores) ranked by score, then, once they all
    fit, the other events by score; filled while they fit (`brute_select`)."""
    best: dict[int, int] = {}
    for i, g in enumerate(groups):
        if g not in best or scores[i] > scores[best[g]]:
            best[g] = i
    first = sorted(best.values())
    chosen = [first[i] for i in brute_select([scores[k] for k in first], [lengths[k] for k in first], budget)]
    if len(chosen) < len(first):
        return chosen
    rest = [i for i in range(len(scores)) if i not in best.values()]
    left = budget - sum(lengths[k] for k in first)
    return sorted(chosen + [rest[i] for i in brute_select([scores[k] for k in rest], [lengths[k] for k in rest], left)])


def same_partition(a: list[int], b: list[int]) -> bool:
    return all((a[i] == a[j]) == (b[i] == b[j]) for i in range(len(a)) for j in range(len(a)))


@pytest.mark.parametrize("seed", range(4))
def test_groups_are_the_spans_with_the_same_ids(seed):
    rng = random.Random(seed)
    pieces = [[rng.randrange(4) for _ in range(rng.randint(1, 6))] for _ in range(6)]
    pieces += [[0], [0, 0], [0, 0, 0], pieces[0] + [0]]  # id 0, and a span that only adds zeros, are different
    ids: list[int] = []
    spans = []
    for _ in range(60):  # the same pieces again and again, in any order: many identical spans
        p = rng.choice(pieces)
        spans.append((len(ids), len(ids) + len(p)))
        ids += p
    spans.append((3, 3))  # an empty span
    got = span_groups(torch.tensor(ids), torch.tensor(spans)).tolist()
    want = brute_groups(ids, spans)
    assert len(set(want)) < len(want) - 20  # (the case has identical spans to find)
    assert same_partition(got, want)
    assert sorted(set(got)) == list(range(len(set(got))))  # labels 0..G-1


def test_groups_of_overlapping_spans_and_large_ids():
    """Spans may overlap (a re-read's tail pieces follow the events) and ids reach a large vocabulary."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 3, (300,), generator=g) + 250_000
    starts = torch.randint(0, 290, (200,), generator=g)
    spans = torch.stack((starts, starts + torch.randint(1, 6, (200,), generator=g)), 1)
    got = span_groups(ids, spans).tolist()
    assert same_partition(got, brute_groups(ids.tolist(), [tuple(s) for s in spans.tolist()]))


@pytest.mark.parametrize("seed", range(5))
def test_best_of_groups(seed):
    rng = np.random.default_rng(seed)
    n = 50
    scores = rng.integers(0, 6, n).astype(np.float64)  # ties, to check the earliest is kept
    scores[rng.integers(0, n, 2)] = np.nan
    groups = rng.integers(0, 12, n)
    got = best_of_groups(scores, groups).tolist()
    want = []
    for g in sorted(set(groups.tolist())):
        members = [i for i in range(n) if groups[i] == g]
        key = [np.inf if np.isnan(scores[i]) else scores[i] for i in members]
        want.append(members[key.index(max(key))])  # (index: the earliest of the best)
    assert got == sorted(want)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [60, 200, 400])
def test_selection_ranks_one_of_each_group_before_the_copies(seed, budget):
    """60: fewer tokens than the groups' best hold (one of each group at most); 200 and 400: every
    group has its place and copies fill the rest (all events at 400)."""
    g = torch.Generator().manual_seed(seed)
    n = 80
    scores = torch.randn(n, generator=g)
    lengths = torch.randint(1, 9, (n,), generator=g)
    groups = torch.randint(0, 30, (n,), generator=g)
    sel = select_events(scores, lengths, budget, groups)
    want = brute_distinct_select(scores.tolist(), lengths.tolist(), groups.tolist(), budget)
    assert sel.ids.tolist() == want
    assert torch.equal(sel.scores, scores[sel.ids])
    held = groups[sel.ids].tolist()
    if budget == 60:
        assert len(set(held)) == len(held)  # never two of a group
        assert want != brute_select(scores.tolist(), lengths.tolist(), budget)  # (the groups changed it)
    else:
        assert set(held) == set(groups.tolist()) and len(held) > len(set(held))
    assert select_events(scores, lengths, budget).ids.tolist() == brute_select(scores.tolist(), lengths.tolist(), budget)


def _repeating_engine(distinct: bool, n_mem: int = 64) -> tuple[Engine, torch.Tensor]:
    """An engine that has read a stream repeating one stretch of 8 tokens among random ones,
    events cut every 8 tokens after the initial ones: its copies are identical events."""
    model = tiny_model("llama3.1")
    prof = tiny_profile(segmentation="F", max_block=8, min_block=8, n_mem=n_mem, question_centering=1.0,
                        question_scoring="lse", distinct_events=distinct)
    eng = Engine(model, prof)
    g = torch.Generator().manual_seed(7)
    copy = torch.randint(0, 300, (8,), generator=g)
    parts = [torch.randint(0, 300, (prof.n_init,), generator=g)]
    for i in range(30):
        parts.append(copy if i % 2 else torch.randint(0, 300, (8,), generator=g))
    eng.feed(torch.cat(parts))
    return eng, copy


@pytest.mark.parametrize("distinct", [True, False])
@pytest.mark.parametrize("n_mem", [64, 160])
def test_a_question_selects_by_the_groups_of_its_events(distinct, n_mem, monkeypatch):
    """The engine hands each layer's question selection the groups of its events (identical token
    ids: here the copies), and the selection is the brute force's over the layer's own scores:
    one of each group first, then copies (n_mem 160: room for every group and some copies).
    Without distinct_events no groups, the plain selection."""
    import emllm.engine.window as window_mod
    from emllm.memory.selection import TOKEN_SCORINGS

    eng, copy = _repeating_engine(distinct, n_mem)
    given = []
    real = window_mod.select_events
    monkeypatch.setattr(window_mod, "select_events", lambda *a: given.append(a[3] if len(a) > 3 else None) or real(*a))
    seen: dict[int, object] = {}
    eng.on_retrieval = lambda layer, sel, q: seen.__setitem__(layer, sel)
    eng.begin_question()
    eng.feed(copy[:6])  # a question made of the copy's tokens
    spans = event_spans(eng.windows[0].events.event_lengths(), eng.profile.n_init)
    ids = eng.ids.view()
    groups = brute_groups(ids.tolist(), [tuple(s) for s in spans.tolist()])
    assert len(set(groups)) < len(groups) - 10  # the copies
    assert len(given) == len(seen) == len(eng.windows)
    changed = False
    for layer, sel in seen.items():
        sc = TOKEN_SCORINGS["lse"](sel.token_scores).tolist()
        lengths = eng.windows[layer].events.event_lengths().tolist()
        plain = brute_select(sc, lengths, eng.similarity_budget)
        if distinct:
            assert same_partition(given[layer].tolist(), groups)
            want = brute_distinct_select(sc, lengths, groups, eng.similarity_budget)
            changed |= want != plain
        else:
            assert given[layer] is None
            want = plain
        assert sel.ids.tolist() == want
    assert changed or not distinct  # (the groups made a difference somewhere)


def test_the_reread_groups_the_tail_with_the_events(monkeypatch):
    """The re-read's recorder scores the tail's pieces (the window's tokens cut as events would be)
    with the events: a piece identical to an event is of its group (`tail_selection` is given the
    groups of every span, the events' and the pieces')."""
    import emllm.app.reread as rr_mod
    from emllm.app.reread import SelectionRecorder

    eng, copy = _repeating_engine(True)
    given = []
    real = rr_mod.tail_selection
    monkeypatch.setattr(rr_mod, "tail_selection", lambda *a: given.append(a[8]) or real(*a))
    rec = SelectionRecorder(eng)
    eng.begin_question()
    eng.feed(copy[:6])
    rec.detach()
    votes = rec.votes()
    ids = eng.ids.view().tolist()
    n_events = len(eng.windows[0].events)
    assert len(votes.spans) > n_events + 2 and len(given) == len(eng.windows)  # the tail's pieces were scored too
    want = brute_groups(ids, [tuple(s) for s in votes.spans.tolist()])
    across = {want[i] for i in range(n_events)} & {want[i] for i in range(n_events, len(want))}
    assert across  # a piece of the tail is a copy of an event
    for groups in given:
        assert same_partition(groups.tolist(), want)


def test_stores_made_before_the_key_read_without_it():
    from emllm.store.manifest import BEFORE_THE_KEY as _BEFORE_THE_KEY

    assert _BEFORE_THE_KEY["distinct_events"] is False
    assert tiny_profile().distinct_events is True

