"""Shared fixtures: tiny random models of each supported architecture, and the real SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

from emllm.config import load_profile
from .helpers import TINY_PROFILE

# Every model the tests load (in process and through the CLI) computes in float32 unless a test
# asks for another dtype: auto would be bfloat16 on some machines and float32 on others, and the
# exact figures the tests compare must not depend on the machine. bfloat16 has its own tests.
os.environ["EMLLM_DTYPE"] = "float32"
# The fast tests run on SmolLM2-135M where they name no model; the default model's own tests name
# it (or clear this variable, as tests/test_default_model.py does).
os.environ["EMLLM_MODEL"] = "smollm2"

# OMP_NUM_THREADS=1 beside a benchmark: two threads on a core already busy run ~30x slower. Under
# pytest-xdist (`-n 2`) the cores are shared out among the workers, and the `emllm` processes a
# test starts inherit its worker's share.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
if _workers > 1:
    _share = max(1, (os.cpu_count() or 1) // _workers)
    os.environ["OMP_NUM_THREADS"] = str(min(_share, int(os.environ.get("OMP_NUM_THREADS", _share))))
torch.set_num_threads(max(1, min(int(os.environ.get("OMP_NUM_THREADS", 2)), os.cpu_count() or 1)))

COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, tie_word_embeddings=False,
)


def tiny_config(arch: str):
    if arch == "llama3.1":  # rope_type llama3 (Llama-3.1's scaling), original context small so it matters
        return LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if arch == "mistral":
        return MistralConfig(**COMMON, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if arch == "qwen2":
        return Qwen2Config(**COMMON, use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if arch == "phi3":  # LongRoPE with attention scaling; 32 original positions so long factors kick in
        half = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
        g = torch.Generator().manual_seed(1)
        return Phi3Config(**{**COMMON, "max_position_embeddings": 128}, pad_token_id=0, sliding_window=None,
                          original_max_position_embeddings=32, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
            "long_factor": (2 + 4 * torch.rand(half, generator=g)).tolist()})
    raise ValueError(arch)


ARCHS = ["llama3.1", "mistral", "qwen2", "phi3"]


def tiny_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    m.eval()
    return m


def tiny_model_dtype(arch: str, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch), dtype=dtype).eval()


def tiny_profile(**kw):
    base = dict(chunk_size=8, n_init=4, n_local=32, n_mem=24, min_block=2, max_block=8, repr_topk=2)
    base.update(kw)
    return load_profile("smollm2").replace(**base)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer, profile) of SmolLM2, the fast tests' model, converted once per machine."""
    from emllm import models
    src = models.resolve("smollm2")
    model, tok = models.load(src)
    return model, tok, src.profile


@pytest.fixture(scope="session")
def qwen05():
    """(model, tokenizer, profile) of the embedded Qwen2.5-Coder-0.5B-Instruct in float32."""
    from emllm import models
    src = models.resolve("qwen2.5-coder-0.5b")
    model, tok = models.load(src)
    return model, tok, src.profile


@pytest.fixture(scope="session")
def gemma270():
    """(model, tokenizer, profile) of the embedded Gemma 3 270M in float32 (sliding-window and
    global layers)."""
    from emllm import models
    src = models.resolve("gemma3-270m")
    model, tok = models.load(src)
    return model, tok, src.profile


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(model folder, profile file, second model folder, folder with another tokenizer)."""
    from emllm import models
    root = tmp_path_factory.mktemp("tiny")
    tok = AutoTokenizer.from_pretrained(models.resolve("smollm2").path)
    dirs = []
    for i, layers in enumerate((2, 3)):
        torch.manual_seed(i)
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
                          tie_word_embeddings=True)
        d = root / f"model{i}"
        AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
        tok.save_pretrained(d)
        dirs.append(d)
    other_tok = root / "other-tokenizer"
    AutoModelForCausalLM.from_pretrained(dirs[0]).save_pretrained(other_tok)
    tok2 = AutoTokenizer.from_pretrained(dirs[0])
    tok2.add_special_tokens({"additional_special_tokens": ["<|note|>"]})
    tok2.save_pretrained(other_tok)
    prof = root / "tiny.yaml"
    prof.write_text(TINY_PROFILE)
    return dirs[0], prof, dirs[1], other_tok


@pytest.fixture(scope="session")
def tuned(tiny, tmp_path_factory):
    """The first tiny model 'fine-tuned': same config, names, shapes and tokenizer, other values."""
    d = tmp_path_factory.mktemp("tuned") / "model"
    m = AutoModelForCausalLM.from_pretrained(tiny[0])
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    m.save_pretrained(d)
    AutoTokenizer.from_pretrained(tiny[0]).save_pretrained(d)
    return d
