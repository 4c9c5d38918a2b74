"""The step a GPU takes (`engine.window.DEVICE_STEP`: events selected and gathered on the device,
padded to the budget, the padding masked in the attention), run on the CPU against the CPU's
step: the same events selected at every layer and step, the same logits but for rounding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from emllm.config import load_profile
from emllm.engine import window
from emllm.engine.stream import Engine


def _run(device_step: bool, monkeypatch, question: bool, kept: bool = False) -> tuple[list[torch.Tensor], list[tuple]]:
    monkeypatch.setattr(window, "DEVICE_STEP", device_step)
    prof = load_profile("smollm2").replace(chunk_size=16, n_init=4, n_local=32, n_mem=24, min_block=2, max_block=8,
                                           repr_topk=2)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    engine = Engine(AutoModelForCausalLM.from_config(cfg).eval(), prof)
    picked: list[tuple] = []
    engine.on_retrieval = lambda layer, sel, q: picked.append((layer, sel.ids.tolist()))
    g = torch.Generator().manual_seed(1)
    # a repeated stretch: copies of events, which a question's selection counts once
    text = torch.randint(0, 300, (200,), generator=g)
    logits = [engine.feed(torch.cat((text, text[:64], torch.randint(0, 300, (100,), generator=g))))]
    if question:
        engine.begin_question()  # every token scores the events; identical events take one place
        logits.append(engine.step(torch.randint(0, 300, (12,), generator=g))[-1])
    for _ in range(6):
        logits.append(engine.step(logits[-1].argmax()[None], with_surprise=False, kept_memory=kept)[-1])
    return logits, picked


@pytest.mark.parametrize("question,kept", [(False, False), (True, False), (True, True)],
                         ids=["document", "question", "answer-from-the-questions-memory"])
def test_the_device_step_selects_as_the_cpus_and_computes_the_same(monkeypatch, question, kept):
    cpu_logits, cpu_picked = _run(False, monkeypatch, question, kept)
    dev_logits, dev_picked = _run(True, monkeypatch, question, kept)
    assert len(cpu_picked) > 20 and cpu_picked == dev_picked
    for a, b in zip(cpu_logits, dev_logits):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=0)


def test_the_padding_does_not_count(monkeypatch):
    """A selection far smaller than the budget: most of the padded rows are padding, and the
    output is still the CPU step's."""
    from emllm.math.attention import attend

    g = torch.Generator().manual_seed(2)
    q_loc, q_mem = torch.randn(4, 3, 16, generator=g), torch.randn(4, 3, 16, generator=g)
    k_loc, v_loc = torch.randn(2, 10, 16, generator=g), torch.randn(2, 10, 16, generator=g)
    k_mem, v_mem = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    want, mass = attend(q_loc, k_loc, v_loc, q_mem, k_mem, v_mem, 0.25)
    pad = torch.randn(2, 20, 16, generator=g) * 100  # large keys: they would dominate were they counted
    valid = torch.tensor([True] * 5 + [False] * 20)
    got, got_mass = attend(q_loc, k_loc, v_loc, q_mem, torch.cat((k_mem, pad), 1), torch.cat((v_mem, pad), 1), 0.25,
                           mem_valid=valid)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_mass, mass, atol=1e-6, rtol=0)
    # the validity of the memory's last rows only (the selection goes after the initial tokens and
    # the remainder): the rows before them always count
    head = torch.randn(2, 4, 16, generator=g)
    want_head, mass_head = attend(q_loc, k_loc, v_loc, q_mem, torch.cat((head, k_mem), 1), torch.cat((head, v_mem), 1), 0.25)
    got, got_mass = attend(q_loc, k_loc, v_loc, q_mem, torch.cat((head, k_mem, pad), 1), torch.cat((head, v_mem, pad), 1),
                           0.25, mem_valid=valid)
    torch.testing.assert_close(got, want_head, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_mass, mass_head, atol=1e-6, rtol=0)
    assert not torch.allclose(want_head, want, atol=1e-3)  # (the head's rows do count)
    # nothing valid in the memory: the window alone
    alone, _ = attend(q_loc, k_loc, v_loc, None, None, None, 0.25)
    none, _ = attend(q_loc, k_loc, v_loc, q_mem, pad, pad, 0.25, mem_valid=torch.zeros(20, dtype=torch.bool))
    torch.testing.assert_close(none, alone, atol=1e-6, rtol=0)


def test_both_storages_pad_and_score_alike(tmp_path, tiny):
    """The store's events (read on the host) and the same events in RAM (`buffers.padded_rows`)
    give the same padded rows and the same exact scores."""
    from emllm.memory.events import EventMemory
    from emllm.memory.selection import select_events_mask
    from emllm.store import Store, StoredEvents

    from .helpers import ingest_store, words

    folder, prof, _, _ = tiny
    ingest_store(tmp_path / "s", folder, prof, [("a", words(3, 300))])
    with Store.open(tmp_path / "s") as st:
        stored = StoredEvents(st, 1)
        n = len(stored)
        lengths = stored.event_lengths()
        k, v = stored.gather(torch.arange(n))
        reprs = stored.repr_keys()
        ram = EventMemory(k.shape[0], reprs.shape[1], k.shape[2], k.dtype, torch.device("cpu"))
        ram.append(k, v, lengths, reprs)
        g, budget = torch.Generator().manual_seed(4), int(lengths.sum()) // 3
        for _ in range(5):
            q = torch.randn(reprs.shape[1], reprs.shape[2], generator=g)
            assert torch.equal(stored.scores(q), ram.scores(q))
            mask = select_events_mask(ram.scores(q), lengths, budget)
            assert 0 < int(mask.sum()) < n
            (sk, sv, s_ok), (rk, rv, r_ok) = stored.gather_masked(mask, budget), ram.gather_masked(mask, budget)
            assert torch.equal(s_ok, r_ok) and int(s_ok.sum()) == int(lengths[mask].sum())
            assert torch.equal(sk[:, s_ok], rk[:, r_ok]) and torch.equal(sv[:, s_ok], rv[:, r_ok])  # (padding: any)
            ids = mask.nonzero().flatten()
            assert torch.equal(rk[:, r_ok], ram.gather(ids)[0])


def test_a_store_on_the_device_step_ingests_and_answers_as_on_the_cpus(tmp_path, tiny, monkeypatch):
    """A store's events copied to the device (`StoredEvents.on_device`): ingested with the
    device step, the store holds the same events and rows but for rounding, and the greedy
    answers from it, and from the other store with the CPU's step, are the same."""
    from emllm.store import Store

    from .helpers import answers_of, ingest_store, load_tiny, store_arrays, words

    folder, prof, _, _ = tiny
    docs = [("a", words(5, 400)), ("b", words(6, 300))]
    ingest_store(tmp_path / "cpu", folder, prof, docs)
    monkeypatch.setattr(window, "DEVICE_STEP", True)
    ingest_store(tmp_path / "dev", folder, prof, docs)
    with Store.open(tmp_path / "dev") as st:
        assert st.events.rows > 20  # (retrieval at every step of most of the stream)
    a, b = store_arrays(tmp_path / "cpu"), store_arrays(tmp_path / "dev")
    assert a.keys() == b.keys()
    import numpy as np

    for name in a:  # tokens, flags, events: the same; what the attention computed: but for rounding
        if a[name] != b[name]:
            assert name.endswith((".k", ".v", ".r", "surprise.f32")), name
            x, y = np.frombuffer(a[name], np.float32), np.frombuffer(b[name], np.float32)
            np.testing.assert_allclose(y, x, atol=2e-5, rtol=0, err_msg=name)
    model, tok = load_tiny(folder)
    with Store.open(tmp_path / "dev") as st:
        from emllm.app.stream import open_engine

        eng = open_engine(st, model)
        assert eng.windows[0].events.on_device(torch.device("cpu"))
    dev_answers = answers_of(tmp_path / "dev", [model], tok, 12) + answers_of(tmp_path / "cpu", [model], tok, 12)
    monkeypatch.setattr(window, "DEVICE_STEP", False)
    cpu_answers = answers_of(tmp_path / "dev", [model], tok, 12) + answers_of(tmp_path / "cpu", [model], tok, 12)
    assert dev_answers == cpu_answers


@pytest.mark.parametrize("kv_format", ["int8", "int4"])
def test_an_integer_store_is_encoded_on_the_device_as_on_the_host(tmp_path, tiny, monkeypatch, kv_format):
    """An integer store on the device step: each step's rows are encoded and decoded on the device
    and written at the step's end (no read back a layer), and the store is the one whose rows the
    same step sent to the host to encode, byte for byte; its answers are the CPU step's."""
    from emllm.store import Store, StoredEvents

    from .helpers import answers_of, ingest_store, load_tiny, store_arrays, words

    folder, prof, _, _ = tiny
    docs = [("a", words(5, 400)), ("b", words(6, 300))]
    monkeypatch.setattr(window, "DEVICE_STEP", True)
    encoded, on_device = [], StoredEvents._defer_encoded
    monkeypatch.setattr(StoredEvents, "_defer_encoded", lambda self, k, v: encoded.append(1) or on_device(self, k, v))
    ingest_store(tmp_path / "dev", folder, prof, docs, kv_format=kv_format)
    assert len(encoded) > 50  # (every layer of most steps)
    with Store.open(tmp_path / "dev") as st:
        assert st.events.rows > 20 and st.kv_format.name == kv_format
    # the same step, its rows encoded on the host (as before the device encoded them)
    host_only = lambda self: self.on_dev is not None and self.lossless  # noqa: E731
    with monkeypatch.context() as m:
        m.setattr(StoredEvents, "_defers", host_only)
        ingest_store(tmp_path / "host", folder, prof, docs, kv_format=kv_format)
    assert store_arrays(tmp_path / "dev") == store_arrays(tmp_path / "host")
    model, tok = load_tiny(folder)
    dev_answers = answers_of(tmp_path / "dev", [model], tok, 12)
    monkeypatch.setattr(window, "DEVICE_STEP", False)
    assert answers_of(tmp_path / "dev", [model], tok, 12) == dev_answers


def test_an_integer_stores_rows_stay_encoded_on_the_device_through_a_readers_restore(tmp_path, tiny, monkeypatch):
    """An integer store's copy on the device keeps its rows as the files do (a quarter of the bytes
    of bfloat16 for int4), decoded as a step gathers them; a reader that closes events of its own
    and comes back to a snapshot (as the server does each request) holds what a fresh copy would."""
    from emllm.app.stream import open_engine
    from emllm.store import Store

    from .helpers import ingest_store, load_tiny, words

    folder, prof, _, _ = tiny
    monkeypatch.setattr(window, "DEVICE_STEP", True)
    ingest_store(tmp_path / "s", folder, prof, [("a", words(5, 400))], kv_format="int4")
    model, _ = load_tiny(folder)

    def same_as_a_fresh_copy(ev) -> None:
        dev = ev.on_dev
        assert dev is not None and dev.codec is not None
        base, end, n = ev.base, ev.event_end, ev.n_tokens
        k, v = ev._read_encoded(torch.arange(base, end))
        assert torch.equal(dev.keys.view(), k) and torch.equal(dev.values.view(), v)
        tk, tv = ev._read_encoded(torch.arange(end, n))
        assert torch.equal(dev.tail_k, tk) and torch.equal(dev.tail_v, tv)
        assert torch.equal(dev.lengths.view(), ev.lengths.view())

    with Store.open(tmp_path / "s") as st:
        eng = open_engine(st, model)
        g = torch.Generator().manual_seed(3)
        eng.step(torch.randint(0, 300, (16,), generator=g))
        ev = eng.windows[0].events
        assert ev.on_device(torch.device("cpu")) and ev.on_dev.codec is not None
        dev = ev.on_dev  # (encoded rows, not decoded: int4's are under a third of float32's here)
        assert dev.keys.view().dtype == torch.uint8 and dev.bytes_for(1, 0) == 2 * ev.fmt.row_bytes(*ev.row)
        assert 3 * dev.bytes_for(1, 0) < 2 * ev.row[0] * ev.row[1] * 4
        snap = eng.snapshot()
        events = len(ev)
        for _ in range(6):  # a reader's own events
            eng.step(torch.randint(0, 300, (16,), generator=g))
        assert len(ev) > events
        same_as_a_fresh_copy(ev)
        eng.restore(snap)
        assert len(ev) == events
        same_as_a_fresh_copy(ev)
        eng.step(torch.randint(0, 300, (16,), generator=g))
        same_as_a_fresh_copy(ev)


@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_a_store_past_the_device_budget_keeps_its_keys_there_and_a_ring_of_rows(tmp_path, tiny, monkeypatch, fmt):
    """Past the budget for every row, a layer keeps the representative keys on the device and the
    rows of the events selected lately in a ring (`resident.CachedEvents`), copying in the others:
    the store written is the one written with room to spare, bit for bit (the same rows in the
    same order, the padding masked), and so are the answers read from it on that path."""
    from emllm.app.stream import open_engine
    from emllm.memory import resident
    from emllm.store import Store

    from .helpers import answers_of, ingest_store, load_tiny, store_arrays, words

    folder, prof, _, _ = tiny
    docs = [("a", words(7, 1000))]
    monkeypatch.setattr(window, "DEVICE_STEP", True)
    ingest_store(tmp_path / "roomy", folder, prof, docs, kv_format=fmt)
    roomy_answers = answers_of(tmp_path / "roomy", [load_tiny(folder)[0]], load_tiny(folder)[1], 12)
    # ~1,000 tokens, ~160 events a layer, 136 bytes an event's key; a token's rows 256 bytes
    # (float32), 48 (int4): a ring of 4 budgets (128 tokens) beside twice the keys fits a layer's
    # half of the budget, the rows of every token do not; float32's ring is made smaller as the keys grow
    budget = 160_000.0 if fmt == "float32" else 120_000.0
    monkeypatch.setitem(resident._BUDGETS, torch.device("cpu"), budget)
    resized, resize = [], resident.CachedEvents.resize_ring
    monkeypatch.setattr(resident.CachedEvents, "resize_ring", lambda self, n: resized.append(n) or resize(self, n))
    ingest_store(tmp_path / "tight", folder, prof, docs, kv_format=fmt)
    assert store_arrays(tmp_path / "tight") == store_arrays(tmp_path / "roomy")
    assert bool(resized) == (fmt == "float32") and all(n >= 4 * 32 for n in resized)
    model, tok = load_tiny(folder)
    with Store.open(tmp_path / "tight") as st:
        eng = open_engine(st, model)
        g = torch.Generator().manual_seed(3)
        eng.step(torch.randint(0, 300, (16,), generator=g))
        for _ in range(4):
            eng.step(torch.randint(0, 300, (1,), generator=g), with_surprise=False)
        ev = eng.windows[0].events
        assert ev.on_device(torch.device("cpu")) and isinstance(ev.on_dev, resident.CachedEvents)
        assert (ev.on_dev.codec is not None) == (fmt == "int4")
        ring = ev.on_dev.ring
        assert ring.miss_tokens > 0 and ring.hit_tokens > 0  # (a generated token selects what the last did)
        assert 4 * 32 <= ring.cap < int(ev.lengths.view().sum())  # (a ring smaller than the events)
        snap, events = eng.snapshot(), len(ev)
        for _ in range(3):  # a reader's own events, then forgotten: the ring holds none of theirs
            eng.step(torch.randint(0, 300, (16,), generator=g))
        assert len(ev) > events
        eng.restore(snap)
        assert len(ev) == ev.on_dev.lengths.n == ev.on_dev.host_lengths.n == events
        import numpy as np
        assert (ring.offsets(np.arange(events, events + 50)) < 0).all()
    assert answers_of(tmp_path / "tight", [model], tok, 12) == roomy_answers


def test_a_store_that_outgrows_the_device_goes_on_from_its_files(tmp_path, tiny, monkeypatch):
    """Past the device's budget for even its keys and a ring, a layer drops its copy (its deferred
    rows written first) and takes the host path: the store written is the one written with room to
    spare, and so are its answers."""
    from emllm.memory import resident

    from .helpers import answers_of, ingest_store, load_tiny, store_arrays, words

    folder, prof, _, _ = tiny
    docs = [("a", words(7, 500))]
    monkeypatch.setattr(window, "DEVICE_STEP", True)
    ingest_store(tmp_path / "roomy", folder, prof, docs)
    monkeypatch.setitem(resident._BUDGETS, torch.device("cpu"), 40_000.0)  # under a ring of 4 budgets a layer
    ingest_store(tmp_path / "tight", folder, prof, docs)
    from emllm.app.stream import open_engine
    from emllm.store import Store

    with Store.open(tmp_path / "tight") as st:
        model, tok = load_tiny(folder)
        eng = open_engine(st, model)
        assert st.events.rows > 20 and not eng.windows[0].events.on_device(torch.device("cpu"))
    a, b = store_arrays(tmp_path / "roomy"), store_arrays(tmp_path / "tight")
    import numpy as np

    assert a.keys() == b.keys()
    for name in a:
        if a[name] != b[name]:  # (the attention's rounding: the host path attends differently)
            assert name.endswith((".k", ".v", ".r", "surprise.f32")), name
            np.testing.assert_allclose(np.frombuffer(b[name], np.float32), np.frombuffer(a[name], np.float32),
                                       atol=2e-5, rtol=0, err_msg=name)
    assert answers_of(tmp_path / "tight", [model], tok, 12) == answers_of(tmp_path / "roomy", [model], tok, 12)


def test_the_device_memory_setting_sets_the_budget_and_a_bad_one_is_refused_before_loading(monkeypatch):
    """$EMLLM_DEVICE_MEMORY (GB): the budget of an accelerator's events; anything but a positive
    number ends in one clear error, raised by `models.load` before any weight is read."""
    from emllm import models
    from emllm.errors import UsageError
    from emllm.memory import resident

    meta = torch.device("meta")  # (an accelerator that is not the host)
    monkeypatch.delitem(resident._BUDGETS, meta, raising=False)
    monkeypatch.setenv("EMLLM_DEVICE_MEMORY", "1.5")
    assert resident.device_budget(meta) == 1.5 * 2**30
    assert resident.device_budget(torch.device("cpu")) == float("inf")  # (the host: no limit)
    monkeypatch.delitem(resident._BUDGETS, meta)
    for bad in ("lots", "0", "-2", "inf", "nan"):
        monkeypatch.setenv("EMLLM_DEVICE_MEMORY", bad)
        with pytest.raises(UsageError, match="EMLLM_DEVICE_MEMORY"):
            resident.device_budget(meta)
        loaded = []
        monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loaded.append(1))
        with pytest.raises(UsageError, match="EMLLM_DEVICE_MEMORY"):
            models.load(models.resolve("smollm2"))
        assert not loaded

