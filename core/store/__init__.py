"""The store: a stream's episodic memory on disk, outliving the process (docs/store-format.md).

Owns: row files (`rows`), the manifest and its validation (`manifest`), files reached only inside
the store's folder (`files`), identity of the model a store was written with (`identity`), one
layer's events on disk (`events`), the store's lifecycle: create, open, job, commit, sketch
(`store`), and marks that cut a store back (`marks`). May import: config, memory, math.
"""

from emllm.store.errors import CutBackFailed, ModelMismatchError, StoreError, StoreLockedError
from emllm.store.events import StoredEvents
from emllm.store.identity import Geometry, Identity, tokenizer_hash, weights_hash, weights_sample
from emllm.store.manifest import FORMAT_VERSION, MANIFEST, is_store, read_manifest
from emllm.store.marks import cut_back, save_mark
from emllm.store.rows import RowFile
from emllm.store.store import Store

__all__ = [
    "Store", "StoreError", "StoreLockedError", "ModelMismatchError", "CutBackFailed", "StoredEvents", "Identity", "Geometry", "RowFile",
    "FORMAT_VERSION", "MANIFEST", "is_store", "read_manifest", "save_mark", "cut_back", "weights_hash",
    "weights_sample", "tokenizer_hash",
]
