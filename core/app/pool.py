"""Models loaded once and shared by the stores opened through them, a bounded number at a time (a
server's): a store whose model is not loaded loads it, in the store's dtype, after unloading the
model used least recently and closing the stores opened with it (ollama's way).

    pool = ModelPool(max_loaded=1)
    pool.add(emllm.load("qwen2.5-coder-0.5b"))   # optional: a model loaded ahead of its stores
    mem = pool.memory(path)                       # the store with its model, held between calls
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Callable

from emllm import models
from emllm.app.api import Memory, Model, load, open as open_memory
from emllm.errors import UsageError
from emllm.store import read_info
from emllm.store.manifest import Manifest


class ModelPool:
    """At most `max_loaded` models in memory; the stores opened through `memory` are held (each
    keeps its stream's tail read) until their model is unloaded or the store changes model."""

    def __init__(self, max_loaded: int = 1, log: Callable[[str], None] | None = None) -> None:
        if max_loaded < 1:
            raise UsageError(f"at least one model must stay loaded (max_loaded={max_loaded})")
        self.max_loaded, self._log = max_loaded, log
        self._models: list[Model] = []  # least recently used first
        self._held: dict[Path, tuple[Memory, tuple]] = {}  # a store's Memory, and what it was opened for

    @property
    def models(self) -> list[Model]:
        """The models loaded, the most recently used last."""
        return list(self._models)

    def add(self, model: Model) -> None:
        """A model loaded by the caller (`emllm.load`), as if used now; it may unload another."""
        if any(m is model for m in self._models):
            self._touch(model)
            return
        self._make_room(1)
        self._models.append(model)

    def memory(self, path: str | Path) -> Memory:
        """The store at `path`, opened with its model (a loaded one of the same weights,
        tokenizer and dtype, else its own, loaded) and held: the same `Memory` for the same store
        until its model is unloaded. Raises the errors of `emllm.open` (StoreError,
        ModelNotFoundError, ModelMismatchError, ...)."""
        path = Path(path)
        info = read_info(path)
        wanted = (info.identity, info.geometry.dtype, info.created)
        held = self._held.get(path)
        if held is not None:
            mem, was = held
            if was == wanted:
                self._touch(mem.loaded)
                return mem
            del self._held[path]  # (a store removed and made again under the name, by another model)
            mem.close()
        model = self._loaded_for(info)
        if model is None:
            model = self._load(info, path)
        self._touch(model)
        mem = open_memory(path, model=model)
        self._held[path] = (mem, wanted)
        return mem

    def close(self) -> None:
        """Close every store held and unload every model."""
        for mem, _ in self._held.values():
            mem.close()
        self._held.clear()
        self._models.clear()
        gc.collect()

    # -- the models ------------------------------------------------------------------------------
    def _loaded_for(self, info: Manifest) -> Model | None:
        """A loaded model that computes as the store did: its identity (config, weights, tokenizer)
        and dtype, whatever name it was loaded by (a folder since moved, an alias)."""
        for m in reversed(self._models):
            if m.dtype == info.geometry.dtype and m.identity().difference(info.identity) is None:
                return m
        return None

    def _load(self, info: Manifest, path: Path) -> Model:
        models.resolve(info.model)  # (a model not installed is refused before another is unloaded for it)
        self._make_room(1)
        if self._log is not None:
            self._log(f"loading {info.model} for store {path.name!r}")
        model = load(info.model, dtype=info.geometry.dtype, log=self._log)
        self._models.append(model)
        return model

    def _make_room(self, n: int) -> None:
        while self._models and len(self._models) + n > self.max_loaded:
            gone = self._models.pop(0)
            for p in [p for p, (mem, _) in self._held.items() if mem.loaded is gone]:
                self._held.pop(p)[0].close()
            if self._log is not None:
                self._log(f"unloading {gone.given or gone.name}")
            del gone
            gc.collect()  # (the weights are freed now, before the next model's are read)

    def _touch(self, model: Model) -> None:
        for i, m in enumerate(self._models):
            if m is model:
                self._models.append(self._models.pop(i))
                return


__all__ = ["ModelPool"]
