"""When the whole stream fits in the local window, emllm must be the unpatched model (spec §1)."""

from __future__ import annotations

import pytest
import torch

from core.engine import Engine, UnsupportedModelError
from tests.conftest import ARCHS, tiny_model, tiny_profile

TOL = 1e-4


@torch.no_grad()
def vanilla_logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.set_attn_implementation("eager")
    return model(ids[None]).logits[0].float()


def engine_logits(model, profile, ids, split: list[int]) -> torch.Tensor:
    """Feed ids in pieces of the given sizes, each one forward; concatenated logits."""
    eng = Engine(model, profile)
    out, off = [], 0
    for n in split:
        out.append(eng.step(ids[off : off + n]))
        off += n
    assert off == ids.numel()
    return torch.cat(out).float()


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


@pytest.mark.parametrize("mode", ["one-shot", "chunks", "decode"])
def test_smollm2_equals_vanilla(smollm2, mode):
    model, tok, prof = smollm2
    text = "The grass is green. The sky is blue. " * 30 + "Alice hid the key under the red stone in the garden."
    ids = torch.tensor(tok(text)["input_ids"])
    n = ids.numel()
    ref = vanilla_logits(model, ids)
    split = {"one-shot": [n], "chunks": [100, 100, n - 200], "decode": [n - 24] + [1] * 24}[mode]
    got = engine_logits(model, prof.replace(chunk_size=n), ids, split)
    assert (got - ref).abs().max().item() <= TOL


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
