"""emllm: episodic memory for Hugging Face causal language models (EM-LLM), kept on disk.

The public surface, loaded on first use (so `import emllm` and the CLI's --help stay light):

    emllm.create(path, model=...)  -> Memory    a new store with its model
    emllm.open(path)               -> Memory    a store with the model it was written with
    Memory.ingest(...) / .ask(...) / .retrieval(...) / .summary()
    emllm.Engine                                the in-RAM engine over a model (no store)
    emllm.Store, emllm.StoreError               the store itself
    emllm.load_profile, emllm.resolve_model, emllm.load_model

Layers (each subpackage's docstring says what it owns and may import; tests/test_layers.py
holds the table): math -> memory -> engine; store (over memory); app (use cases over engine and
store); evals (passkey grid, RULER-style tasks, retrieval baseline) outside the engine's graph.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_SURFACE = {
    "create": "emllm.app.api", "open": "emllm.app.api", "Memory": "emllm.app.api",
    "Engine": "emllm.engine.stream", "Store": "emllm.store", "StoreError": "emllm.store",
    "load_profile": "emllm.config", "Profile": "emllm.config",
    "resolve_model": ("emllm.models", "resolve"), "load_model": ("emllm.models", "load"),
}


def __getattr__(name: str) -> Any:
    where = _SURFACE.get(name)
    if where is None:
        raise AttributeError(f"module 'emllm' has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_SURFACE])


__all__ = sorted(_SURFACE)
