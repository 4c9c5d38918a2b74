"""emllm: episodic memory for Hugging Face causal language models (EM-LLM), kept on disk.

The public surface (`emllm.__all__`), loaded on first use so `import emllm` and the CLI's --help
stay light; the CLI and the server use nothing else (tests/test_layers.py holds them to it):

    emllm.create(path, model=...) -> Memory     a new store with its model
    emllm.open(path)              -> Memory     a store with the model it was written with
    emllm.load(model)             -> Model      a model loaded once, for several stores
    emllm.ModelPool(max_loaded)                 stores opened with their own models, a few loaded at a time
    Memory.ingest / .resume / .answer / .ask / .reply / .complete / .remember / .conversation / .retrieval / .summary
    emllm.plan_ingest                           the rules of `emllm ingest` (create, append, resume)
    emllm.open_documents                        files, stdin and folders (a code base) as documents to ingest
    emllm.segment                               a text's event boundaries
    emllm.logprob_texts                         log probabilities' token texts, each read after the token before
    emllm.store_path, list_stores, store_summary, verify_store, remove_store, move_store: the stores
    emllm.EmllmError                            the base of every error a user can fix
    emllm.Engine                                the in-RAM engine over a model (no store)

Layers (each subpackage's docstring says what it owns and may import; tests/test_layers.py
holds the table): math -> memory -> engine; store (over memory); app (use cases over engine and
store); evals (passkey grid, RULER-style tasks, retrieval baseline) outside the engine's graph.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_API = "emllm.app.api"
_STORES = "emllm.app.stores"
_SURFACE = {
    # a store with its model
    "create": _API, "open": _API, "load": _API, "Memory": _API, "Model": _API, "Answer": _API,
    "ModelPool": "emllm.app.pool", "IngestPlan": _API, "IngestReport": _API, "plan_ingest": _API, "unchanged_files": _API, "segment": _API, "sampling": _API,
    "REREAD_QUESTIONS": _API, "REREAD_CONVERSATION": _API,
    "Progress": "emllm.app.ingest", "DiskSpaceError": "emllm.app.ingest",
    "logprob_texts": "emllm.app.stream",
    "TextSource": "emllm.app.textinput", "InputError": "emllm.app.textinput", "file_sha256": "emllm.app.textinput",
    "open_documents": "emllm.app.folders", "folder_files": "emllm.app.folders",
    # the stores under the home
    "store_path": _STORES, "is_store": _STORES, "list_stores": _STORES, "folder_bytes": _STORES,
    "store_summary": (_STORES, "summary"), "verify_store": _STORES, "remove_store": _STORES, "move_store": _STORES,
    "stores_dir": "emllm.home", "store_name_for": "emllm.home",
    # errors a user can cause
    "EmllmError": "emllm.errors", "UsageError": "emllm.errors", "StoreError": "emllm.store",
    "StoreLockedError": "emllm.store", "ModelMismatchError": "emllm.store", "ProfileError": "emllm.config",
    "ProfileMismatchError": "emllm.config", "ModelNotFoundError": "emllm.models", "TooManyOpenFiles": "emllm.errors",
    "Cancelled": "emllm.errors",
    # below the front door: the engine without a store, the store itself, models and profiles
    "Engine": "emllm.engine.stream", "Store": "emllm.store", "Sampling": "emllm.engine.sampling",
    "SEED_LIMIT": "emllm.engine.sampling",
    "load_profile": "emllm.config", "Profile": "emllm.config", "default_model": "emllm.models",
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
