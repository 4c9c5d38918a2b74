"""Models that mix sliding-window and global layers (Gemma 2 and 3): the sliding layers keep their
own window and no memory, the global ones the episodic memory; exact where the stream fits."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma3TextConfig

from emllm.app import stream
from emllm.engine.sliding import SlidingLayer
from emllm.engine.stream import Engine, sliding_layers
from emllm.engine.window import LayerWindow
from emllm.math import surprise
from emllm.store import Store, StoreError
from emllm.store.manifest import FORMAT_VERSION
from tests.conftest import tiny_model, tiny_profile
from tests.helpers import TINY_PROFILE, TOL, assert_same_state, engine_logits, ingest_now_and_later, ingest_store, \
    load_tiny, store_arrays, vanilla_logits, words

WINDOW = 12  # the tiny models' sliding window: far shorter than the streams below
LAYOUT = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def hybrid_config(arch: str, vocab: int = 300):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=256,
                  sliding_window=WINDOW, query_pre_attn_scalar=24, layer_types=LAYOUT)
    if arch == "gemma2":  # one rope base; attention and final logits soft-capped (low caps: they bite)
        return Gemma2Config(**common, attn_logit_softcapping=0.05, final_logit_softcapping=0.5)
    # local and global layers of their own rope bases (far apart: a wrong table shows)
    return Gemma3TextConfig(**common, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e4}})


def hybrid_model(arch: str, vocab: int = 300):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hybrid_config(arch, vocab), dtype=torch.float32).eval()


def test_layers_that_slide_get_no_memory():
    model = hybrid_model("gemma3")
    eng = Engine(model, tiny_profile())
    assert sliding_layers(model.config) == [WINDOW, WINDOW, None, WINDOW]
    assert [w.layer_idx for w in eng.windows] == [2]  # the one global layer holds memory
    assert [type(w) for w in eng.layers] == [SlidingLayer, SlidingLayer, LayerWindow, SlidingLayer]


def test_refinement_builds_its_graph_from_the_layers_with_memory():
    from emllm.config import ProfileError

    model = hybrid_model("gemma3")
    eng = Engine(model, tiny_profile(segmentation="SM", n_local=16))
    assert [w.layer_idx for w in eng.refinement_layers()] == [2]
    eng.feed(torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(6)))
    assert eng.n_events > 10
    with pytest.raises(ProfileError, match="refine_from_layer = 3 .* last layer with memory is layer 2"):
        Engine(model, tiny_profile(refine_from_layer=3))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("split", [[60], [16, 16, 16, 12], [20] + [1] * 40, [7] * 8 + [4]],
                         ids=["one-shot", "chunks", "decode", "ragged"])
def test_hybrid_models_equal_vanilla(arch, split):
    """The stream (60 tokens, five windows) fits the global layers' local window: emllm is the
    plain model, its sliding layers' band included, across chunk borders and token by token."""
    model = hybrid_model(arch)
    ids = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(3))
    ref = vanilla_logits(model, ids)
    got = engine_logits(model, tiny_profile(n_local=64, chunk_size=max(split)), ids, split)
    assert (got - ref).abs().max().item() <= TOL


def test_softcapping_is_applied(monkeypatch):
    """Gemma 2's attention caps matter at these scales: without them emllm would be far off."""
    from emllm.math import attention

    model = hybrid_model("gemma2")
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(4))
    ref = vanilla_logits(model, ids)
    monkeypatch.setattr(attention, "_capped", lambda s, cap: s)
    got = engine_logits(model, tiny_profile(n_local=64, chunk_size=40), ids, [40])
    assert (got - ref).abs().max().item() > 10 * TOL


@pytest.mark.parametrize("split", ["chunks", "decode"])
def test_sliding_layers_stay_exact_past_the_memory(split):
    """A stream far longer than the local window (memory retrieved at the global layer): the
    first layer, a sliding one ahead of any global layer, computes exactly what the plain model's
    does at every token (its window sees the same keys)."""
    model = hybrid_model("gemma3")
    n = 200
    ids = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(5))
    seen: list[torch.Tensor] = []
    hook = model.model.layers[0].register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            model.set_attn_implementation("eager")
            model(ids[None])
        ref = seen.pop()[0]  # [n, hidden]
        eng = Engine(model, tiny_profile(n_local=16, chunk_size=8))
        if split == "chunks":
            eng.feed(ids)
        else:
            eng.feed(ids[:120])
            for t in ids[120:]:
                eng.step(t[None], with_surprise=False)
        got = torch.cat([s[0] for s in seen])
    finally:
        hook.remove()
    assert eng.n_events > 10 and eng.windows[0].events.n_tokens > 100  # the global layer read memory
    assert (got - ref).abs().max().item() <= TOL
    assert eng.layers[0].keys.shape[1] == WINDOW - 1  # the window and nothing more


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    """A tiny Gemma 3 with SmolLM2's tokenizer, saved as a model folder, and the tiny profile."""
    from emllm import models

    root = tmp_path_factory.mktemp("gemma")
    tok = AutoTokenizer.from_pretrained(models.resolve("smollm2").path)
    folder = root / "model"
    hybrid_model("gemma3", len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    prof = root / "tiny.yaml"
    prof.write_text(TINY_PROFILE)
    return folder, prof


def test_a_store_keeps_files_for_the_global_layers_only_and_appends_exactly(gemma_folder, tmp_path):
    folder, prof = gemma_folder
    # the second store's engine restores the sliding layers' windows from the state
    ingest_now_and_later(tmp_path, folder, prof, [("a", words(2, 300))], [("b", words(3, 250))])
    arrays = store_arrays(tmp_path / "one")
    assert {k for k in arrays if k.startswith("layers/")} == {"layers/02.k", "layers/02.v", "layers/02.r"}
    assert arrays == store_arrays(tmp_path / "two")
    assert_same_state(tmp_path / "one", tmp_path / "two")
    m = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert m["version"] == FORMAT_VERSION and m["geometry"]["memory_layers"] == [2] and m["rows"]["events"] > 20
    with Store.open(tmp_path / "one") as st:
        state = st.load_state()
        assert state["layer0.window_k"].shape == (2, WINDOW - 1, 16)  # a sliding layer's window, in the state


def test_a_resumed_stream_continues_exactly(gemma_folder, tmp_path):
    """The store's engine (its sliding windows read back from the state) computes what the
    in-RAM engine computes over the same stream."""
    folder, prof = gemma_folder
    ingest_store(tmp_path / "s", folder, prof, [("a", words(4, 300))])
    model, tok = load_tiny(folder)
    from emllm.config import load_profile_file

    with Store.open(tmp_path / "s") as st:
        job = st.job.read().long()
        tail = stream.pending_tokens(st)
        engine = stream.open_engine(st, model)
        more = torch.tensor(tok("the key is under the stone")["input_ids"])
        got = engine.feed(torch.cat((torch.tensor(tail, dtype=torch.long), more)) if tail else more)
    ref = Engine(model, load_profile_file(prof))
    ref.feed(job[: job.numel() - len(tail)])
    want = ref.feed(torch.cat((torch.tensor(tail, dtype=torch.long), more)) if tail else more)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_store_of_another_layout_is_refused(gemma_folder, tmp_path, tiny):
    """A store of the hybrid model opened with a model of another layout, and a manifest whose
    memory_layers were edited: refused with one line, nothing lost."""
    folder, prof = gemma_folder
    ingest_store(tmp_path / "s", folder, prof, [("a", words(5, 100))])
    other = load_tiny(tiny[0])[0]
    with Store.open(tmp_path / "s") as st, pytest.raises(StoreError, match="geometry"):
        stream.open_engine(st, other)
    from emllm.store.manifest import checksum

    path = tmp_path / "s" / "manifest.json"
    good = path.read_text()
    for bad in ([3, 2], [2, 4], [], "2"):  # not increasing, past the last layer, none, not a list
        m = json.loads(good)
        m["geometry"]["memory_layers"] = bad
        m["checksum"] = checksum(m)
        path.write_text(json.dumps(m))
        with pytest.raises(StoreError, match="memory_layers"):
            Store.open(tmp_path / "s")
    path.write_text(good)
    with Store.open(tmp_path / "s") as st:
        assert st.info.rows.tokens > 0


# -- the real Gemma 3 270M -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_case(gemma270):
    """1,300 tokens of a real document (2.5 sliding windows), the plain model's logits (eager,
    the reference) and how far its own sdpa is from them: float32's yardstick for this model."""
    model, tok, prof = gemma270
    ids = torch.tensor(tok(open("docs/store-format.md").read())["input_ids"][:1300])
    ref = vanilla_logits(model, ids)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        sdpa = model(ids[None]).logits[0].float()
    return ids, ref, (sdpa - ref).abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("split", [[1300], [500, 500, 300], [1276] + [1] * 24], ids=["one-shot", "chunks", "decode"])
def test_gemma3_270m_equals_vanilla(gemma270, gemma_case, split):
    """emllm within 1e-4 of the plain model's eager logits relative to their scale, its sliding
    layers' band crossing chunk borders and tokens. Not 1e-4 absolute: the plain model's own sdpa
    is further than that from its eager here, and the gap moves with the thread count (float32
    over a residual stream far larger than the Llama-type models', and the sliding layers' keys
    rotated at their rows in the window, not at the stream's positions: docs/benchmark-log.md)."""
    model, _, prof = gemma270
    ids, ref, plain_gap = gemma_case
    # every token's logits: the exact surprise head (the profile's shortlist computes the last one's)
    got = engine_logits(model, prof.replace(chunk_size=max(split), surprise_head="full"), ids, split)
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert plain_gap < 1e-4 * scale and err <= 1e-4 * scale, (err, plain_gap, scale)


@pytest.mark.slow
def test_gemma3_270m_with_its_shortlist_surprise_gives_the_same_last_logits(gemma270, gemma_case):
    """The profile's surprise head (a shortlist) changes no logit the model returns: each chunk's
    last one is the plain model's, as with the full head."""
    model, _, prof = gemma270
    ids, ref, _ = gemma_case
    assert prof.surprise_head == "shortlist"
    eng = Engine(model, prof.replace(chunk_size=500))
    last = [eng.step(ids[off : off + 500])[-1].float() for off in range(0, 1300, 500)]
    assert isinstance(eng._head, surprise.Head)  # the check passed: the later chunks took the shortlist
    scale = ref.abs().max().item()
    for row, got in zip((499, 999, 1299), last):
        assert (got - ref[row]).abs().max().item() <= 1e-4 * scale


@pytest.mark.slow
def test_gemma3_270m_greedy_continuation_equals_vanilla(gemma270):
    model, tok, prof = gemma270
    ids = torch.tensor(tok(open("docs/store-format.md").read())["input_ids"][:900])
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model.generate(ids[None], max_new_tokens=24, do_sample=False,
                             attention_mask=torch.ones(1, ids.numel(), dtype=torch.long))[0, ids.numel():].tolist()
    eng = Engine(model, prof.replace(chunk_size=ids.numel()))
    eng.step(ids)
    assert eng.generate(24) == ref and len(set(ref)) > 3


@pytest.mark.slow
def test_a_stream_without_a_chat_template_starts_with_the_bos_the_tokenizer_adds(gemma270):
    """Gemma reads badly without its <bos>: a base model's stream and the passkey's prompts start
    with it, and the plain model cut to its context keeps it at the front."""
    import random

    from emllm.app.stream import StreamFormat, encode_framing
    from emllm.evals import passkey

    model, tok, _ = gemma270
    fmt = StreamFormat.for_tokenizer(tok)
    assert not fmt.chat and encode_framing(tok, fmt.prefix) == [tok.bos_token_id] == [2]
    p = passkey.build_prompt(tok, 600, 0.5, random.Random(0))
    assert p.document[0] == tok.bos_token_id and p.document.count(tok.bos_token_id) == 1
    seen = []
    real = model.generate
    try:
        model.generate = lambda x, **kw: (seen.append(x[0].tolist()), real(x, **{**kw, "max_new_tokens": 1}))[1]
        model.config.max_position_embeddings, ctx = 300, model.config.max_position_embeddings
        passkey.run_baseline(model, tok, p, max_new_tokens=4)
    finally:
        model.generate = real
        model.config.max_position_embeddings = ctx
    assert seen[0][0] == tok.bos_token_id and len(seen[0]) == 296 and seen[0][1:] == (p.document + p.question)[-295:]


def test_retrieval_reports_name_the_layers_with_memory(gemma_folder, tmp_path):
    """Through the front door: a store of the hybrid model is ingested, asked, and its retrieval
    shown for the global layer; a sliding layer's retrieval is refused in one line."""
    import emllm

    folder, prof = gemma_folder
    with emllm.create(tmp_path / "s", str(folder), profile=str(prof), dtype="float32") as mem:
        mem.ingest(("a", words(6, 400)))
    assert emllm.store_summary(tmp_path / "s")["memory_layers"] == [2]
    with emllm.open(tmp_path / "s") as mem:
        r = mem.retrieval("where is the key?", layer=2)
        assert r["layer_ids"] == [2] and r["layers"] == 1 and len(r["coverage"]) == 1
        assert r["layer"]["steps"] and r["top_events"]
        with pytest.raises(emllm.EmllmError, match="layer 1 attends within a sliding window.*memory: 2"):
            mem.retrieval("where is the key?", layer=1)
        assert list(mem.answer("where is the key?", max_new_tokens=4))  # it answers


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_the_passkeys_plain_baseline_reads_a_hybrid_prompt_in_chunks_as_in_one_pass(arch, monkeypatch):
    """The plain model's passkey baseline prefills a hybrid model's prompt in chunks (its sliding
    layers attend within their window, not over every pair): the next logits are one pass's, and
    `generate` from that cache gives one pass's greedy tokens."""
    from emllm.evals import passkey

    model = hybrid_model(arch)
    monkeypatch.setattr(passkey, "PREFILL_CHUNK", 16)
    x = torch.randint(0, 300, (1, 70), generator=torch.Generator().manual_seed(5))
    kw = passkey._prefilled(model, x)
    assert len(kw) == 1
    with torch.no_grad():
        got = model(input_ids=x[:, -1:], **kw, use_cache=True).logits[0, -1]
        ref = model(input_ids=x).logits[0, -1]
    assert (got - ref).abs().max().item() <= TOL
    greedy = dict(attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(x, **greedy, **passkey._prefilled(model, x)), model.generate(x, **greedy))
    assert passkey._prefilled(tiny_model("llama3.1"), x) == {}  # a model without sliding layers: one pass, as generate reads
