"""Engines whose memory lives in a throwaway store: RAM stays bounded however long the stream.

The in-RAM memory holds every event's keys and values (46 kB per token on SmolLM2: 46 GB at 1M
tokens). For one-off streams that need no persistence (a passkey trial, an evaluation sample),
`ScratchStores` gives each engine a fresh store in a temporary folder and removes it when the next
engine is made or on `close`. Same retrieval, same results as in RAM (tests/test_passkey.py).

    with ScratchStores(model, tok, profile, root) as make:
        run_emllm(make, tok, prompt)
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from .config import Profile
from .engine import Engine
from .ingest import create_store
from .store import Store, StoredEvents


class ScratchStores:
    """A factory of engines, each over a new temporary store under `root` (one alive at a time)."""

    def __init__(self, model: Any, tok: Any, profile: Profile, root: Path | str, name: str = "scratch") -> None:
        self.model, self.tok, self.profile, self.name = model, tok, profile, name
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._store: Store | None = None
        self._dir: Path | None = None

    def __call__(self) -> Engine:
        self.close()
        self._dir = Path(tempfile.mkdtemp(prefix="emllm-scratch-", dir=self.root))
        self._store = create_store(self._dir / "store", self.name, self.model, self.tok, self.profile, chat=False)
        store = self._store
        return Engine(self.model, self.profile, memory=lambda i: StoredEvents(store, i))

    def close(self) -> None:
        """Remove the current store (its engine must not be used after)."""
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "ScratchStores":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ScratchStores"]
