"""Engines whose memory lives in a throwaway store: RAM stays bounded however long the stream.

The in-RAM memory holds every event's keys and values (46 kB per token on SmolLM2: 46 GB at 1M
tokens). For one-off streams that need no persistence (a passkey trial, an evaluation sample),
`ScratchStores` gives each engine a fresh store in a temporary folder and removes it when the next
engine is made or on `close`. Same retrieval, same results as in RAM (tests/test_passkey.py).

    with ScratchStores(model, tok, profile, root) as make:
        run_emllm(make, tok, prompt)

`TrunkStores` does the same for streams that begin alike (a passkey grid: the same filler up to
each needle, whatever the key, the depth or the length): one trunk store reads the common prefix
once, in whole chunks, and each engine continues a copy of it. Chunk borders and state are those
of an engine that read the whole stream, so the results are the same, bit for bit
(tests/test_store.py); a copy costs ~0.1 ms per token against ~10 ms to read one again.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from .config import Profile
from .engine import Engine
from .ingest import create_store, open_engine, run_job
from .store import Store


class ScratchStores:
    """A factory of engines, each over a new temporary store under `root` (one alive at a time)."""

    def __init__(self, model: Any, tok: Any, profile: Profile, root: Path | str, name: str = "scratch") -> None:
        self.model, self.tok, self.profile, self.name = model, tok, profile, name
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._store: Store | None = None
        self._dir: Path | None = None

    def __call__(self) -> Engine:
        self.close_engine()
        self._dir, self._store = self._new_store("scratch")
        return open_engine(self._store, self.model)

    def _new_store(self, kind: str) -> tuple[Path, Store]:
        """A new empty store in a new folder under root: (folder, store at folder/store)."""
        folder = Path(tempfile.mkdtemp(prefix=f"emllm-{kind}-", dir=self.root))
        return folder, create_store(folder / "store", self.name, self.model, self.tok, self.profile, chat=False)

    def close_engine(self) -> None:
        """Remove the current engine's store (the engine must not be used after)."""
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def close(self) -> None:
        self.close_engine()

    def __enter__(self) -> "ScratchStores":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TrunkStores(ScratchStores):
    """Scratch engines that skip a prefix they share with the ones before (one alive at a time).

    `engine_after(prefix)` returns an engine that has read prefix[:k] and k: the trunk store
    reads the prefix up to its last whole chunk (if it began with what the trunk holds; else the
    trunk starts over), commits, and the engine runs on a copy of it. Calls with ever longer
    prefixes of one stream read each token of it once. Without the disk for a copy, the engine
    reads the prefix itself (k = 0).
    """

    def __init__(self, model: Any, tok: Any, profile: Profile, root: Path | str, name: str = "scratch",
                 log: Callable[[str], None] | None = None) -> None:
        super().__init__(model, tok, profile, root, name)
        self.log = log or (lambda _m: None)
        self._trunk_dir: Path | None = None
        self._trunk: Store | None = None
        self._trunk_engine: Engine | None = None
        self._trunk_ids = torch.zeros(0, dtype=torch.long)  # [k] what the trunk has read
        self.shared_tokens = 0  # tokens engines were given without reading them (for reports)

    def engine_after(self, prefix: list[int] | torch.Tensor) -> tuple[Engine, int]:
        self.close_engine()
        prefix = torch.as_tensor(prefix, dtype=torch.long).flatten()
        cs = self.profile.chunk_size
        k = prefix.numel() // cs * cs
        if k == 0:
            return self(), 0
        have = self._trunk_ids.numel()
        if self._trunk is None or have > k or not torch.equal(prefix[:have], self._trunk_ids):
            self._new_trunk()
            have = 0
        if k > have:
            self._trunk.set_job(prefix[have:k].to(torch.int32), [])
            run_job(self._trunk, self._trunk_engine, commit_every=1 << 30)  # one commit, at k
            self._trunk_ids = prefix[:k].clone()
        need = sum(f.stat().st_size for f in self._trunk_dir.rglob("*") if f.is_file())
        if shutil.disk_usage(self.root).free < 2 * need:  # the copy and what the engine adds to it
            self.log(f"not enough free disk under {self.root} to copy the shared prefix ({need >> 20} MiB): reading it again")
            return self(), 0
        self._dir = Path(tempfile.mkdtemp(prefix="emllm-branch-", dir=self.root))
        shutil.copytree(self._trunk_dir, self._dir / "store")
        self._store = Store.open(self._dir / "store", writable=True)
        self.shared_tokens += k
        return open_engine(self._store, self.model), k

    def _new_trunk(self) -> None:
        self._close_trunk()
        folder, self._trunk = self._new_store("trunk")
        self._trunk_dir = folder / "store"
        self._trunk_engine = open_engine(self._trunk, self.model)
        self._trunk_ids = torch.zeros(0, dtype=torch.long)

    def _close_trunk(self) -> None:
        if self._trunk is not None:
            self._trunk.close()
            self._trunk = self._trunk_engine = None
        if self._trunk_dir is not None:
            shutil.rmtree(self._trunk_dir.parent, ignore_errors=True)
            self._trunk_dir = None

    def close(self) -> None:
        self.close_engine()
        self._close_trunk()


__all__ = ["ScratchStores", "TrunkStores"]
