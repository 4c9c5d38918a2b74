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


@pytest.mark.parametrize("store", [False, True, "int4"])
def test_the_device_steps_reads_do_not_grow_with_the_layers(store):
    """The step a GPU takes (issue 70): a few reads a step, none a layer (a step that closes an
    event or not may differ by one), its events in RAM or in a store (an integer one's rows
    encoded on the device)."""
    fmt = store if isinstance(store, str) else None
    chunk2, token2 = step_reads(2, device_step=True, store=bool(store), kv_format=fmt)
    chunk8, token8 = step_reads(8, device_step=True, store=bool(store), kv_format=fmt)
    assert max(chunk2.total, chunk8.total, token2.total, token8.total) <= 8
    assert abs(chunk8.total - chunk2.total) <= 1 and abs(token8.total - token2.total) <= 1


@pytest.mark.parametrize("fmt", [None, "int8"])  # (int4's rows here weigh less than the events' keys)
def test_past_the_device_budget_a_step_reads_one_selection_back_a_layer(fmt):
    """A store whose rows outgrow the device's budget (`resident.CachedEvents`: keys there, rows in
    a ring): each layer reads its selection back once (which events to copy), nothing more; the
    misses' rows are found and read on the host without reading a tensor back."""
    from emllm.memory import resident

    seen = []
    make = resident.CachedEvents.__init__

    def spy(self, *a, **k):
        seen.append(self)
        make(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(resident.CachedEvents, "__init__", spy)
        ring2 = step_reads(2, device_step=True, store=True, ring=True, kv_format=fmt)
        ring8 = step_reads(8, device_step=True, store=True, ring=True, kv_format=fmt)
    full2 = step_reads(2, device_step=True, store=True, kv_format=fmt)
    full8 = step_reads(8, device_step=True, store=True, kv_format=fmt)
    assert len(seen) == 2 + 8 and sum(r.ring.miss_tokens for r in seen) > 0  # (the ring path ran, every layer)
    for i in range(2):  # (chunk, token): one more read a layer than with every row there (a step that
        # closes an event or not may differ by one)
        assert abs(ring2[i].total - full2[i].total - 2) <= 1 and abs(ring8[i].total - full8[i].total - 8) <= 1
        assert ring8[i].counts["cpu"] - full8[i].counts["cpu"] >= 7


def test_the_cpus_step_reads_a_layers_selection_on_the_host():
    """On the CPU the selection runs on the host (numpy, faster there): its reads grow with the
    layers, which is why a GPU takes the other step."""
    for store in (False, True):
        chunk2, _ = step_reads(2, store=store)
        chunk8, _ = step_reads(8, store=store)
        assert chunk8.total >= chunk2.total + 6 * 4




@pytest.mark.parametrize("dtype, most", [(torch.float32, (43, 39)), (torch.bfloat16, (47, 44))])
def test_the_device_steps_attention_dispatches_a_bounded_number_of_ops_a_layer(monkeypatch, dtype, most):
    """On a GPU a layer's step is paced by the kernels it launches (docs/benchmarks.md ›
    Accelerators): the ops each layer's attention hook (retrieval, gather, attention, the window's
    slide) dispatches in the device step, counted on the CPU, are held where they stand (`most`: a
    chunk's, a token's, the first layer's, which also makes the step's query tables), so that an
    added op shows here. In bfloat16, as a GPU runs, the casts to attention's float32 count too.
    (The plain model's whole layer dispatches 45 a chunk and 40 a token in bfloat16.)"""
    from emllm.engine.window import LayerWindow

    seen: list[int] = []
    forward = LayerWindow.forward

    def counted(self, *a, **k):
        with Launches() as n:
            out = forward(self, *a, **k)
        seen.append(n.total)
        return out

    monkeypatch.setattr(LayerWindow, "forward", counted)
    for layers in (2, 3):
        seen.clear()
        step_reads(layers, device_step=True, store=True, count=HostReads, dtype=dtype)
        chunk, token = seen[-2 * layers : -layers], seen[-layers:]  # the last two steps: a chunk, a token
        # (the first layer also makes the step's query tables, `StepInfo.query_rope`)
        assert max(chunk) <= most[0] and max(token) <= most[1], (chunk, token)
        assert len(set(chunk[1:])) <= 1 and len(set(token[1:])) <= 1, (chunk, token)  # the others alike


def test_closing_events_launches_a_few_ops_a_layer(monkeypatch):
    """Every layer closes the same events at a step: their sizes on the device, their token rows
    and the layers' mean keys are made once a step (`window.close_events`); what a layer adds is
    its own (its rows appended to its memory, a store's offsets on the host; its remainder trimmed
    by an offset, not copied): 9 ops, where computing each layer's representatives alone took 24."""
    from emllm.engine import stream, window

    totals: list[int] = []
    close = window.close_events

    def counted(*a, **k):
        with Launches() as n:
            close(*a, **k)
        totals.append(n.total)

    monkeypatch.setattr(stream, "close_events", counted)
    last = {}
    for layers in (2, 8):
        totals.clear()
        step_reads(layers, device_step=True, store=True, count=HostReads)
        last[layers] = totals[-2:]  # (the same two closing steps at either depth)
    per_layer = [(b - a) / 6 for a, b in zip(last[2], last[8])]
    assert max(per_layer) <= 9, (last, per_layer)


def test_an_answer_on_its_questions_memory_reads_nothing_a_layer():
    """Profile answer_retrieval "question": a question's chunk and the answer's tokens after it
    (events closing as they leave the window, which join the kept memory from the rows the window
    held) read no more at 8 layers than at 2."""
    chunk2, answer2 = step_reads(2, device_step=True, store=True, question=True, answer_tokens=24)
    chunk8, answer8 = step_reads(8, device_step=True, store=True, question=True, answer_tokens=24)
    assert chunk2.total <= 12 and chunk8.total == chunk2.total
    # a few a token, the step's own (its ids, its logits, whether events close): a step that
    # closes an event or not may differ by one
    assert answer2.total <= 24 * 4 and abs(answer8.total - answer2.total) <= 2


@pytest.mark.parametrize("dim", [192, 128])
def test_scoring_on_a_device_takes_a_few_blocks_however_many_events(monkeypatch, dim):
    """Every event is scored in blocks, three ops each (`selection.token_scores`). On the CPU a
    block is ~4 MiB (its caches); on a device each block costs its launches, so blocks are sized
    by `DEVICE_BLOCK_BYTES`: a step's query scores a million tokens' events (66k; SmolLM2's dim
    192, the 0.5B's 128) in one block, a question's 512 tokens in a few hundred ops, not thousands
    of blocks. Counted on the meta device (shapes only, nothing computed)."""
    from emllm.memory import selection

    events, meta = 66_000, torch.device("meta")
    rows = torch.empty(events, dim, dtype=torch.bfloat16, device=meta)

    def ops(t: int) -> int:
        with Launches() as n:
            out = selection.token_scores(events, dim, lambda a, b: rows[a:b], torch.empty(t, dim, device=meta))
        assert out.shape == (t, events)
        return n.total

    device = ops(1), ops(512)
    monkeypatch.setattr(selection, "DEVICE_BLOCK_BYTES", selection.SCORE_BLOCK_BYTES)  # the CPU's blocks
    cpu = ops(1), ops(512)
    assert device[0] == 3 and cpu[0] >= 27  # one block of three ops, against 9 or 17 blocks
    assert device[1] <= 400 and cpu[1] >= 12_000, (device, cpu)  # 512 queries: blocks of 512 or 1,024 events, not 16


def test_the_benchmark_prints_the_scoring_ops_of_a_devices_blocks_beside_the_cpus(monkeypatch, capsys):
    """`python -m benchmarks.host_syncs --scoring`: a line a length, dim and query count."""
    import json

    from benchmarks import host_syncs

    monkeypatch.setattr("sys.argv", ["host_syncs", "--scoring"])
    host_syncs.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 6 and {r["queries"] for r in rows} == {1, 512}
    for r in rows:
        assert r["ops_device_blocks"] < r["ops_cpu_blocks"]
        if r["queries"] == 1:
            assert r["ops_device_blocks"] == 3


def test_the_scoring_benchmark_times_blocks_that_give_the_same_bits(monkeypatch):
    """`--scoring --device D` times a device's blocks against the CPU's there and checks their
    bits; here on the CPU, its scores in blocks of 64 events equal those in one block."""
    from benchmarks.host_syncs import scoring_seconds
    from emllm.memory import selection

    t1, one = scoring_seconds(3000, 192, 8, "cpu")  # 3,000 events: one block of the CPU's 4 MiB
    monkeypatch.setattr(selection, "SCORE_BLOCK_BYTES", 64 * 192 * 4)
    t2, many = scoring_seconds(3000, 192, 8, "cpu")  # (8 queries: blocks of 16 events)
    assert one.shape == (8, 3000) and torch.equal(one, many) and t1 > 0 and t2 > 0
