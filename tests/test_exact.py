"""When the whole stream fits in the local window, emllm must be the unpatched model (spec §1)."""

from __future__ import annotations

import pytest
import torch

from emllm.engine.stream import Engine, UnsupportedModelError
from emllm.models import stop_token_ids
from tests.conftest import ARCHS, tiny_model, tiny_model_dtype, tiny_profile
from tests.helpers import TOL, engine_logits, vanilla_logits

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["one-shot", "chunks", "decode"])
def test_tiny_models_equal_vanilla(arch, mode):
    model = tiny_model(arch)
    n = 60  # beyond the tiny Llama-3.1 / Phi-3 original context (32): rope scaling is exercised
    prof = tiny_profile(n_local=64, chunk_size=64 if mode == "one-shot" else 16)
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
    ref = vanilla_logits(model, ids)
    split = {"one-shot": [n], "chunks": [16, 16, 16, 12], "decode": [20] + [1] * 40}[mode]
    got = engine_logits(model, prof, ids, split)
    assert (got - ref).abs().max().item() <= TOL


def smollm2_case(model, tok, prof, mode: str):
    """(ids, the plain model's logits, emllm's) of a 300-token text read one-shot, in chunks of
    100, or decoded token by token after a prefill."""
    text = "The grass is green. The sky is blue. " * 30 + "Alice hid the key under the red stone in the garden."
    ids = torch.tensor(tok(text)["input_ids"])
    n = ids.numel()
    ref = vanilla_logits(model, ids)
    split = {"one-shot": [n], "chunks": [100, 100, n - 200], "decode": [n - 24] + [1] * 24}[mode]
    return ids, ref, engine_logits(model, prof.replace(chunk_size=n), ids, split)


@pytest.mark.parametrize("mode", ["one-shot", "chunks", "decode"])
@pytest.mark.parametrize("real", ["smollm2", pytest.param("qwen05", marks=pytest.mark.slow)])
def test_real_models_equal_vanilla(real, mode, request):
    """SmolLM2-135M (Llama), and the default Qwen2.5-Coder-0.5B (q/k/v biases, 14 query heads over
    2 KV heads, rope base 1e6)."""
    model, tok, prof = request.getfixturevalue(real)
    ids, ref, got = smollm2_case(model, tok, prof, mode)
    assert (got - ref).abs().max().item() <= TOL


@pytest.mark.slow
def test_qwen05_greedy_answer_equals_vanilla(qwen05):
    """Greedy decoding through emllm gives the plain model's answer, token for token."""
    model, tok, prof = qwen05
    msgs = [{"role": "user", "content": "Alice hid the key under the red stone. Where is the key? Answer briefly."}]
    ids = torch.tensor(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"])
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model.generate(ids[None], max_new_tokens=24, do_sample=False, attention_mask=torch.ones(1, ids.numel(), dtype=torch.long))
    ref_answer = ref[0, ids.numel():].tolist()
    eng = Engine(model, prof.replace(chunk_size=ids.numel()))
    eng.step(ids)
    stop = set(stop_token_ids(tok, model))
    want = []
    for t in ref_answer:  # the plain model's answer up to its first stop token
        if t in stop:
            break
        want.append(t)
    assert "stone" in tok.decode(want) and len(want) >= 3, tok.decode(ref_answer)
    assert eng.generate(24, stop_ids=stop) == want


def test_surprise_equals_vanilla_log_softmax_across_chunks():
    model = tiny_model("llama3.1")
    ids = torch.randint(0, 300, (50,), generator=torch.Generator().manual_seed(5))
    ref = torch.log_softmax(vanilla_logits(model, ids), -1)
    want = -ref[:-1].gather(1, ids[1:, None]).squeeze(1)
    eng = Engine(model, tiny_profile(n_local=64, chunk_size=7))  # 7 does not divide 50: ragged borders
    eng.feed(ids)
    got = eng.surprise.view()
    assert torch.isnan(got[0])  # the first token has no prediction
    torch.testing.assert_close(got[1:], want, atol=1e-5, rtol=0)


def test_unsupported_architecture_is_refused():
    from transformers import AutoModelForCausalLM, GPT2Config

    m = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        Engine(m, tiny_profile())


def test_sliding_window_smaller_than_local_window_is_refused():
    from transformers import AutoModelForCausalLM, MistralConfig

    from tests.conftest import COMMON

    m = AutoModelForCausalLM.from_config(MistralConfig(**COMMON, sliding_window=16))
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        Engine(m, tiny_profile())


# -- low precision and the rotary tables ---------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama3.1", "phi3"])  # llama3 rope scaling; LongRoPE with attention scaling
@pytest.mark.parametrize("mode", ["one-shot", "chunks"])
def test_bf16_models_close_to_vanilla(arch, mode):
    model = tiny_model_dtype(arch, torch.bfloat16)
    n = 60  # fits the local window, beyond the original context (32): long factors / llama3 scaling
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
    ref = vanilla_logits(model, ids)
    prof = tiny_profile(n_local=64, chunk_size=64 if mode == "one-shot" else 16)
    got = engine_logits(model, prof, ids, [n] if mode == "one-shot" else [16, 16, 16, 12])
    # bf16 keeps 8 significant bits: a few ulps of the largest logit, and far less on average
    # (vanilla bf16 itself differs from vanilla float32 by about 0.004 here)
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 4 * 2**-8 * scale
    assert (got - ref).abs().mean().item() <= 2**-8 * scale / 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one-shot", "chunks", "decode"])
def test_smollm2_in_bf16_close_to_vanilla_in_bf16(smollm2, mode):
    """The real model computing in bfloat16 (as --dtype auto does on this project's CPU): emllm
    against the plain model in the same dtype, on the fused path (chunks of 100 or more queries)
    and the written-out one (decoding). Through 30 layers bf16's rounding moves the plain model's
    own logits by ~0.1 on average from float32's: emllm in bf16 must stay within that noise of
    the plain model in bf16, and pick the same next token wherever the plain model is sure."""
    from emllm import models

    model32, tok, prof = smollm2
    model, _ = models.load(models.resolve("smollm2"), dtype="bfloat16")
    ids, ref, got = smollm2_case(model, tok, prof, mode)
    noise = ref - vanilla_logits(model32, ids)  # what bf16 itself does to the plain model
    assert (got - ref).abs().mean() <= 1.5 * noise.abs().mean()
    assert (got - ref).abs().max() <= 2 * noise.abs().max()
    top2 = ref.topk(2, -1).values
    sure = (top2[:, 0] - top2[:, 1]) > 2 * noise.abs().max()
    assert bool(sure.any()) and torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure])


def test_rotary_bf16_matches_the_models_rotation():
    # What the attention receives at position 0 is q0 = bf16(q * bf16(s)); rotating q0 with our
    # table must give what the model's own rotation at position t gives, without a bias. Dividing
    # the bf16 table by the exact s (the former code) left a factor bf16(s)/s ~ 0.997 here.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from emllm.math.rope import Rotary, apply_rotary

    model = tiny_model_dtype("phi3", torch.bfloat16)
    emb = model.model.rotary_emb
    s = emb.attention_scaling
    assert abs(float(torch.tensor(s).to(torch.bfloat16)) / s - 1) > 2e-3  # the rounding matters
    n = 64
    bf = torch.empty(0, dtype=torch.bfloat16)
    cos_m, sin_m = emb(bf, torch.arange(n)[None])
    cos_0, sin_0 = emb(bf, torch.zeros(1, n, dtype=torch.long))
    q = torch.randn(1, 32, n, cos_m.shape[-1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want, _ = apply_rotary_pos_emb(q, q, cos_m, sin_m)  # the model, position t
    q0, _ = apply_rotary_pos_emb(q, q, cos_0, sin_0)  # what our attention gets
    cos, sin = Rotary(emb).table(n, torch.device("cpu"), torch.bfloat16)
    assert cos.dtype == torch.bfloat16 and cos.shape == (n, cos_m.shape[-1])
    got = apply_rotary(q0, cos, sin).double()
    w = want.double()
    bias = float((got * w).sum() / (w * w).sum())  # least-squares scale of ours against the model's
    assert abs(bias - 1) < 1e-3
    assert float((got - w).abs().mean() / w.abs().mean()) < 2.5e-3  # rounding noise only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_in_place_rounds_as_the_plain_formula(dtype):
    # apply_rotary writes x * cos, then subtracts/adds the half products in place: each product
    # rounded, then the sum, as x * cos + rotate_half(x) * sin rounds them (the engine's answers
    # depend on these bits). Partial rotary (phi3-style) keeps the rest as it is.
    from emllm.math.rope import apply_rotary, rotate_half

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 700, 64, generator=g) * 4).to(dtype)
    ang = torch.rand(700, 32, generator=g) * 300
    cos, sin = torch.cat((ang.cos(),) * 2, -1).to(dtype), torch.cat((ang.sin(),) * 2, -1).to(dtype)
    assert torch.equal(apply_rotary(x, cos, sin), x * cos + rotate_half(x) * sin)
    part = apply_rotary(x, cos[:, :32], sin[:, :32])
    assert torch.equal(part[..., 32:], x[..., 32:])
    xr = x[..., :32]
    assert torch.equal(part[..., :32], xr * cos[:, :32] + rotate_half(xr) * sin[:, :32])


@pytest.mark.parametrize("arch", ["llama3.1", "phi3"])
def test_rotary_table_cache(arch):
    from emllm.math.rope import Rotary, signed_sin

    model = tiny_model(arch)
    emb = model.model.rotary_emb
    calls = []
    hook = emb.register_forward_hook(lambda *a: calls.append(1))
    try:
        rot = Rotary(emb)
        dev, dt = torch.device("cpu"), torch.float32
        c1, s1 = rot.table(64, dev, dt)
        n_calls = len(calls)
        c2, s2 = rot.table(64, dev, dt)
        assert len(calls) == n_calls  # served from the cache
        assert torch.equal(c1, c2) and torch.equal(s1, s2) and c1.data_ptr() == c2.data_ptr()
        # A shorter table must equal a fresh one of that length. For LongRoPE it is not a slice:
        # 20 <= 32 original positions selects the short factors, 64 the long ones.
        c3, s3 = rot.table(20, dev, dt)
        f3, g3 = Rotary(emb).table(20, dev, dt)
        assert torch.equal(c3, f3) and torch.equal(s3, g3)
        assert torch.equal(c3, c1[:20]) == (arch != "phi3")
        rot.table(20, dev, dt)
        rot.table(64, dev, dt)
        assert torch.equal(rot.table(64, dev, dt)[0], c1)
        # the signed table `rotate` takes: the same cos, the sin's first half negated, cached alike
        c4, ss4 = rot.signed_table(64, dev, dt)
        assert c4.data_ptr() == c1.data_ptr() and torch.equal(ss4, signed_sin(s1))
        h = s1.shape[1] // 2
        assert torch.equal(ss4[:, :h], -s1[:, :h]) and torch.equal(ss4[:, h:], s1[:, h:])
        # bf16 is its own entry: the float32 values divided by the bf16-rounded scale, rounded once
        cb, _ = rot.table(64, dev, torch.bfloat16)
        s_bf16 = float(emb(torch.empty(0, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.long))[0][0, 0, 0])
        raw = emb(torch.empty(0), torch.arange(64)[None])[0][0]  # float32, scaled by s
        assert cb.dtype == torch.bfloat16 and torch.equal(cb, (raw / s_bf16).to(torch.bfloat16))
        if arch != "phi3":  # no attention scaling: simply the float32 table rounded
            assert torch.equal(cb, c1.to(torch.bfloat16))
    finally:
        hook.remove()


def test_engine_survives_the_plain_model_running_in_between():
    """A baseline run on the same model object (sdpa) between two chunks changes nothing."""
    model = tiny_model("llama3.1")
    prof = tiny_profile()
    ids = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(3))
    ref = Engine(model, prof)
    ref.feed(ids[:64])
    want = ref.feed(ids[64:])
    eng = Engine(model, prof)
    eng.feed(ids[:64])
    model.set_attn_implementation("sdpa")
    model(input_ids=ids[None, :16])
    got = eng.feed(ids[64:])
    assert eng.n_events == ref.n_events > 0
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_chunks_with_memory_take_the_kernel_in_bf16_and_stay_as_close_as_in_float32(arch, monkeypatch):
    """Every layer of every bf16 chunk takes `_attend_fused` in bf16 (memory in play: 200 tokens
    through a window of 32), and the logits are about as close to the float32 engine's as those of
    the same bf16 model whose attention runs the kernel in float32: bf16's attention adds little
    to what bf16 weights cost."""
    from emllm.math import attention
    if attention._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash kernel")
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(7))
    prof, split = tiny_profile(chunk_size=8), [8] * 25
    ref = engine_logits(tiny_model(arch), prof, ids, split)
    model = tiny_model_dtype(arch, torch.bfloat16)
    calls, real = [], attention._attend_fused
    monkeypatch.setattr(attention, "_attend_fused", lambda *a: calls.append(a[0].dtype) or real(*a))
    bf16 = engine_logits(model, prof, ids, split)
    assert calls == [torch.bfloat16] * (25 * model.config.num_hidden_layers)

    def widened(*a):  # the kernel in float32, its output back in bf16
        out, mass = real(*(t if not isinstance(t, torch.Tensor) else t.float() for t in a))
        return out.to(torch.bfloat16), mass

    monkeypatch.setattr(attention, "_attend_fused", widened)
    f32_kernel = engine_logits(model, prof, ids, split)
    assert (bf16 - ref).abs().mean() <= 1.25 * (f32_kernel - ref).abs().mean()
