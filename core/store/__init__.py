"""The store: a stream's episodic memory on disk, outliving the process (docs/store-format.md).

Owns: row files (`rows`), the manifest and its validation (`manifest`), files reached only inside
the store's folder (`files`), identity of the model a store was written with (`identity`), one
layer's events on disk (`events`), the store's lifecycle: create, open, job, commit, sketch
(`store`), and marks that cut a store back (`marks`). May import: config, memory, math.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# Loaded on first use: `emllm.store.manifest` (and the CLI's listing of stores) needs no torch.
_NAMES = {
    "CutBackFailed": "errors", "ModelMismatchError": "errors", "StoreError": "errors", "StoreLockedError": "errors",
    "StoredEvents": "events", "Geometry": "identity", "Identity": "identity", "tokenizer_hash": "identity",
    "weights_hash": "identity", "weights_sample": "identity", "FORMAT_VERSION": "manifest", "MANIFEST": "manifest",
    "is_store": "manifest", "read_manifest": "manifest", "Manifest": "manifest", "read_info": "manifest", "cut_back": "marks", "save_mark": "marks",
    "RowFile": "rows", "Store": "store", "remove_store": "store", "move_store": "store", "pending_count": "manifest",
}


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'emllm.store' has no attribute {name!r}")
    value = getattr(import_module(f"emllm.store.{_NAMES[name]}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_NAMES)
