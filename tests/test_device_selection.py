"""The selection on the device (`selection.select_events_mask`) against the host's
(`select_events`): the same events, on inputs built to find where they could part (ties, NaN,
infinities, empty events, a budget met exactly, groups of copies)."""

from __future__ import annotations

import pytest
import torch

from emllm.memory.selection import best_of_groups_mask, select_events, select_events_mask
from emllm.memory.distinct import best_of_groups


def _case(seed: int) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 60, (1,), generator=g))
    # few distinct values: many ties; some NaN and infinities
    scores = torch.randint(-3, 4, (n,), generator=g).float() / 2
    special = torch.rand(n, generator=g)
    scores[special < 0.08] = float("nan")
    scores[(special >= 0.08) & (special < 0.12)] = float("inf")
    scores[(special >= 0.12) & (special < 0.15)] = float("-inf")
    lengths = torch.randint(0, 9, (n,), generator=g)
    budget = int(torch.randint(0, int(lengths.sum()) + 5, (1,), generator=g))
    groups = torch.randint(0, max(1, n // 3), (n,), generator=g)
    return scores, lengths, budget, groups


def _host_mask(scores, lengths, budget, groups=None) -> torch.Tensor:
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    mask[select_events(scores, lengths, budget, groups).ids] = True
    return mask


@pytest.mark.parametrize("seed", range(300))
def test_the_device_selects_what_the_host_selects(seed):
    scores, lengths, budget, groups = _case(seed)
    assert torch.equal(select_events_mask(scores, lengths, budget), _host_mask(scores, lengths, budget))
    assert torch.equal(select_events_mask(scores, lengths, budget, groups), _host_mask(scores, lengths, budget, groups))


@pytest.mark.parametrize("seed", range(100))
def test_each_groups_best_as_on_the_host(seed):
    scores, _, _, groups = _case(seed)
    want = torch.zeros(scores.numel(), dtype=torch.bool)
    want[torch.from_numpy(best_of_groups(scores.numpy(), groups.numpy()))] = True
    assert torch.equal(best_of_groups_mask(scores, groups), want)


def test_a_budget_met_exactly_and_one_token_short():
    scores = torch.tensor([3.0, 2.0, 1.0, 0.0])
    lengths = torch.tensor([4, 4, 4, 4])
    assert select_events_mask(scores, lengths, 8).tolist() == [True, True, False, False]
    assert select_events_mask(scores, lengths, 7).tolist() == [True, False, False, False]
    # filling stops at the first event that does not fit, even where a later one would
    lengths = torch.tensor([4, 9, 1, 1])
    assert select_events_mask(scores, lengths, 8).tolist() == [True, False, False, False]


def test_copies_fill_only_what_every_group_left():
    scores = torch.tensor([5.0, 4.0, 3.0, 1.0])
    lengths = torch.tensor([2, 2, 2, 2])
    groups = torch.tensor([0, 0, 1, 2])  # event 1 is a copy of event 0
    # room for the three groups and the copy
    assert select_events_mask(scores, lengths, 8, groups).tolist() == [True, True, True, True]
    # room for the three groups only: the copy waits even though it outscores two of them
    assert select_events_mask(scores, lengths, 6, groups).tolist() == [True, False, True, True]
    # not every group fits: no copy at all
    assert select_events_mask(scores, lengths, 4, groups).tolist() == [True, False, True, False]
