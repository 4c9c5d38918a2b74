"""The engine on a CUDA device: the same results as on the CPU, and as the plain model on the GPU.

Skipped where torch sees no CUDA device (CI has none). Run on a lent GPU with
`python -m pytest -q tests/test_cuda.py`; what ran where is in docs/benchmarks.md (Accelerators).
`EMLLM_TEST_ACCELERATOR=cpu` runs them with the CPU in the GPU's place: a dry run of the tests
themselves where no GPU is (every comparison then holds trivially or bit for bit).
The CPU tests cover the same paths bit for bit; these check what only a GPU exercises: the memory's
attention written out instead of the CPU's flash kernel, tensors and store reads on the device, the
faiss index fed from device memory, a model whose layers wait in CPU RAM (accelerate's offload).
"""

from __future__ import annotations

import os

import pytest
import torch

from emllm import models
from emllm.config import load_profile_file
from emllm.engine.sampling import Sampling
from emllm.engine.stream import Engine
from .conftest import ARCHS, tiny_model, tiny_model_dtype, tiny_profile
from .helpers import TOL, answers_of, engine_logits, ingest_store, load_tiny, store_arrays, vanilla_logits, words

CUDA = torch.device(os.environ.get("EMLLM_TEST_ACCELERATOR", "cuda"))
pytestmark = pytest.mark.skipif(CUDA.type == "cuda" and not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(autouse=True)
def ieee_float32():
    """TF32 rounds matmul inputs to 10 bits: exactness to 1e-4 needs true float32 products."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


def _ids(n: int, vocab: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["one-shot", "chunks", "decode"])
def test_tiny_models_on_cuda_equal_vanilla_on_cuda(arch, mode):
    model = tiny_model(arch).to(CUDA)
    n = 60
    ids = _ids(n, model.config.vocab_size)
    ref = vanilla_logits(model, ids.to(CUDA)).cpu()
    split = {"one-shot": [n], "chunks": [16, 16, 16, 12], "decode": [20] + [1] * 40}[mode]
    got = engine_logits(model, tiny_profile(n_local=64, chunk_size=64 if mode == "one-shot" else 16), ids, split)
    assert got.device.type == CUDA.type
    assert (got.cpu() - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("arch", ["llama3.1", "phi3"])
@pytest.mark.parametrize("mode", ["one-shot", "chunks", "decode"])
def test_bf16_on_cuda_close_to_vanilla_bf16_on_cuda(arch, mode):
    model = tiny_model_dtype(arch, torch.bfloat16).to(CUDA)
    n = 60
    ids = _ids(n, model.config.vocab_size)
    ref = vanilla_logits(model, ids.to(CUDA)).cpu()
    split = {"one-shot": [n], "chunks": [16, 16, 16, 12], "decode": [20] + [1] * 40}[mode]
    got = engine_logits(model, tiny_profile(n_local=64, chunk_size=64 if mode == "one-shot" else 16), ids, split).cpu()
    scale = ref.abs().max().item()  # the CPU test's bounds (test_exact.test_bf16_models_close_to_vanilla)
    assert (got - ref).abs().max().item() <= 4 * 2**-8 * scale
    assert (got - ref).abs().mean().item() <= 2**-8 * scale / 2


def _run(engine: Engine, ids: torch.Tensor, decode: int) -> tuple[torch.Tensor, list[int]]:
    """Logits of a stream read in chunks, then the greedy tokens of `decode` steps."""
    logits = engine.feed(ids).float().cpu()
    toks = []
    for _ in range(decode):
        t = int(engine.last_logits.argmax())
        toks.append(t)
        engine.step(torch.tensor([t]))
    return logits, toks


@pytest.mark.parametrize("arch", ["llama3.1", "qwen2"])
@pytest.mark.parametrize("faiss", [False, True])
def test_memory_on_cuda_equals_memory_on_cpu(arch, faiss):
    """A stream far beyond the window: events formed, stored and retrieved on the GPU give the CPU
    engine's events, logits (to float32 rounding) and greedy tokens; with faiss_threshold 1 the
    retrieval goes through the faiss graph, fed from device memory."""
    prof = tiny_profile(faiss_threshold=1 if faiss else None)
    ids = _ids(600, 300, seed=11)
    cpu_model, gpu_model = tiny_model(arch), tiny_model(arch).to(CUDA)
    a, b = Engine(cpu_model, prof), Engine(gpu_model, prof)
    assert all(w.local_k.device.type == CUDA.type for w in b.windows)
    la, ta = _run(a, ids, 12)
    lb, tb = _run(b, ids, 12)
    assert a.n_events > 20 and a.n_events == b.n_events
    for wa, wb in zip(a.windows, b.windows):
        assert torch.equal(wa.events.event_lengths().cpu(), wb.events.event_lengths().cpu())
    assert (la - lb).abs().max().item() <= TOL
    assert ta == tb


def test_sampling_from_logits_on_cuda_is_the_cpus():
    """A seed picks the same tokens from the GPU's logits as from the same logits on the CPU, with
    every logits processor on (the first GPU run found `emllm ask --temperature` and the server's
    sampled answers failing there: a CPU generator and CPU ids against GPU logits)."""
    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(2)) * 3
    opts = Sampling(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.3, seed=5)
    picked = []
    for dev in ("cpu", CUDA):
        choose, answer = opts.chooser(context=[1, 2, 3]), []
        for row in logits.to(dev):
            answer.append(choose(answer, row))
        picked.append(answer)
    assert picked[0] == picked[1] and len(set(picked[0])) > 3


def test_store_written_on_cuda_is_the_cpu_store(tiny, tmp_path):
    """`emllm ingest`'s loop with the model on the GPU writes the CPU's store (events and boundaries
    exactly, keys and values to float32 rounding); asked on the GPU it answers as the CPU does."""
    folder, prof, _, _ = tiny
    docs = [("doc", words(8, 400))]
    ingest_store(tmp_path / "cpu", folder, prof, docs)
    model, tok = load_tiny(folder)
    model.to(CUDA)
    ingest_store(tmp_path / "gpu", folder, prof, docs, model=model)
    a, b = store_arrays(tmp_path / "cpu"), store_arrays(tmp_path / "gpu")
    assert a.keys() == b.keys()
    floats = 0
    for name in a:
        if name.endswith((".i32", ".u8")):  # events, boundaries, offsets: exactly
            assert a[name] == b[name], name
        elif not name.endswith(".safetensors"):  # float32 rows: close, not equal (another kernel's sums)
            x, y = (torch.frombuffer(bytearray(d[name]), dtype=torch.float32) for d in (a, b))
            torch.testing.assert_close(x, y, atol=TOL, rtol=0, equal_nan=True, msg=name)  # NaN: no surprise
            floats += 1
    assert floats >= 4
    cpu_model, _ = load_tiny(folder)
    answers = answers_of(tmp_path / "gpu", [cpu_model, model], tok, 8)
    assert answers[0] == answers[1] and answers[0]


def test_an_integer_store_written_on_cuda_answers_as_on_the_cpu(tiny, tmp_path):
    """An int4 store written with the model on the GPU (rows encoded there, kept encoded in the
    device's copy): the same events and boundaries as the CPU's store, and asked on the GPU it
    answers as the CPU does from it."""
    folder, prof, _, _ = tiny
    docs = [("doc", words(8, 400))]
    ingest_store(tmp_path / "cpu", folder, prof, docs, kv_format="int4")
    model, tok = load_tiny(folder)
    model.to(CUDA)
    ingest_store(tmp_path / "gpu", folder, prof, docs, kv_format="int4", model=model)
    a, b = store_arrays(tmp_path / "cpu"), store_arrays(tmp_path / "gpu")
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith(".i32") or name.endswith(".u8") and "layers" not in name:  # events, boundaries
            assert a[name] == b[name], name
    cpu_model, _ = load_tiny(folder)
    answers = answers_of(tmp_path / "gpu", [cpu_model, model], tok, 8)
    assert answers[0] == answers[1] and answers[0]


def test_model_split_between_cuda_and_cpu(tiny, tmp_path):
    """accelerate's device map with layer 1 kept in CPU RAM: its weights wait on meta and are brought
    to the GPU for each forward, so its memory lives on the GPU too (where the layer computes); the
    results are the whole model's on the CPU."""
    folder, prof, _, _ = tiny
    gpu = 0 if CUDA.type == "cuda" else "cpu"
    split_map = {"model.embed_tokens": gpu, "model.rotary_emb": gpu, "model.layers.0": gpu, "model.layers.1": "cpu",
                 "model.norm": gpu, "lm_head": gpu}  # lm_head is tied to the embedding
    split, _ = models.load(models.ModelSource(str(folder), folder, None), device_map=split_map)
    whole, tok = load_tiny(folder)
    profile = load_profile_file(prof)
    ids = torch.tensor(tok(words(7, 300))["input_ids"])
    a, b = Engine(whole, profile), Engine(split, profile)
    if CUDA.type == "cuda":
        assert split.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
    assert [w.local_k.device.type for w in b.windows] == [CUDA.type, CUDA.type]
    la, ta = _run(a, ids, 6)
    lb, tb = _run(b, ids, 6)
    assert a.n_events > 5 and a.n_events == b.n_events
    assert (la - lb).abs().max().item() <= TOL
    assert ta == tb


@pytest.mark.parametrize("store", [False, True, "int4"])
def test_a_steps_reads_back_on_cuda_do_not_grow_with_the_layers(store):
    """On the GPU the engine takes the device step by default: a step's reads back to the host
    (each a synchronisation there) are a few, whatever the layers, its events in RAM or a store
    (an integer one's rows encoded and kept encoded on the device)."""
    from benchmarks.host_syncs import step_reads

    fmt = store if isinstance(store, str) else None
    counts = [step_reads(n, device_step=None, store=bool(store), device=str(CUDA), kv_format=fmt) for n in (2, 8)]
    (chunk2, token2), (chunk8, token8) = counts
    if CUDA.type == "cuda":
        assert max(chunk2.total, chunk8.total, token2.total, token8.total) <= 8
        assert abs(chunk8.total - chunk2.total) <= 1 and abs(token8.total - token2.total) <= 1


def test_a_store_past_the_gpus_budget_reads_its_rows_through_a_ring(tiny, tmp_path, monkeypatch):
    """A budget too small for every row: the keys on the GPU, the rows of the events selected
    lately in a ring there, the others copied in from the host (`resident.CachedEvents`). The
    store written is the one written with room (events and boundaries exactly, rows to float32
    rounding), and asked on the GPU it answers as with room; a step reads back one selection a
    layer more than with every row there."""
    from benchmarks.host_syncs import step_reads
    from emllm.engine import window
    from emllm.memory import resident

    folder, prof, _, _ = tiny
    docs = [("doc", words(7, 1000))]
    if CUDA.type != "cuda":  # (a dry run: the step a GPU takes by default)
        monkeypatch.setattr(window, "DEVICE_STEP", True)
    model, tok = load_tiny(folder)
    model.to(CUDA)
    ingest_store(tmp_path / "roomy", folder, prof, docs, model=model)
    dev = torch.device("cuda", torch.cuda.current_device()) if CUDA.type == "cuda" else CUDA
    monkeypatch.setitem(resident._BUDGETS, dev, 160_000.0)  # (as tests/test_device_step.py's ring)
    made, make = [], resident.CachedEvents.__init__
    monkeypatch.setattr(resident.CachedEvents, "__init__", lambda self, *a, **k: made.append(self) or make(self, *a, **k))
    ingest_store(tmp_path / "tight", folder, prof, docs, model=model)
    assert made and sum(r.ring.miss_tokens for r in made) > 0
    a, b = store_arrays(tmp_path / "roomy"), store_arrays(tmp_path / "tight")
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith((".i32", ".u8")):
            assert a[name] == b[name], name
        elif not name.endswith(".safetensors"):
            x, y = (torch.frombuffer(bytearray(d[name]), dtype=torch.float32) for d in (a, b))
            torch.testing.assert_close(x, y, atol=TOL, rtol=0, equal_nan=True, msg=name)
    answers = answers_of(tmp_path / "tight", [model], tok, 8)
    monkeypatch.setitem(resident._BUDGETS, dev, float("inf"))
    assert answers == answers_of(tmp_path / "roomy", [model], tok, 8) and answers[0]
    monkeypatch.delitem(resident._BUDGETS, dev)
    ring = [step_reads(n, device_step=True, store=True, device=str(CUDA), ring=True) for n in (2, 8)]
    full = [step_reads(n, device_step=True, store=True, device=str(CUDA)) for n in (2, 8)]
    for i in range(2):  # (chunk, token)
        assert abs(ring[1][i].total - full[1][i].total - 8) <= 1 and abs(ring[0][i].total - full[0][i].total - 2) <= 1


def test_a_steps_deferred_rows_come_back_from_the_host_and_the_device(tiny, tmp_path):
    """A step's rows wait on the device for one read back at its end; rows appended from host
    tensors (a program filling memory from the CPU) wait beside them: one flush writes both, in order."""
    from emllm.evals.scratch import ScratchStores

    folder, prof, _, _ = tiny
    model, tok = load_tiny(folder)
    model.to(CUDA)
    a, b = torch.arange(6, dtype=torch.float32).view(2, 3), torch.arange(5, dtype=torch.int32)
    got: list[list[torch.Tensor]] = []
    with ScratchStores(model, tok, load_profile_file(prof), tmp_path) as make:
        store = make().windows[0].events.store
        store.defer(got.append, [a.to(CUDA), b])
        store.defer(got.append, [b.to(CUDA) * 2, a[1:]])
        store.flush_deferred()
    assert [[t.device.type for t in ts] for ts in got] == [["cpu", "cpu"], ["cpu", "cpu"]]
    assert torch.equal(got[0][0], a) and torch.equal(got[0][1], b)
    assert torch.equal(got[1][0], b * 2) and torch.equal(got[1][1], a[1:])


@pytest.mark.parametrize("t", [1, 512])
def test_scores_on_cuda_in_its_large_blocks_are_the_cpus_bits(t):
    """A device scores its events in blocks of `DEVICE_BLOCK_BYTES`, the CPU in blocks of ~4 MiB:
    each score's bits depend on its row alone (`selection.scores_in_blocks`), so the same events
    and queries give the same bits both ways, and on the device in blocks of any size."""
    from emllm.memory import selection

    g = torch.Generator().manual_seed(5)
    events, dim = 20_000, 192  # several of the CPU's blocks, one of the device's for one query
    rows = (torch.randn(events, dim, generator=g) * 3).to(torch.bfloat16)
    q = torch.randn(t, dim, generator=g)
    on_cpu = selection.token_scores(events, dim, lambda a, b: rows[a:b], q)
    dev_rows = rows.to(CUDA)
    on_dev = selection.token_scores(events, dim, lambda a, b: dev_rows[a:b], q.to(CUDA)).cpu()
    assert torch.equal(on_dev, on_cpu)
    small = pytest.MonkeyPatch()
    small.setattr(selection, "DEVICE_BLOCK_BYTES", 1 << 20)  # other blocks on the device
    try:
        assert torch.equal(selection.token_scores(events, dim, lambda a, b: dev_rows[a:b], q.to(CUDA)).cpu(), on_cpu)
    finally:
        small.undo()
