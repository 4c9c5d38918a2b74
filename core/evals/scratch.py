"""Engines whose memory lives in a throwaway store: RAM stays bounded however long the stream.

The in-RAM memory holds every event's keys and values (tens of GB at 1M tokens on the smallest
model). For one-off streams that need no persistence (a passkey trial, an evaluation sample),
`ScratchStores` gives each engine a fresh store in a temporary folder and removes it when the next
engine is made or on `close`. Same retrieval, same results as in RAM (tests/test_passkey.py).

    with ScratchStores(model, tok, profile, root) as make:
        run_emllm(make, tok, prompt)

`TrunkStores` does the same for streams that begin alike (a passkey grid: the same filler up to
each needle, whatever the key, the depth or the length): one trunk store reads the common prefix
once, in whole chunks, and each engine continues a copy of it. Chunk borders and state are those
of an engine that read the whole stream, so the results are the same, bit for bit
(tests/test_store.py); a copy costs far less than reading the tokens again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from emllm.config import Profile
from emllm.engine.stream import ChunkReport, Engine, repr_heads
from emllm.app.ingest import Progress, run_job
from emllm.app.stream import create_store, geometry_of, identity_of, open_engine, pending_tokens, profile_dict
from emllm.store import CutBackFailed, Store, StoreError, cut_back, save_mark
from emllm.store.errors import lock_store
from emllm.store.files import fsync_dir, write_atomic


class ScratchStores:
    """A factory of engines, each over a new temporary store under `root` (one alive at a time)."""

    def __init__(self, model: Any, tok: Any, profile: Profile, root: Path | str, name: str = "scratch",
                 kv_format: str | None = None) -> None:
        # Retrieval by a store's writer is an exact scan whatever its sketch (emllm.store.StoredEvents),
        # and nobody reads these stores but their writer: no sketch to fit and refit.
        self.model, self.tok, self.profile, self.name = model, tok, profile.replace(sketch_threshold=None), name
        self.kv_format = kv_format  # how the stores keep keys and values (None: the compute dtype)
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
        return folder, create_store(folder / "store", self.name, self.model, self.tok, self.profile, chat=False,
                            kv_format=self.kv_format)

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

    `engine_for(document, shared)` returns an engine that has read the document's whole chunks:
    the first `shared` tokens' whole chunks come from the trunk store, which reads them (if they
    continue what it holds; else it starts over) and commits; the engine runs on a copy of it (or,
    for the `last` engine, on the trunk itself) and reads the rest of the whole chunks as a store
    job. Calls with ever longer shared prefixes of one stream read each token of it once. Without
    the disk for a copy beside what the document adds, the engine takes the trunk with a mark
    (emllm.store.save_mark, a few MB): when it is done, its store is cut back to the trunk it was,
    and later engines continue that, nothing read twice. Without the disk for the document, it
    refuses (StoreError) before reading.

    With `keep`, the trunk and the engine's store have fixed names in root/KEPT (locked by one
    process at a time), are committed every `commit_every` chunks and stay there when the process
    ends without `close` (killed, or an exception inside `with`): a later `TrunkStores(keep=True)`
    on the same root and model carries on from their last commit, with the same chunk borders and
    state, so the same results (on the same machine and thread count: float sums are not
    reproducible across them, and nothing here checks that).
    """

    KEPT = "emllm-kept-stores"
    MARK = "trunk-mark"  # in the folder: the trunk an engine took, to cut its store back to

    def __init__(self, model: Any, tok: Any, profile: Profile, root: Path | str, name: str = "scratch",
                 log: Callable[[str], None] | None = None, keep: bool = False, commit_every: int = 64,
                 kv_format: str | None = None) -> None:
        super().__init__(model, tok, profile, root, name, kv_format)
        self.log = log or (lambda _m: None)
        self.keep = keep
        self.commit_every = commit_every if keep else 1 << 30  # a throwaway store commits once, at the end
        self._base = self.root / self.KEPT if keep else Path(tempfile.mkdtemp(prefix="emllm-grid-", dir=self.root))
        self._base.mkdir(exist_ok=True)
        # Ours alone while we live: what we find in it that we do not need was left by a dead run.
        self._lock_fd = lock_store(self._base) if keep else None
        self._trunk: Store | None = None
        self._trunk_engine: Engine | None = None
        self._trunk_ids = torch.zeros(0, dtype=torch.long)  # [k] what the trunk has read
        self.shared_tokens = 0  # tokens engines were given from the trunk without reading them (for reports)
        self.resumed_tokens = 0  # tokens engines were given from an earlier process's store (keep)

    @property
    def folder(self) -> Path:
        """Where the stores are: root/KEPT with keep (files of a caller's may lie beside them;
        they stay until `close`), else a temporary folder of its own."""
        return self._base

    @property
    def _trunk_dir(self) -> Path:
        return self._base / "trunk"

    def engine_for(self, document: list[int] | torch.Tensor, shared: int, last: bool = False,
                   progress: Callable[[ChunkReport], None] | None = None) -> tuple[Engine, int]:
        """(engine, n): the engine has read document[:n], n = the document's whole chunks."""
        self.close_engine()
        doc = torch.as_tensor(document, dtype=torch.long).flatten()
        cs = self.profile.chunk_size
        n = doc.numel() // cs * cs
        k = min(shared, n) // cs * cs
        branch = self._base / f"branch-{hashlib.sha256(doc[:n].to(torch.int32).numpy().tobytes()).hexdigest()[:16]}"
        self._settle_mark(branch)
        for old in self._base.glob("branch-*"):  # finished, or left by a killed run: the grid skips its prompt
            if old != branch:
                shutil.rmtree(old, ignore_errors=True)
        self._dir = branch
        kept = self._reopen(branch / "store", doc[:n]) if self.keep else None
        if kept is not None:
            self._store, engine = kept
            self.resumed_tokens += self._store.tokens.rows
        else:
            if self._marked_branch() == branch:  # its store was not what this run needs: the trunk is gone
                self._drop_mark()
            shutil.rmtree(branch, ignore_errors=True)
            if k > 0:
                self._grow_trunk(doc[:k])
            self._branch_from_trunk(branch, k, n, last)
            engine = open_engine(self._store, self.model)
        report = (lambda p: progress(ChunkReport(p.done, p.total, p.events))) if progress else None
        _read_to(self._store, engine, doc[:n], self.commit_every, report)
        return engine, n

    def _branch_from_trunk(self, branch: Path, k: int, n: int, last: bool) -> None:
        """The engine's store at branch/store, for a document of n tokens: a copy of the trunk,
        the trunk itself (last, or when the disk holds no copy beside what the document adds), or
        a new store (k = 0). Refuses, before the engine reads its part, a document the disk cannot
        hold (the trunk's part is read by then)."""
        trunk = _size(self._trunk_dir) if k > 0 else 0
        per_token = trunk / k if k > 0 else self._bytes_per_token()
        # Beside the rows: a mark's copy of the state and job files, and a commit's second state.
        held = self._trunk_dir / "store"
        spare = 2 * sum(f.stat().st_size for f in [*held.glob("state-*"), *held.glob("job-*")]) if k > 0 else 0
        free, grow = shutil.disk_usage(self.root).free, int((n - k) * per_token) + spare
        if free < grow:
            raise StoreError(f"not enough free disk under {self.root} for a store of {n} tokens: "
                             f"~{_gib(grow)} GiB more needed, {_gib(free)} GiB free")
        mark = k > 0 and not last and free < trunk + grow
        if mark:
            self.log(f"not enough free disk under {self.root} to copy the shared prefix ({_gib(trunk)} GiB) beside what "
                     f"this prompt adds ({_gib(grow)} GiB): it takes the trunk, cut back to the prefix afterwards")
        if k > 0 and (last or mark):
            self._close_trunk(remove=False)
            if mark:
                save_mark(self._trunk_dir / "store", self._base / self.MARK)
                write_atomic(self._base / self.MARK / "branch", branch.name.encode())  # whose store holds the trunk
            self._trunk_dir.rename(branch)
            fsync_dir(self._base)
        elif k > 0:
            tmp = branch.with_name(branch.name + ".tmp")  # a copy cut short is never taken for a branch
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(self._trunk_dir / "store", tmp / "store")
            tmp.rename(branch)
        else:
            branch.mkdir(parents=True)
            self._store = create_store(branch / "store", self.name, self.model, self.tok, self.profile, chat=False,
                            kv_format=self.kv_format)
            return
        self.shared_tokens += k
        self._store = Store.open(branch / "store", writable=True)

    def close_engine(self) -> None:
        """Remove the current engine's store; or, if it took the trunk with a mark, cut it back to
        the trunk and carry the trunk on with it."""
        if self._dir is None or self._marked_branch() != self._dir:
            return super().close_engine()
        if self._store is not None:
            self._store.close()
            self._store = None
        branch, self._dir = self._dir, None
        if not self._cut_back(branch):
            self._drop_mark()
            shutil.rmtree(branch, ignore_errors=True)
            return
        self._trunk = Store.open(self._trunk_dir / "store", writable=True)  # drops the engine's rows
        self._trunk_engine = open_engine(self._trunk, self.model)
        self._trunk_ids = self._trunk.tokens.read().long()  # [k] the mark's job is complete: nothing pending

    def _marked_branch(self) -> Path | None:
        """The folder of the engine that took the trunk with a mark, if a mark is saved."""
        name = self._base / self.MARK / "branch"
        return self._base / name.read_text() if name.is_file() else None

    def _settle_mark(self, branch: Path) -> None:
        """Finish what a killed process left of a mark: the engine at `branch` carries on with it;
        another engine's store, if there, is cut back to the trunk (reopened, and checked, by
        _grow_trunk); else the mark is stale."""
        shutil.rmtree(self._base / (self.MARK + ".tmp"), ignore_errors=True)
        marked = self._marked_branch()
        if marked is None:
            self._drop_mark()  # cut short before it named its branch
            return
        if marked == branch and marked.is_dir():
            return
        if marked.is_dir() and not self._trunk_dir.exists() and self._cut_back(marked):
            return
        self._drop_mark()

    def _cut_back(self, branch: Path) -> bool:
        """The store at branch, cut back to the mark and renamed the trunk; the mark is removed.
        False (logged) if the mark or the store is damaged: the trunk is to be read again. A failed
        write (a full disk) raises CutBackFailed and leaves all for a later run to finish."""
        try:
            cut_back(branch / "store", self._base / self.MARK)
        except CutBackFailed:
            raise
        except (StoreError, OSError) as e:
            self.log(f"{branch}: {e}; its trunk is read again")
            return False
        try:
            branch.rename(self._trunk_dir)
            fsync_dir(self._base)
        except OSError as e:
            raise CutBackFailed(f"cannot rename {branch} to {self._trunk_dir}: {e.strerror or e}; run again") from None
        self._drop_mark()
        return True

    def _drop_mark(self) -> None:
        """Remove the mark at once (renamed first: a removal cut short leaves no half mark)."""
        mark, gone = self._base / self.MARK, self._base / (self.MARK + ".tmp")
        if mark.exists():
            shutil.rmtree(gone, ignore_errors=True)
            mark.rename(gone)
        shutil.rmtree(gone, ignore_errors=True)

    def _bytes_per_token(self) -> float:
        """A store's bytes per token, over-estimated: keys and values, and a representative key
        per event of the shortest size."""
        from emllm.memory.quant import kv_format

        g = geometry_of(self.model)
        fmt = kv_format(self.kv_format or g.dtype, g.head_dim)
        reprs = fmt.reprs.row_bytes(repr_heads(self.profile, g.kv_heads, g.q_heads), g.head_dim) / self.profile.min_block
        return g.layers * (2 * fmt.row_bytes(g.kv_heads, g.head_dim) + reprs) + 16

    def _reopen(self, path: Path, ids: torch.Tensor) -> tuple[Store, Engine] | None:
        """The store at path, writable, and its engine, if an earlier process left one that this
        model and profile wrote and that has read (or queued) a prefix of ids [n]; else None."""
        if not path.exists():
            return None
        try:
            store = Store.open(path, writable=True)
        except StoreError as e:
            self.log(f"{path}: {e}; starting it again")
            return None
        try:
            info = store.info
            store.check_identity(identity_of(self.name, self.model, self.tok))
            held = torch.cat((store.tokens.read().long(), torch.tensor(pending_tokens(store), dtype=torch.long)))
            if (info.model == self.name and info.geometry == geometry_of(self.model)
                    and info.profile_keys == json.loads(json.dumps(profile_dict(self.profile)))
                    and store.kv_format.name in (self.kv_format, None if self.kv_format else store.geometry.dtype)
                    and held.numel() <= ids.numel() and held.numel() % self.profile.chunk_size == 0
                    and torch.equal(held, ids[: held.numel()])):
                return store, open_engine(store, self.model)
            self.log(f"{path}: not what this run needs (another model, profile or text); starting it again")
        except StoreError as e:
            self.log(f"{path}: {e}; starting it again")
        except BaseException:
            store.close()
            raise
        store.close()
        return None

    def _grow_trunk(self, prefix: torch.Tensor) -> None:
        """Make the trunk hold prefix [k] (k whole chunks), reading only what it lacks."""
        if self._trunk is None and self.keep and (kept := self._reopen(self._trunk_dir / "store", prefix)):
            self._trunk, self._trunk_engine = kept  # holds (or has queued) a prefix of it: checked
            self._trunk_ids = prefix[: self._trunk.tokens.rows + len(pending_tokens(self._trunk))]
            self.resumed_tokens += self._trunk.tokens.rows
        have = self._trunk_ids.numel()
        if self._trunk is None or have > prefix.numel() or not torch.equal(prefix[:have], self._trunk_ids):
            self._new_trunk()
        _read_to(self._trunk, self._trunk_engine, prefix, self.commit_every)
        self._trunk_ids = prefix.clone()

    def _new_trunk(self) -> None:
        self._close_trunk()
        self._trunk_dir.mkdir(parents=True)
        self._trunk = create_store(self._trunk_dir / "store", self.name, self.model, self.tok, self.profile, chat=False,
                            kv_format=self.kv_format)
        self._trunk_engine = open_engine(self._trunk, self.model)
        self._trunk_ids = torch.zeros(0, dtype=torch.long)

    def _close_trunk(self, remove: bool = True) -> None:
        if self._trunk is not None:
            self._trunk.close()
            self._trunk = self._trunk_engine = None
        self._trunk_ids = torch.zeros(0, dtype=torch.long)
        if remove:
            shutil.rmtree(self._trunk_dir, ignore_errors=True)

    def release(self) -> None:
        """Close every store and leave them on disk, for a later process to carry on (keep)."""
        if self._store is not None:
            self._store.close()
            self._store, self._dir = None, None
        self._close_trunk(remove=False)
        self._unlock()

    def close(self) -> None:
        """Close and remove every store made here (with keep: any left by earlier processes too)."""
        self._drop_mark()  # nothing to cut back: all goes
        self.close_engine()
        self._close_trunk()
        shutil.rmtree(self._base, ignore_errors=True)
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self.keep and exc_type is not None:
            self.release()
        else:
            self.close()


def _read_to(store: Store, engine: Engine, ids: torch.Tensor, commit_every: int,
             progress: Callable[[Progress], None] | None = None) -> None:
    """Make the store hold ids [n] (whole chunks; it holds or has queued a prefix of them): finish
    the job a killed run left, then read the rest as a job of its own."""
    if not store.info.complete:
        run_job(store, engine, commit_every=commit_every, progress=progress)
    if (done := store.tokens.rows) < ids.numel():
        store.set_job(ids[done:].to(torch.int32), [])
        run_job(store, engine, commit_every=commit_every, progress=progress)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f}"


__all__ = ["ScratchStores", "TrunkStores"]
