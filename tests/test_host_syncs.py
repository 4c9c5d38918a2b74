"""The instrument that counts a step's reads back to the host (each a GPU synchronisation), and
the device step's count: a number that does not grow with the model's layers."""

from __future__ import annotations

import pytest
import torch

from benchmarks.host_syncs import HostReads, Launches, step_reads


def test_host_reads_counts_each_kind_of_read_and_nothing_after():
    t = torch.arange(6.0)
    with HostReads() as r:
        t.sum().item()
        bool(t[0])
        int(t[1])
        t.tolist()
        t.cpu()
        t.numpy()  # (needs a host tensor: no read of its own)
        (t * 2).sum()  # computing reads nothing back
    assert dict(r.counts) == {"scalar": 3, "tolist": 1, "cpu": 1} and r.total == 5
    t.cpu()
    t.sum().item()
    assert r.total == 5  # the methods are put back


def test_launches_counts_the_ops_that_compute_and_not_views():
    t = torch.arange(6.0)
    with Launches() as n:
        u = t.view(2, 3).t()[0].unsqueeze(0)  # views: no kernel
        (u * 2 + 1).sum()
    assert dict(n.counts) == {"mul": 1, "add": 1, "sum": 1} and n.total == 3


def test_the_instrument_sees_a_steps_reads():
    chunk, token = step_reads(2)
    assert chunk.counts["scalar"] > 0 and token.counts["scalar"] > 0


@pytest.mark.parametrize("store", [False, True])
def test_the_device_steps_reads_do_not_grow_with_the_layers(store):
    """The step a GPU takes (issue 70): a few reads a step, none a layer (a step that closes an
    event or not may differ by one), its events in RAM or in a store."""
    chunk2, token2 = step_reads(2, device_step=True, store=store)
    chunk8, token8 = step_reads(8, device_step=True, store=store)
    assert max(chunk2.total, chunk8.total, token2.total, token8.total) <= 8
    assert abs(chunk8.total - chunk2.total) <= 1 and abs(token8.total - token2.total) <= 1


def test_the_cpus_step_reads_a_layers_selection_on_the_host():
    """On the CPU the selection runs on the host (numpy, faster there): its reads grow with the
    layers, which is why a GPU takes the other step."""
    for store in (False, True):
        chunk2, _ = step_reads(2, store=store)
        chunk8, _ = step_reads(8, store=store)
        assert chunk8.total >= chunk2.total + 6 * 4
