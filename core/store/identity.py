"""What a store was written with: the model's identity (config, weights, tokenizer) and geometry."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


# -- identity -------------------------------------------------------------------------------------
def weights_hash(model: torch.nn.Module) -> str:
    """Hash of the weights' metadata (names, shapes, dtypes): cheap, and catches another checkpoint
    of a different shape; two fine-tunes of one shape differ in config or name instead."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


_SAMPLED = 64  # values per tensor in weights_sample


def weights_sample(model: torch.nn.Module) -> str:
    """Hash of 64 evenly spaced values of every weight: catches a fine-tune of the same shape (its
    config, names and shapes are the base model's) for the cost of a few thousand reads. "" when
    some weights are not in memory (offloaded by accelerate to `meta`): nothing to compare then."""
    import torch

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        if t.is_meta:
            return ""
        flat = t.detach().reshape(-1)  # [n]
        n, k = flat.numel(), min(_SAMPLED, flat.numel())
        idx = torch.arange(k, device=flat.device) * max(n - 1, 0) // max(k - 1, 1)  # [k] exact in int64
        h.update(name.encode())
        h.update(flat[idx].to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()[:16]


def tokenizer_hash(tok: Any) -> str:
    """Hash of the tokenizer's full definition (vocabulary, merges, normaliser, special tokens)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps(sorted(tok.get_vocab().items()))
    text += json.dumps(sorted((str(k), str(v)) for k, v in tok.special_tokens_map.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Identity:
    """What a store was written with; all of it must match to continue or read it."""

    model: str  # how the user named it (alias, folder or hub id)
    config_hash: str
    weights_hash: str
    tokenizer_hash: str
    weights_sample: str = ""  # "" for stores older than it, or weights offloaded: not compared

    def as_dict(self) -> dict[str, str]:
        return dict(self.__dict__)

    def difference(self, stored: dict[str, str]) -> str | None:
        """What differs from the identity a store recorded (`stored`, its manifest's), checked in
        order: config, weight names and shapes, sampled weight values (only when both sides have
        a sample: a store older than it, or weights offloaded to meta, leave it to the metadata
        hash), tokenizer; None where nothing does."""
        for key in ("config_hash", "weights_hash", "weights_sample", "tokenizer_hash"):
            mine, theirs = getattr(self, key), stored.get(key, "")
            if mine != theirs and (key != "weights_sample" or (mine and theirs)):
                return key
        return None


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    vocab: int
    dtype: str  # of keys, values, representative keys (the model's)
    # the layers that hold memory, increasing, where not all do (a model that mixes sliding-window
    # and global layers: only the global ones; version 9); None: every layer
    memory_layers: tuple[int, ...] | None = None

    @property
    def with_memory(self) -> tuple[int, ...]:
        """The indices of the layers with memory: a store keeps files for these only."""
        return tuple(range(self.layers)) if self.memory_layers is None else self.memory_layers

    @classmethod
    def of(cls, d: dict) -> "Geometry":
        """From a manifest's (validated) geometry."""
        ml = d.get("memory_layers")
        return cls(**{**d, "memory_layers": None if ml is None else tuple(ml)})

    def as_dict(self) -> dict:
        """As the manifest records it (memory_layers only where not every layer holds memory)."""
        d = dict(self.__dict__)
        if d["memory_layers"] is None:
            del d["memory_layers"]
        else:
            d["memory_layers"] = list(d["memory_layers"])
        return d
