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
def test_selection_takes_one_of_each_group(seed):
    g = torch.Generator().manual_seed(seed)
    n = 80
    scores = torch.randn(n, generator=g)
    lengths = torch.randint(1, 9, (n,), generator=g)
    groups = torch.randint(0, 30, (n,), generator=g)
    sel = select_events(scores, lengths, 60, groups)
    keep = best_of_groups(scores.numpy(), groups.numpy()).tolist()
    want = [keep[i] for i in brute_select([scores[k].item() for k in keep], [int(lengths[k]) for k in keep], 60)]
    assert sel.ids.tolist() == want
    assert torch.equal(sel.scores, scores[sel.ids])
    assert len(set(groups[sel.ids].tolist())) == len(want)  # never two of a group
    assert select_events(scores, lengths, 60).ids.tolist() == brute_select(scores.tolist(), lengths.tolist(), 60)


@pytest.mark.parametrize("distinct", [True, False])
def test_a_question_selects_one_copy_of_a_repeated_event(distinct):
    """A stream that repeats one stretch of tokens (events cut at fixed lengths, so its copies are
    identical events) among random ones, a budget for most events: the question's selection holds one copy with
    distinct_events, several without; and it is the selection of the best of each group, by the
    scores the layer computed (exact)."""
    model = tiny_model("llama3.1")
    prof = tiny_profile(segmentation="F", max_block=8, min_block=8, n_mem=160, question_centering=1.0,
                        question_scoring="lse", distinct_events=distinct)
    eng = Engine(model, prof)
    g = torch.Generator().manual_seed(7)
    copy = torch.randint(0, 300, (8,), generator=g)
    parts = [torch.randint(0, 300, (prof.n_init,), generator=g)]
    for i in range(30):  # copies at event boundaries (events start after n_init, every 8 tokens)
        parts.append(copy if i % 2 else torch.randint(0, 300, (8,), generator=g))
    eng.feed(torch.cat(parts))
    seen: dict[int, tuple] = {}
    eng.on_retrieval = lambda layer, sel, q: seen.__setitem__(layer, (sel, q))
    eng.begin_question()
    eng.feed(copy[:6])  # a question made of the copy's tokens
    spans = event_spans(eng.windows[0].events.event_lengths(), prof.n_init)
    ids = eng.ids.view()
    copies = [e for e, (s, t) in enumerate(spans.tolist()) if torch.equal(ids[s:t], copy)]
    assert len(copies) >= 10
    groups = brute_groups(ids.tolist(), [tuple(s) for s in spans.tolist()])
    held = {layer: len(set(sel.ids.tolist()) & set(copies)) for layer, (sel, _) in seen.items()}
    assert len(seen) == len(eng.windows)
    if distinct:
        assert max(held.values()) == 1
        for layer, (sel, q) in seen.items():  # exact: the best of each group, by the layer's own scores
            from emllm.memory.selection import TOKEN_SCORINGS

            sc = TOKEN_SCORINGS["lse"](sel.token_scores)
            keep = best_of_groups(sc.numpy(), np.array(groups)).tolist()
            lengths = eng.windows[layer].events.event_lengths()
            want = [keep[i] for i in brute_select([sc[k].item() for k in keep], [int(lengths[k]) for k in keep],
                                                  eng.similarity_budget)]
            assert sel.ids.tolist() == want
    else:
        assert max(held.values()) > 1


def test_stores_made_before_the_key_read_without_it():
    from emllm.app.stream import _BEFORE_THE_KEY

    assert _BEFORE_THE_KEY["distinct_events"] is False
    assert tiny_profile().distinct_events is True


@pytest.mark.parametrize("distinct", [True, False])
def test_the_reread_votes_hold_one_copy_among_events_and_the_tail(distinct):
    """The re-read's recorder scores the tail's pieces (the window's tokens cut as events would be)
    with the events: a piece identical to an event is of its group, so each layer's votes hold one
    span of each content with distinct_events; several copies without."""
    from emllm.app.reread import SelectionRecorder

    model = tiny_model("llama3.1")
    prof = tiny_profile(segmentation="F", max_block=8, min_block=8, n_mem=160, question_centering=1.0,
                        question_scoring="lse", distinct_events=distinct)
    eng = Engine(model, prof)
    g = torch.Generator().manual_seed(8)
    copy = torch.randint(0, 300, (8,), generator=g)
    parts = [torch.randint(0, 300, (prof.n_init,), generator=g)]
    for i in range(30):
        parts.append(copy if i % 2 else torch.randint(0, 300, (8,), generator=g))
    eng.feed(torch.cat(parts))
    rec = SelectionRecorder(eng)
    eng.begin_question()
    eng.feed(copy[:6])
    rec.detach()
    votes = rec.votes()
    ids = eng.ids.view()
    n_events = len(eng.windows[0].events)
    assert len(votes.spans) > n_events + 2  # the tail's pieces were scored too
    most = 0
    for sel in votes.selections.values():
        spans = votes.spans[sel].tolist()
        contents = [tuple(ids[s:t].tolist()) for s, t in spans]
        most = max(most, contents.count(tuple(copy.tolist())))
        if distinct:
            assert len(set(contents)) == len(contents)
    assert (most == 1) if distinct else (most > 1)
