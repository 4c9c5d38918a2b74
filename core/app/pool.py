"""Models loaded once and shared by the stores opened through them, a bounded number at a time (a
server's): a store whose model is not loaded loads it, in the store's dtype, after unloading the
model used least recently and closing the stores opened with it (ollama's way).

    pool = ModelPool(max_loaded=1)
    pool.add(emllm.load("qwen2.5-coder-0.5b"))   # optional: a model loaded ahead of its stores
    mem = pool.memory(path)                       # the store with its model, held between calls
"""

from __future__ import annotations

import gc
import resource
from pathlib import Path
from typing import Callable

from emllm import models
from emllm.app.api import Memory, Model, load, open as open_memory
from emllm.errors import TooManyOpenFiles, UsageError
from emllm.store import read_info
from emllm.store.files import descriptors_in_use
from emllm.store.manifest import Manifest


class ModelPool:
    """At most `max_loaded` models in memory, and `max_stores` stores held open through `memory`
    (each keeps its stream's tail read, its window's keys and values, and a few open files a
    layer), the least recently used closed first; a store is also closed when its model is
    unloaded or it changes model."""

    def __init__(self, max_loaded: int = 1, log: Callable[[str], None] | None = None, max_stores: int = 4) -> None:
        if max_loaded < 1:
            raise UsageError(f"at least one model must stay loaded (max_loaded={max_loaded})")
        if max_stores < 1:
            raise UsageError(f"at least one store must stay open (max_stores={max_stores})")
        self.max_loaded, self.max_stores, self._log = max_loaded, max_stores, log
        self._models: list[Model] = []  # least recently used first
        self._held: dict[Path, tuple[Memory, tuple]] = {}  # a store's Memory, and what it was opened for; least recently used first

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
        until it is closed (its model unloaded, or `max_stores` others used since). Raises the errors of `emllm.open` (StoreError,
        ModelNotFoundError, ModelMismatchError, ...)."""
        path = Path(path)
        try:
            mem = self._memory(path)
        except TooManyOpenFiles:  # (the other stores' files make room: one more try, then the error)
            if not self._held:
                raise
            for p in list(self._held):
                self._release(p)
            mem = self._memory(path)
        # Files left for the server's sockets and the next store: past half the process's limit,
        # the stores used least recently are closed.
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        while len(self._held) > 1 and (n := descriptors_in_use()) is not None and n > soft // 2:
            self._release(next(iter(self._held)))
        return mem

    def _memory(self, path: Path) -> Memory:
        info = read_info(path)
        wanted = (info.identity, info.geometry.dtype, info.created)
        held = self._held.pop(path, None)
        if held is not None:
            mem, was = held
            if was == wanted:
                self._held[path] = held  # (now the most recently used)
                self._touch(mem.loaded)
                return mem
            mem.close()  # (a store removed and made again under the name, by another model)
        model = self._loaded_for(info)
        if model is None:
            model = self._load(info, path)
        self._touch(model)
        while len(self._held) >= self.max_stores:
            self._release(next(iter(self._held)))
        mem = open_memory(path, model=model)
        self._held[path] = (mem, wanted)
        return mem

    @property
    def stores(self) -> list[Path]:
        """The stores held open, the most recently used last."""
        return list(self._held)

    def _release(self, path: Path) -> None:
        self._held.pop(path)[0].close()

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
                self._release(p)
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
