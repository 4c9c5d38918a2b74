"""Surprise threshold, retrieval selection and representative keys against brute-force versions."""

from __future__ import annotations

import math

import pytest
import torch

from emllm.memory.buffers import token_index

from emllm.memory.events import EventMemory

from emllm.memory.selection import event_scores, gamma, mean_keys, representative_keys, score_error, score_groups, scores_in_blocks, select_events
import emllm.math.surprise as surprise_mod
from emllm.math.surprise import boundary_flags, token_surprise
from .helpers import brute_contiguity, brute_select


def brute_flags(s: list[float], start: int, tau: int, gamma: float) -> list[bool]:
    out = []
    for t in range(start, len(s)):
        prev = [x for x in s[max(0, t - tau) : t] if not math.isnan(x)]
        if math.isnan(s[t]) or len(prev) < 2:
            out.append(False)
            continue
        mean = sum(prev) / len(prev)
        std = math.sqrt(sum((x - mean) ** 2 for x in prev) / len(prev))
        out.append(s[t] > mean + gamma * std)
    return out


def test_surprise_in_row_blocks_equals_one_call_bit_for_bit(monkeypatch):
    # Blocks of 3 rows over 10 (a ragged last block), and the row carried over from the last chunk.
    g = torch.Generator().manual_seed(0)
    logits, prev = torch.randn(10, 50, generator=g) * 4, torch.randn(50, generator=g)
    ids = torch.randint(0, 50, (10,), generator=g)
    monkeypatch.setattr(surprise_mod, "_BLOCK_BYTES", 3 * 50 * 4)
    got = token_surprise(logits, ids, prev)
    ce = torch.nn.functional.cross_entropy(torch.cat((prev[None], logits[:-1])), ids, reduction="none")
    assert torch.equal(got, ce)
    assert torch.isnan(token_surprise(logits, ids, None)[0])


@pytest.mark.parametrize("seed", range(5))
def test_boundary_flags_match_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(300, generator=g) * 5
    s[torch.rand(300, generator=g) < 0.1] = float("nan")
    for start, tau, gamma in [(0, 16, 1.0), (37, 50, 0.5), (250, 400, 2.0)]:
        got = boundary_flags(s, start, tau, gamma).tolist()
        assert got == brute_flags(s.tolist(), start, tau, gamma)
    assert any(boundary_flags(s, 0, 16, 1.0).tolist())


def test_threshold_uses_only_preceding_tokens():
    g = torch.Generator().manual_seed(1)
    s = torch.rand(200, generator=g)
    t = s.clone()
    t[120:] = torch.rand(80, generator=g) * 10
    assert boundary_flags(s, 0, 30, 1.0)[:120].tolist() == boundary_flags(t, 0, 30, 1.0)[:120].tolist()




@pytest.mark.parametrize("seed", range(20))
def test_select_events_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    e = int(torch.randint(0, 40, (1,), generator=g))
    scores = torch.randint(0, 6, (e,), generator=g).float()  # many ties
    lengths = torch.randint(1, 20, (e,), generator=g)
    for budget in (0, 1, 5, 60, 10_000):
        sel = select_events(scores, lengths, budget)
        assert sel.ids.tolist() == brute_select(scores.tolist(), lengths.tolist(), budget)
        assert int(lengths[sel.ids].sum()) <= budget


@pytest.mark.parametrize("seed", range(5))
def test_select_events_sorting_only_the_top_k_matches_brute_force(seed):
    """Many events, few fit: select_events sorts only those scoring at least the k-th best (ties
    at that score included); the result must still be the full sort's prefix."""
    from emllm.memory import selection
    g = torch.Generator().manual_seed(seed)
    n = selection.TOPK_FROM + 600  # (fewer are simply sorted)
    scores = torch.randint(0, 30, (n,), generator=g).float()  # many ties, also at the cut
    lengths = torch.randint(8, 129, (n,), generator=g)
    for budget in (8, 100, 1024, 3000):
        sel = select_events(scores, lengths, budget)
        assert sel.ids.tolist() == brute_select(scores.tolist(), lengths.tolist(), budget)
        assert torch.equal(sel.scores, scores[sel.ids])
    nan = scores.clone()
    nan[7] = float("nan")  # sorts first in torch: both paths must agree with the full sort
    order = torch.sort(nan, descending=True, stable=True).indices
    fits = torch.cumsum(lengths[order], 0) <= 1024
    assert select_events(nan, lengths, 1024).ids.tolist() == sorted(order[: int(fits.sum())].tolist())


@pytest.mark.parametrize("n", [9, 60, 2000])
def test_select_events_orders_special_values_as_torchs_stable_sort(n):
    """The ranking runs in numpy: NaN, infinities, signed zeros and ties come out in the order of
    torch.sort(descending=True, stable=True), the reference (NaN first, ties in id order)."""
    g = torch.Generator().manual_seed(n)
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0])
    scores = special[torch.randint(0, 6, (n,), generator=g)]
    scores[: min(n, 6)] = special[: min(n, 6)]
    lengths = torch.randint(1, 5, (n,), generator=g)
    order = torch.sort(scores, descending=True, stable=True).indices
    for budget in (1, 7, 40, 10_000):
        fits = torch.cumsum(lengths[order], 0) <= budget
        sel = select_events(scores, lengths, budget)
        assert sel.ids.tolist() == sorted(order[: int(fits.sum())].tolist())
        assert torch.equal(sel.scores.nan_to_num(7.0), scores[sel.ids].nan_to_num(7.0))


def test_empty_memory_selects_nothing():
    assert select_events(torch.empty(0), torch.empty(0, dtype=torch.long), 100).ids.numel() == 0


def test_representative_keys_match_loop():
    g = torch.Generator().manual_seed(0)
    h_kv, h_q, d = 2, 6, 5
    lengths = torch.tensor([3, 1, 8, 5])
    n = int(lengths.sum())
    keys = torch.randn(h_kv, n, d, generator=g, dtype=torch.float64)
    mass = torch.rand(h_q, n, generator=g, dtype=torch.float64).float()
    got = representative_keys(keys, mass, lengths, topk=4)
    off = 0
    for ev, ln in enumerate(lengths.tolist()):
        for h in range(h_q):
            m = mass[h, off : off + ln].tolist()
            top = sorted(range(ln), key=lambda i: -m[i])[: min(4, ln)]
            want = torch.stack([keys[h // 3, off + i] for i in top]).mean(0)
            torch.testing.assert_close(got[ev, h], want)
        off += ln


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mean_keys_of_several_layers_at_once_are_each_layers_own_bits(dtype):
    """`window.close_events` computes the layers' mean keys (and their unit scaling) in one batch:
    each layer's must be the bits it gets alone, or a store's events would depend on how many
    layers shared a step."""
    from emllm.memory.selection import event_groups, unit_keys

    g = torch.Generator().manual_seed(3)
    keys = torch.randn(5, 2, 40, 16, generator=g).to(dtype)  # [layers, H_kv, n, D]
    lengths = torch.tensor([7, 1, 12, 20])
    for heads in (2, 6):
        # (as close_events calls it: the rows made once, the lengths as float32)
        together = unit_keys(mean_keys(keys, lengths.float(), heads, event_groups(lengths.numpy())))  # [layers, e, heads, D]
        for layer in range(5):
            alone = unit_keys(mean_keys(keys[layer], lengths, heads))
            assert torch.equal(together[layer], alone), (heads, layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64])
def test_mean_keys_from_groups_are_the_bits_of_one_grid(dtype, d):
    """Events are summed in groups padded to powers of two (`event_groups`), the groups' sums put
    back in event order: the same bits as one grid as wide as the longest event, as stores were
    written before the groups (a store continued by today's writer grows as the old code grew it);
    longest events whose length is not a multiple of 4 included."""
    from emllm.memory.selection import event_groups, event_rows

    g = torch.Generator().manual_seed(d)
    several = 0  # cases of more than one group
    for longest in (8, 13, 37, 126, 128, 137):
        for _ in range(8):
            sizes = torch.randint(1, longest + 1, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g)
            sizes[int(torch.randint(0, sizes.numel(), (1,), generator=g))] = longest
            n = int(sizes.sum())
            keys = (torch.randn(3, 2, n, d, generator=g) * 5).to(dtype)  # [layers, H_kv, n, D]
            idx, valid = event_rows(sizes, n)
            sums = (keys[..., idx, :].float() * valid[:, :, None]).sum(-2)  # one grid: [layers, H_kv, e, D]
            want = (sums / sizes.float()[:, None]).to(dtype).transpose(-3, -2)
            groups = event_groups(sizes.numpy())
            several += len(groups.parts) > 1
            assert torch.equal(mean_keys(keys, sizes.float(), 2, groups), want), (longest, sizes.tolist())
    assert several >= 30


def test_mean_keys_match_loop():
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3, 1, 8, 5])
    keys = torch.randn(2, int(lengths.sum()), 5, generator=g).bfloat16()
    got = mean_keys(keys, lengths, 6)  # [e, H_q, D], GQA: query heads 0-2 read KV head 0
    assert got.shape == (4, 6, 5) and got.dtype == torch.bfloat16
    off = 0
    for ev, ln in enumerate(lengths.tolist()):
        for h in range(6):
            want = keys[h // 3, off : off + ln].double().mean(0)
            torch.testing.assert_close(got[ev, h].double(), want, rtol=2**-8, atol=1e-6)  # one bf16 rounding
        off += ln
    # all tokens by attention (every mass ties) is the same mean
    torch.testing.assert_close(mean_keys(keys.float(), lengths, 6), representative_keys(keys.float(), torch.zeros(6, 17), lengths, 128))


def test_event_memory_gather_and_scores():
    mem = EventMemory(1, 2, 3, torch.float32, torch.device("cpu"))
    k = torch.arange(30, dtype=torch.float32).view(1, 10, 3)
    mem.append(k, -k, torch.tensor([4, 6]), torch.randn(2, 2, 3))
    mem.append(k[:, :2] + 100, -k[:, :2], torch.tensor([2]), torch.randn(1, 2, 3))
    gk, gv = mem.gather(torch.tensor([2, 0]))
    assert gk[0, :, 0].tolist() == [100.0, 103.0, 0.0, 3.0, 6.0, 9.0]
    assert token_index(torch.tensor([5, 0]), torch.tensor([2, 3])).tolist() == [5, 6, 0, 1, 2]
    q = torch.randn(2, 3)
    torch.testing.assert_close(event_scores(mem.repr_keys(), q), torch.einsum("ehd,hd->e", mem.repr_keys(), q))


@pytest.mark.parametrize("dim,dtype", [(96, torch.float32), (576, torch.float16), (2048, torch.bfloat16)])
def test_a_score_has_the_same_bits_whatever_rows_it_is_scored_with(dim, dtype):
    # Readers of a sketched store score a few events exactly and must match the scan bit for bit
    # (ties among near-identical events are broken by those bits); torch.mv fails this.
    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(3000, dim, generator=g) * 2 + 1).to(dtype)
    q = torch.randn(dim, generator=g)
    full = scores_in_blocks(3000, dim, lambda a, b: x[a:b], q)
    torch.testing.assert_close(full, (x.double() @ q.double()).float(), rtol=1e-5, atol=1e-4)
    for m in (1, 7, 300, 2999):
        ids = torch.randperm(3000, generator=g)[:m].sort().values
        for off in (0, 1, 5):  # the rows at other addresses, not 64-byte aligned
            buf = torch.empty(m * dim + 8, dtype=dtype)[off : off + m * dim].view(m, dim)
            buf.copy_(x[ids])
            assert torch.equal(scores_in_blocks(m, dim, lambda a, b: buf[a:b], q), full[ids])


@pytest.mark.parametrize("n,t,dim,dtype", [(1, 1, 192, torch.bfloat16), (777, 3, 192, torch.bfloat16),
                                             (5000, 40, 192, torch.float32), (3001, 17, 576, torch.float16),
                                             (100, 5, 7, torch.float32), (9000, 64, 192, torch.bfloat16)])
def test_token_scores_are_each_querys_scan_bit_for_bit(n, t, dim, dtype):
    # A question's chunk scores every event with each of its tokens at once (blocks of [T, m, dim]);
    # each row must be the scan's bits, which the z-scores and a store's readers rely on.
    from emllm.memory.selection import token_scores
    g = torch.Generator().manual_seed(n + t)
    x = (torch.randn(n, dim, generator=g) * 3).to(dtype)
    q = torch.randn(t, dim, generator=g)
    got = token_scores(n, dim, lambda a, b: x[a:b], q)
    assert got.shape == (t, n) and got.dtype == torch.float32
    g_ = score_groups(dim)
    for i in range(t):
        # the scan's formula, one query over all rows at once: products, g strided sums, their sum
        want = (x.float() * q[i]).view(n, g_, dim // g_).sum(1).sum(1)
        assert torch.equal(got[i], want)
        assert torch.equal(got[i], scores_in_blocks(n, dim, lambda a, b: x[a:b], q[i]))


def test_norms_up_bound_each_rows_norm_from_above_bit_for_bit_in_any_block():
    from emllm.memory import prune
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5000, 192, generator=g) * torch.logspace(-2, 2, 192)).to(torch.bfloat16)
    up = prune.norms_up(x)
    exact = x.double().norm(dim=1)
    assert up.dtype == torch.float32 and bool((up.double() >= exact).all())
    assert bool((up.double() - exact <= exact * 2.0**-23).all())  # one float32 step at most
    assert torch.equal(prune.norms_up(x[1234:4321]), up[1234:4321])


@pytest.mark.parametrize("dim", [7, 96, 576, 2048])
def test_scores_stay_within_their_rounding_bound(dim):
    # score_error is what the sketch's bound trusts; cancelling sums make the rounding show.
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(2000, dim, generator=g) * torch.logspace(-3, 3, dim)[torch.randperm(dim, generator=g)]
    q = torch.randn(dim, generator=g)
    got = scores_in_blocks(2000, dim, lambda a, b: x[a:b], q).double()
    exact = x.double() @ q.double()
    worst = ((got - exact).abs() / ((x.double() * q.double()).abs().sum(1))).max()
    assert 0 < float(worst) <= score_error(dim)
    assert score_groups(576) == 24 and score_error(576) == gamma(47) and score_error(7) == gamma(7)




@pytest.mark.parametrize("seed", range(30))
def test_contiguity_queue_matches_brute_force(seed):
    from emllm.memory.selection import update_contiguity

    g = torch.Generator().manual_seed(seed)
    e = int(torch.randint(1, 30, (1,), generator=g))
    lengths = torch.randint(1, 10, (e,), generator=g)
    queue = torch.zeros(0, dtype=torch.long)
    for step in range(6):
        selected = torch.unique(torch.randint(0, e, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g))
        n = 1 + step % 2
        budget = int(torch.randint(0, 40, (1,), generator=g))
        want = brute_contiguity(queue.tolist(), selected.tolist(), lengths.tolist(), n, budget)
        queue = update_contiguity(queue, selected, lengths, n, budget)
        assert queue.tolist() == want
        assert int(lengths[queue].sum()) <= budget


def test_contiguity_keeps_old_entries_while_they_fit():
    from emllm.memory.selection import update_contiguity

    lengths = torch.full((20,), 4)
    q = update_contiguity(torch.zeros(0, dtype=torch.long), torch.tensor([5]), lengths, 1, 12)
    assert q.tolist() == [4, 6]
    q = update_contiguity(q, torch.tensor([15]), lengths, 1, 12)  # 4 + 6 + 14 + 16 = 16 tokens > 12
    assert q.tolist() == [6, 14, 16]  # the oldest went first
    q = update_contiguity(q, torch.tensor([6]), lengths, 1, 12)  # 5 and 7 join; 6 is selected, stays queued
    assert q.tolist() == [16, 5, 7]
