"""The on-disk store: the episodic memory of a stream, outliving the process (spec §5, design.md).

A store is a folder:

    manifest.json            what is committed: version, identity, profile, geometry, row counts
    tokens.i32 surprise.f32 flags.u8          one row per processed token of the stream
    events.i32                                one row per event: its length in tokens
    layers/NN.k layers/NN.v                   per layer, one row [H_kv, D] per event token (pre-RoPE)
    layers/NN.r                               per layer, one row [H_q, D] per event (representative key)
    sketch{-F}.safetensors   per layer, the basis of the sketches (once the store has faiss_threshold events;
                             F: the events it was fitted on, refitted as the store doubles)
    layers/NN{.F}.p layers/NN{.F}.n           per layer, each event's sketch [dims] and its norms [3]
    job-G.i32                the tokens of the current ingest job (so --resume needs no input)
    state-G.safetensors      what continues the stream: windows, remainder, masses, last logits
    lock                     held (flock) by the one writer

Arrays are raw little-endian rows, append-only. A commit writes data first, fsyncs it, writes the
new state file, then replaces the manifest atomically (temporary file, fsync, rename, fsync of
the folder). Rows past the manifest's counts are an uncommitted tail: readers ignore it, a writer
truncates it on open. So a crash at any moment, `kill -9` included, leaves the last commit
readable. The manifest carries a checksum of its own content: an edited manifest is refused.
No pickles: JSON, raw arrays and safetensors only. Format: docs/store-format.md.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import json
import mmap
import re
import os
import shutil
import stat
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from .config import Profile
from .kvcache import EventCache
from .memory import GrowBuffer, Selection, scores_in_blocks, select_events, token_index
from . import sketch
from .safefs import Folder, UnsafePath, check_name

# 2 added the sketch, 3 replaced its outlier lists by per-event norms (exact bounds), 4 refits it
# as the store doubles (files named by the events it was fitted on). Older stores are read (scanned:
# a version-2 sketch is not used); a version-3 sketch is a version-4 one fitted once.
FORMAT_VERSION = 4
MANIFEST = "manifest.json"
READ_GAP = 4 << 10  # bytes: scattered rows closer than this are read in one call
_BLOCKS: dict[tuple[torch.dtype, tuple[int, ...]], Tensor] = {}  # read_block's buffers, one per row shape

# torch dtype <-> (name, numpy dtype of the raw bytes). bfloat16 has no numpy type: stored as u2.
_DTYPES = {
    torch.float32: ("float32", np.dtype("<f4")),
    torch.float16: ("float16", np.dtype("<f2")),
    torch.bfloat16: ("bfloat16", np.dtype("<u2")),
    torch.int32: ("int32", np.dtype("<i4")),
    torch.uint8: ("uint8", np.dtype("u1")),
}
_BY_NAME = {name: (t, n) for t, (name, n) in _DTYPES.items()}


class StoreError(Exception):
    """A store that cannot be used as asked; the message says what is wrong and what to do."""


class CutBackFailed(StoreError):
    """A cut back whose writes failed (a full disk): the store and its mark stay, for a later cut."""


class StoreLockedError(StoreError):
    pass


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


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    vocab: int
    dtype: str  # of keys, values, representative keys (the model's)


# -- raw arrays -----------------------------------------------------------------------------------
class RowFile:
    """An append-only file of fixed-shape rows: scattered rows read with pread (`take`), blocks
    into a reused buffer (`read_block`), whole ranges through a memory map (`read`).

    `rows` counts rows written by this process or committed before it; reads never reach past it.
    The map is refreshed lazily when a read needs rows written since it was made.
    """

    def __init__(self, folder: Folder, name: str, row: tuple[int, ...], dtype: torch.dtype, rows: int, writable: bool) -> None:
        self.folder, self.name = folder, name
        self.path, self.row, self.dtype, self.rows, self.writable = folder.path / name, tuple(row), dtype, rows, writable
        self.np_dtype = _DTYPES[dtype][1]
        self.row_bytes = int(np.prod(self.row, dtype=np.int64)) * self.np_dtype.itemsize
        self._map: np.ndarray | None = None
        self._mm: mmap.mmap | None = None
        self._fd: int | None = None
        self._rfd: int | None = None  # a reader's descriptor
        self._trimmed = False  # a writer drops the uncommitted tail at its first append, not at open
        if writable:
            try:
                self._fd = folder.open(name, os.O_RDWR | os.O_CREAT, single_link=True)
            except UnsafePath as e:
                raise StoreError(f"{e}: the store is refused (emllm writes only files that are its own)") from None
            if rows:
                self.check_size()  # never extend a truncated file with zeros

    def check_size(self) -> None:
        try:
            size = os.fstat(self._reader_fd()).st_size
        except FileNotFoundError:
            if self.rows == 0:
                return
            raise StoreError(f"{self.name} is missing from the store") from None
        if size < self.rows * self.row_bytes:
            raise StoreError(
                f"{self.name} is truncated ({size} bytes, the manifest needs "
                f"{self.rows * self.row_bytes}): the store is damaged; re-ingest the document"
            )

    def append(self, x: Tensor) -> None:
        """x [n, *row] in this file's dtype."""
        assert self._fd is not None, "read-only"
        if not self._trimmed:
            os.ftruncate(self._fd, self.rows * self.row_bytes)  # drop an uncommitted tail
            os.lseek(self._fd, 0, os.SEEK_END)
            self._trimmed = True
        data = x.detach().to("cpu", self.dtype).contiguous()
        if self.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        buf = data.numpy().tobytes()
        view = memoryview(buf)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.rows += int(x.shape[0])

    def sync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def _mapped(self, need: int) -> np.ndarray:
        if self._map is None or self._map.shape[0] < need:
            self._map = None
            if self.rows == 0:
                return np.zeros((0, *self.row), dtype=self.np_dtype)
            # mapped through the descriptor opened safely, never by path
            self._mm = mmap.mmap(self._reader_fd(), self.rows * self.row_bytes, access=mmap.ACCESS_READ)
            if hasattr(mmap, "MADV_RANDOM"):
                self._mm.madvise(mmap.MADV_RANDOM)  # faults read their page only (reads ask for the range ahead)
            self._map = np.frombuffer(self._mm, dtype=self.np_dtype).reshape(self.rows, *self.row)
        return self._map

    def _tensor(self, a: np.ndarray) -> Tensor:
        with warnings.catch_warnings():  # a read-only map: nobody writes through these tensors
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(np.ascontiguousarray(a))
        return t.view(torch.bfloat16) if self.dtype == torch.bfloat16 else t

    def take(self, idx: Tensor) -> Tensor:
        """Rows idx [n] (long, < rows) -> [n, *row], read (pread) a run of nearby rows at a time.

        The rows are sorted into runs (rows less than `READ_GAP` bytes apart share one: reading
        the gap costs less than another call); the kernel is told of every run first
        (POSIX_FADV_WILLNEED), so a cold read sends them to the disk together instead of one
        fault at a time (measured before: 4.8 s of a 7.1 s cold `ask` at 512k tokens went to
        faults), then each run is read with one pread. Nothing is mapped, so resident memory is
        the result alone however much of the store the chunks attend to, and a warm read costs
        no page faults (measured, one question at 512k tokens: 140-165 ms for all the rows it
        reads, against 190-230 ms through the map, faulting rows in and giving the pages back)."""
        if idx.numel() == 0:
            return torch.zeros((0, *self.row), dtype=self.dtype)
        rows = idx.cpu().numpy()
        inv = None
        if rows.size > 1 and not bool((rows[1:] > rows[:-1]).all()):
            rows, inv = np.unique(rows, return_inverse=True)
        cut = np.flatnonzero(np.diff(rows) > 1 + READ_GAP // self.row_bytes) + 1
        first = np.r_[0, cut]  # index in rows of each run's first row
        starts, stops = rows[first], rows[np.r_[cut - 1, rows.size - 1]] + 1
        self._willneed_runs(starts, stops)
        size = stops - starts
        at = np.cumsum(size) - size  # each run's first row in buf
        buf = torch.empty((int(size.sum()), *self.row), dtype=self.dtype)
        raw, rb, fd = memoryview(buf.view(torch.uint8).numpy().reshape(-1)), self.row_bytes, self._reader_fd()
        for a, n, o in zip((starts * rb).tolist(), (size * rb).tolist(), (at * rb).tolist()):  # one call per run
            if os.preadv(fd, [raw[o : o + n]], a) != n:  # short: only at the end of the file
                self._pread(buf[o // rb : (o + n) // rb], a // rb, (a + n) // rb)
        if inv is None and buf.shape[0] == rows.size:
            return buf  # no gaps, no repeats: the rows themselves
        pos = np.repeat(at - starts, np.diff(np.r_[first, rows.size])) + rows  # each row's place in buf
        return buf[torch.from_numpy(pos if inv is None else pos[inv])]

    def _willneed_runs(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """POSIX_FADV_WILLNEED for row ranges [starts[i], stops[i]) (a hint: skipped where the OS has none)."""
        if not hasattr(os, "posix_fadvise"):
            return
        fd = self._reader_fd()
        for a, b in zip((starts * self.row_bytes).tolist(), (stops * self.row_bytes).tolist()):  # one call per run
            os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)

    def read_block(self, start: int, stop: int) -> Tensor:
        """Rows start..stop-1 [n, *row], read (pread) into a buffer that the next call, of any
        file with rows of this shape, reuses (one per shape: fresh memory costs page faults).

        For scans: the rows are copied from the page cache, never mapped, so scanning a whole file
        at every step adds nothing to the resident memory of the process but the buffer.
        """
        n = stop - start
        key = (self.dtype, self.row)
        buf = _BLOCKS.get(key)
        if buf is None or buf.shape[0] < n:
            buf = _BLOCKS[key] = torch.empty((n, *self.row), dtype=self.dtype)
        return self._pread(buf[:n], start, stop)

    def read_copy(self, start: int, stop: int) -> Tensor:
        """Rows start..stop-1 [n, *row] in a new tensor, read (pread): nothing stays mapped."""
        return self._pread(torch.empty((stop - start, *self.row), dtype=self.dtype), start, stop)

    def _reader_fd(self) -> int:
        if self._fd is None and self._rfd is None:
            try:
                self._rfd = self.folder.open(self.name)
            except UnsafePath as e:
                raise StoreError(f"{e}: the store is refused") from None
        return self._fd if self._fd is not None else self._rfd  # type: ignore[return-value]

    def _pread(self, out: Tensor, start: int, stop: int) -> Tensor:
        fd = self._reader_fd()
        raw = memoryview(out.view(torch.uint8).numpy().reshape(-1))
        pos, end = start * self.row_bytes, stop * self.row_bytes
        while pos < end:
            got = os.preadv(fd, [raw[pos - start * self.row_bytes :]], pos)
            if got == 0:
                raise StoreError(f"{self.name} is truncated: the store is damaged; re-ingest the document")
            pos += got
        return out

    def read(self, start: int = 0, stop: int | None = None) -> Tensor:
        stop = self.rows if stop is None else stop
        if stop <= start:
            return torch.zeros((0, *self.row), dtype=self.dtype)
        m = self._mapped(stop)
        if self._map is not None:  # the map reads no further than a fault: ask for the range at once
            self._willneed_runs(np.array([start]), np.array([stop]))
        return self._tensor(m[start:stop])

    def close(self) -> None:
        self._map = None
        self._mm = None  # closed when the last array over it goes
        for fd in (self._fd, self._rfd):
            if fd is not None:
                os.close(fd)
        self._fd = self._rfd = None


# -- the event memory of one layer, backed by the store --------------------------------------------
class StoredEvents:
    """`EventMemory` for one layer whose keys, values and representative keys live in the store's files.

    Nothing that grows with the store stays resident but the event sizes (16 bytes per event):
    - retrieval scores every event's representative key exactly at every step, reading
      `layers/NN.r` a block at a time into one reused buffer (pread, from the page cache once
      warm), so neither a writer nor a reader holds the keys, whatever the store's size; a reader
      of a store with a sketch scans the sketches instead and scores exactly only the events
      that can be selected (the same selection);
    - keys and values are read per step for the retrieved events only: from an `EventCache` of
      the events read last (fixed size: the profile's `kv_cache_mb`, or `--kv-cache-mb`), else
      from the files (`RowFile.take`: pread, nothing mapped).
    A read-only store (asking) keeps events closed after opening in RAM instead, so asking never
    changes the files. No faiss graph over a store: it would need RAM and upkeep per event.
    """

    def __init__(self, store: "Store", layer: int, kv_cache_mb: int | None = None) -> None:
        """kv_cache_mb: RAM of the event cache, all layers together (None: the store's profile's)."""
        self.store, self.layer = store, layer
        g = store.geometry
        dt = _BY_NAME[g.dtype][0]
        self.dim = g.q_heads * g.head_dim
        self.k, self.v, self.r = store.layer_files[layer]
        # A reader of a store that has a sketch scores the sketches, then exactly only the events
        # that can be selected (core/sketch.py); a writer always scans (its selections are part of the bytes
        # it writes, so they must not depend on when the sketch was fitted).
        self.sketch: tuple[RowFile, RowFile, Tensor, Tensor] | None = None  # coords, norms, mean, basis
        if store.sketch_files is not None and not store.writable:
            p, nrm = store.sketch_files[layer]
            self.sketch = (p, nrm, *store.sketch_basis(layer))
        self.lengths = GrowBuffer((0,), 0, torch.long, torch.device("cpu"))
        self.starts = GrowBuffer((0,), 0, torch.long, torch.device("cpu"))
        lengths = store.events.read().long()
        if lengths.numel():
            self.lengths.append(lengths)
            self.starts.append(torch.cumsum(lengths, 0) - lengths)
        self.n_disk = int(lengths.sum())  # event tokens in the files
        self.ram_k = GrowBuffer((0, g.kv_heads, g.head_dim), 0, dt, torch.device("cpu"))
        self.ram_v = GrowBuffer((0, g.kv_heads, g.head_dim), 0, dt, torch.device("cpu"))
        self.ram_r = GrowBuffer((0, g.q_heads, g.head_dim), 0, dt, torch.device("cpu"))
        mb = store.manifest["profile"].get("kv_cache_mb", Profile.kv_cache_mb) if kv_cache_mb is None else kv_cache_mb
        cap = (mb << 20) // (g.layers * 2 * self.k.row_bytes)  # tokens per layer
        # A ring smaller than one step's retrieval would only churn: no cache then.
        n_mem = store.manifest["profile"].get("n_mem", 0)
        self.cache = EventCache(cap, self.k.row, dt) if cap > 0 and cap >= n_mem else None

    def __len__(self) -> int:
        return self.lengths.n

    @property
    def n_tokens(self) -> int:
        return self.n_disk + self.ram_k.n

    def append(self, keys: Tensor, values: Tensor, lengths: Tensor, reprs: Tensor) -> None:
        """keys/values [H_kv, n, D], lengths [e], reprs [e, H_q, D]."""
        lengths = lengths.cpu()
        offsets = torch.cumsum(lengths, 0) - lengths + self.n_tokens
        k, v = keys.transpose(0, 1).cpu(), values.transpose(0, 1).cpu()  # [n, H_kv, D] rows
        if self.store.writable:
            self.k.append(k)
            self.v.append(v)
            self.r.append(reprs)
            self.n_disk += k.shape[0]
        else:
            self.ram_k.append(k)
            self.ram_v.append(v)
            self.ram_r.append(reprs.cpu())  # in the store's dtype, as a writer would have stored it
        self.starts.append(offsets)
        self.lengths.append(lengths)

    def _repr_block(self, start: int, stop: int) -> Tensor:
        """Representative keys of events start..stop-1, [n, H_q * D] in the store's dtype."""
        n_file = self.r.rows
        if stop <= n_file:
            x = self.r.read_block(start, stop)
        elif start >= n_file:
            x = self.ram_r.view()[start - n_file : stop - n_file]
        else:
            x = torch.cat((self.r.read_block(start, n_file), self.ram_r.view()[: stop - n_file]))
        return x.reshape(stop - start, self.dim)

    def repr_keys(self) -> Tensor:
        """[E, H_q, D] float32, all of them (for inspection and tests: reads the whole file)."""
        return torch.cat((self.r.read().float(), self.ram_r.view().float()))

    def select(self, query: Tensor, budget: int) -> Selection:
        """As `EventMemory.select` on the exact path, bit for bit (a score depends on its row alone)."""
        if len(self) == 0 or budget <= 0:
            return select_events(torch.zeros(0), self.event_lengths(), 0)
        if self.sketch is not None:
            return self._select_sketched(query.cpu(), budget)
        scores = scores_in_blocks(len(self), self.dim, self._repr_block, query.cpu())
        return select_events(scores, self.event_lengths(), budget)

    def _select_sketched(self, query: Tensor, budget: int) -> Selection:
        """The scan's selection, reading a few events' keys: exact scores for the best-sketched
        events and the events without a sketch (a reader's own), then for every other event whose
        bound reaches the score where the selection stops (`sketch.exact_selection`)."""
        p, nrm, mean, basis = self.sketch
        n_s = p.rows
        est = sketch.estimate(n_s, p.read_block, query, mean, basis)  # [n_s]
        ub = sketch.upper_bound(est, nrm.read_copy(0, n_s), query, mean, basis)
        return sketch.exact_selection(est, ub, self.event_lengths(), budget,
                                      lambda ids: self._exact_scores(ids, query), torch.arange(n_s, len(self)))

    def _exact_scores(self, ids: Tensor, query: Tensor) -> Tensor:
        """Scores of events ids [m] (increasing; files, then a reader's RAM) -> [m]."""
        disk = ids[ids < self.r.rows]
        rows = self.r.take(disk).reshape(disk.numel(), self.dim)
        if disk.numel() < ids.numel():
            rows = torch.cat((rows, self.ram_r.view()[ids[disk.numel() :] - self.r.rows].reshape(-1, self.dim)))
        return scores_in_blocks(ids.numel(), self.dim, lambda a, b: rows[a:b], query)

    def event_lengths(self) -> Tensor:
        return self.lengths.view()

    def gather(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of events `ids`: [H_kv, n, D] each, on the ids' device.

        Cached events are copied from the cache; the others are read (map or RAM) and the ones
        read from the files are cached."""
        dev = ids.device
        ids = ids.cpu()
        starts, lengths = self.starts.view()[ids], self.lengths.view()[ids]
        if self.cache is None:
            k, v = self._read(token_index(starts, lengths))
            return k.transpose(0, 1).to(dev), v.transpose(0, 1).to(dev)
        on_disk = starts + lengths <= self.n_disk  # an event is wholly in the files or wholly in RAM
        offsets = torch.full_like(ids, -1)
        offsets[on_disk] = self.cache.lookup(ids[on_disk])
        hit = offsets >= 0
        out_at = torch.cumsum(lengths, 0) - lengths  # each event's first row in the result
        total = int(lengths.sum())
        k = torch.empty((total, *self.k.row), dtype=self.cache.k.dtype)
        v = torch.empty_like(k)
        if bool(hit.any()):  # copied out before inserting overwrites any of them
            rows = token_index(out_at[hit], lengths[hit])
            k[rows], v[rows] = self.cache.read(offsets[hit], lengths[hit])
        need = ~hit
        if bool(need.any()):
            k_new, v_new = self._read(token_index(starts[need], lengths[need]))
            rows = token_index(out_at[need], lengths[need])
            k[rows], v[rows] = k_new, v_new
            fresh = need & on_disk
            if bool(fresh.any()):
                if bool(fresh[need].all()):
                    self.cache.insert(ids[fresh], lengths[fresh], k_new, v_new)
                else:
                    src = token_index(out_at[fresh], lengths[fresh])
                    self.cache.insert(ids[fresh], lengths[fresh], k[src], v[src])
        return k.transpose(0, 1).to(dev), v.transpose(0, 1).to(dev)

    def _read(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """Token rows idx [n] of the layer's events (files, then a reader's RAM): [n, H_kv, D] each."""
        disk = idx < self.n_disk
        if bool(disk.all()):
            return self.k.take(idx), self.v.take(idx)
        k = torch.empty((idx.numel(), *self.k.row), dtype=self.ram_k.buf.dtype)
        v = torch.empty_like(k)
        k[disk], v[disk] = self.k.take(idx[disk]), self.v.take(idx[disk])
        ram = idx[~disk] - self.n_disk
        k[~disk], v[~disk] = self.ram_k.view()[ram], self.ram_v.view()[ram]
        return k, v


# -- the store --------------------------------------------------------------------------------------
def _checksum(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """path replaced by data (written beside it, fsynced, renamed; a link at the temporary name is
    removed, never written through)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _remove_abandoned(path: Path) -> None:
    """Remove the hidden folders of creates of `path` that were interrupted (their lock is free)."""
    for p in path.parent.glob(f".{glob.escape(path.name)}.new-*"):
        if p.is_symlink() or not p.is_dir():
            continue
        try:
            fd = _lock(p)
        except (StoreError, OSError):
            continue  # a create under way
        try:
            shutil.rmtree(p, ignore_errors=True)  # never follows links
        finally:
            os.close(fd)


def is_store(path: Path) -> bool:
    return (path / MANIFEST).is_file()


class Store:
    """One store folder, open for reading (any number of readers) or writing (one writer)."""

    def __init__(self, path: Path, manifest: dict, writable: bool, lock_fd: int | None, folder: Folder | None = None) -> None:
        self.path, self.manifest, self.writable, self._lock_fd = path, manifest, writable, lock_fd
        self.folder = folder or Folder(path)
        g = manifest["geometry"]
        self.geometry = Geometry(**g)
        rows = manifest["rows"]
        dt = _BY_NAME[self.geometry.dtype][0]
        f = lambda name, row, dtype, n, w=writable: RowFile(self.folder, name, row, dtype, n, w)  # noqa: E731
        self.tokens = f("tokens.i32", (), torch.int32, rows["tokens"])
        self.surprise = f("surprise.f32", (), torch.float32, rows["tokens"])
        self.flags = f("flags.u8", (), torch.uint8, rows["tokens"])
        self.events = f("events.i32", (), torch.int32, rows["events"])
        h, hq, d = self.geometry.kv_heads, self.geometry.q_heads, self.geometry.head_dim
        self.layer_files = [
            (
                f(f"layers/{i:02d}.k", (h, d), dt, rows["event_tokens"]),
                f(f"layers/{i:02d}.v", (h, d), dt, rows["event_tokens"]),
                f(f"layers/{i:02d}.r", (hq, d), dt, rows["events"]),
            )
            for i in range(self.geometry.layers)
        ]
        job = manifest.get("job")
        # written once when a job starts (set_job), read-only after: never truncated
        self.job: RowFile | None = f(job["file"], (), torch.int32, job["tokens"], False) if job else None
        sk = manifest.get("sketch") if manifest["version"] >= 3 else None  # older sketches: unused
        self.sketch_files: list[tuple[RowFile, RowFile]] | None = None
        if sk:
            self.sketch_files = [
                (f(p, (sk["dims"],), torch.float16, rows["events"]), f(n, (3,), torch.float32, rows["events"]))
                for p, n in self._sketch_names(sk["trained_on"])[1]
            ]
        self._basis: dict[str, Tensor] | None = None
        self._retired: list[Path] = []  # files of a replaced sketch: deleted once no manifest names them
        self._state_fd: int | None = None  # a reader's open state file (a commit may delete it meanwhile)
        self._unpublished: Path | None = None  # a new store's hidden folder, until its first commit
        self._tidy = False  # leftovers removed (tidy): once, before the first write

    # -- files -------------------------------------------------------------------------------
    def all_files(self) -> list[RowFile]:
        job = [self.job] if self.job is not None else []
        sk = [x for t in self.sketch_files for x in t] if self.sketch_files is not None else []
        return [self.tokens, self.surprise, self.flags, self.events, *job] + [x for t in self.layer_files for x in t] + sk

    def close(self) -> None:
        for rf in self.all_files():
            rf.close()
        if self._state_fd is not None:
            os.close(self._state_fd)
            self._state_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self.folder.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- open / create -----------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, identity: Identity, profile: dict, geometry: Geometry, extra: dict | None = None) -> "Store":
        """A new, empty store for `path` (which must not exist, or be an empty folder).

        It is built in a hidden folder beside `path` and takes the name at its first commit (its
        first job, or its first state): a create interrupted before that (killed, Ctrl-C while
        tokenizing, a full disk, a model refused) leaves the name free, and the next create of the
        same name removes what it left."""
        path = Path(path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            if is_store(path):
                raise StoreError(f"a store already exists at {path}")
            raise StoreError(f"{path} exists and is not an empty folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(path)
        tmp = path.with_name(f".{path.name}.new-{os.getpid()}-{time.monotonic_ns()}")
        (tmp / "layers").mkdir(parents=True)
        lock_fd = _lock(tmp)
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        manifest = {
            "format": "emllm-store",
            "version": FORMAT_VERSION,
            "created": now,
            "updated": now,
            "identity": identity.as_dict(),
            "profile": profile,
            "geometry": dict(geometry.__dict__),
            "rows": {"tokens": 0, "events": 0, "event_tokens": 0},
            "state": None,
            "job": None,
            "sketch": None,
            "documents": [],
            **(extra or {}),
        }
        st = cls(path, manifest, True, lock_fd, Folder(tmp))
        st._unpublished = tmp
        return st

    def _publish(self) -> None:
        """Give a new store its name (after its first manifest is written in the hidden folder)."""
        tmp, self._unpublished = self._unpublished, None
        try:
            os.rename(tmp, self.path)  # replaces an empty folder; fails if another store took the name
        except OSError as e:
            self._unpublished = tmp
            raise StoreError(f"cannot create the store at {self.path}: {e.strerror or e}") from None
        _fsync_dir(self.path.parent)
        self.folder.path = self.path

    def discard(self) -> None:
        """Close a store never published (its create was interrupted) and remove its hidden folder."""
        tmp = self._unpublished
        self.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def remove_empty(path: Path) -> None:
        """Remove a store that holds nothing (no rows, job or document: a create interrupted by an
        earlier emllm, which named the folder at once). Only the files of the layout are removed;
        a folder holding anything else is refused."""
        st = Store.open(path, writable=True)
        try:
            m = st.manifest
            if m["rows"]["tokens"] or m.get("job") or m["documents"] or m.get("state"):
                raise StoreError(f"{path} is not empty: it is kept")
            names = [MANIFEST, "tokens.i32", "surprise.f32", "flags.u8", "events.i32"]
            names += [f"layers/{i:02d}.{x}" for i in range(st.geometry.layers) for x in "kvr"]
            folder = st.folder
            for name in names:
                folder.unlink(name)
            try:
                os.rmdir("layers", dir_fd=folder.fd)
            except FileNotFoundError:
                pass
            folder.unlink("lock")
        except OSError as e:
            raise StoreError(f"cannot remove the empty store at {path}: {e.strerror or e}") from None
        finally:
            st.close()
        try:
            path.rmdir()
        except OSError as e:
            raise StoreError(f"{path} holds files that are not a store's: remove them or choose another --store ({e.strerror})") from None

    @classmethod
    def open(cls, path: Path, writable: bool = False) -> "Store":
        """Open a store, validating its manifest and files before anything is used.

        A writer takes the lock; it changes nothing until it writes (`tidy`, and the rows past the
        committed counts dropped at each file's first append), so a writer refused after opening
        (another model) leaves the store as it was."""
        path = Path(path)
        if not path.is_dir():
            raise StoreError(f"no store at {path}")
        if not is_store(path):
            raise StoreError(f"{path} is not an emllm store (no {MANIFEST}); give a store made by `emllm ingest`")
        lock_fd = _lock(path) if writable else None
        for attempt in range(3):
            st = manifest = None
            try:
                folder = Folder(path)
                manifest = read_manifest(path, folder)
                st = cls(path, manifest, writable, lock_fd, folder)
                st._check_files()
                if not writable:
                    st._hold_files()
                break
            except StoreError:
                # A reader may read a manifest just before a commit replaces it and deletes what it
                # named (a state or sketch file): it reads the new one. Otherwise the store is damaged.
                if st is not None:
                    st._lock_fd = None
                    st.close()
                else:
                    folder.close()
                if writable or attempt == 2 or read_manifest(path) == manifest:
                    if lock_fd is not None:
                        os.close(lock_fd)
                    raise
            except BaseException:
                if lock_fd is not None:
                    os.close(lock_fd)
                raise
        return st

    def tidy(self) -> None:
        """Remove a crash's leftovers (files no manifest names, a version-2 sketch). Called before a
        writer's first write, not at open: a writer refused after opening (another model) has
        changed nothing."""
        assert self.writable
        if not self._tidy:
            self._tidy = True
            self._drop_old_sketch()
            self._drop_stale_states()

    def _hold_files(self) -> None:
        """A reader opens the files its manifest names and a commit may delete (the state file,
        the job file; the sketch's files, and loads its basis) at once: a writer deletes them once
        its next manifest names others, and open files outlive that."""
        if self.manifest["state"]:
            self._state_fd = self._open(self.manifest["state"]["file"])
        if self.job is not None:
            self.job._reader_fd()
        for p, nrm in self.sketch_files or []:
            p._reader_fd()
            nrm._reader_fd()
        if self.sketch_files is not None:
            self.sketch_basis(0)

    def _open(self, name: str) -> int:
        """A descriptor of one of the store's files, opened without leaving the store."""
        try:
            return self.folder.open(name)
        except FileNotFoundError:
            raise StoreError(f"{name} is missing from the store: the store is damaged") from None
        except UnsafePath as e:
            raise StoreError(f"{e}: the store is refused") from None

    def _check_files(self) -> None:
        """Every file the manifest names is a regular file of the store, long enough for its rows;
        the events' lengths are positive and add up to the event tokens."""
        try:
            st = self.folder.lstat("layers")
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise StoreError("layers in the store is a link or not a folder: the store is refused")
        for rf in self.all_files():
            rf.check_size()
        for part in ("state", "sketch"):
            if self.manifest.get(part):
                os.close(self._open(self.manifest[part]["file"]))
        lengths = self.events.read()
        if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.long().sum()) != self.manifest["rows"]["event_tokens"]):
            raise StoreError("events.i32 does not match the manifest (event lengths that do not add up to its "
                             "event tokens): the store is damaged")
        if self.job is not None and self.manifest["job"]["tokens"]:
            ids = self.job.read()
            if int(ids.min()) < 0 or int(ids.max()) >= self.geometry.vocab:
                raise StoreError(f"{self.job.name} holds token ids outside the vocabulary: the store is damaged")

    def check_identity(self, identity: Identity) -> None:
        """Refuse a model or tokenizer other than the store's, naming the difference.

        Checked in order: config, weight names and shapes, sampled weight values, tokenizer."""
        have = self.manifest["identity"]

        def differs(key: str, what: str) -> None:
            mine, theirs = getattr(identity, key), have.get(key, "")
            if mine != theirs:
                raise StoreError(
                    f"the store was written with model {have['model']!r}; this {what} "
                    f"({mine} != {theirs}): use -m {have['model']} or another --store"
                )

        differs("config_hash", "model config differs")
        differs("weights_hash", "model weights differ")
        # Compared only when both sides have one: a store older than the sample, or weights
        # offloaded to meta, leave it to the metadata hash above.
        mine, theirs = identity.weights_sample, have.get("weights_sample", "")
        if mine and theirs and mine != theirs:  # a fine-tune, or the checkpoint replaced in place
            raise StoreError(
                f"this model's weights differ from those the store was written with ({have['model']!r}: same "
                f"shapes, other values, {mine} != {theirs}): load that checkpoint, or use another --store"
            )
        differs("tokenizer_hash", "tokenizer differs")

    # -- commit ------------------------------------------------------------------------------
    def commit(self, engine_state: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Make everything appended so far durable, with the state that continues the stream.

        Order: data files fsynced, new state file written and fsynced, then the manifest swapped
        atomically; the previous state file is deleted only after the manifest no longer names it.
        """
        from safetensors.torch import save

        self.tidy()
        self.update_sketch()
        for rf in self.all_files():
            rf.sync()
        gen = (self.manifest["state"] or {}).get("generation", 0) + 1
        name = f"state-{gen}.safetensors"
        self.folder.write_atomic(name, save({k: v.detach().cpu().contiguous() for k, v in engine_state.items()}))
        old = self.manifest["state"]
        self.manifest["state"] = {"file": name, "generation": gen, **meta}
        self.manifest["rows"] = {
            "tokens": self.tokens.rows, "events": self.events.rows, "event_tokens": self.layer_files[0][0].rows,
        }
        self.manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._write_manifest()
        self._retire()
        if old and old["file"] != name:
            self.folder.unlink(old["file"])

    # -- the sketch -----------------------------------------------------------------------------
    def sketch_threshold(self) -> int | None:
        """Events per layer from which the store keeps a sketch: the profile's faiss_threshold."""
        return self.manifest["profile"].get("faiss_threshold")

    def sketch_basis(self, layer: int) -> tuple[Tensor, Tensor]:
        """(mean [dim], basis [dim, dims]) of a layer's sketch."""
        if self._basis is None:
            from safetensors.torch import load

            name = self.manifest["sketch"]["file"]
            fd = self._open(name)
            try:
                with os.fdopen(fd, "rb") as f:
                    self._basis = load(f.read())
                g = self.geometry
                for i in range(g.layers):
                    mean, basis = self._basis[f"{i}.mean"], self._basis[f"{i}.basis"]
                    if mean.shape != (g.q_heads * g.head_dim,) or basis.shape != (g.q_heads * g.head_dim, self.manifest["sketch"]["dims"]):
                        raise ValueError(f"layer {i}'s basis has the wrong shape")
                    if mean.dtype != torch.float32 or basis.dtype != torch.float32:
                        raise ValueError(f"layer {i}'s basis is not float32")
            except Exception as e:  # noqa: BLE001 - any parse failure is a damaged file
                raise StoreError(f"cannot read {name}: {e}; the store is damaged") from None
        return self._basis[f"{layer}.mean"], self._basis[f"{layer}.basis"]

    def _sketch_names(self, trained_on: int) -> tuple[str, list[tuple[str, str]]]:
        """The basis file and each layer's (coordinates, norms) files of a sketch fitted on
        `trained_on` events. The first fit (on exactly the threshold) keeps version 3's names; a
        refit's files carry its size, so a reader still reading the previous sketch keeps its files
        until the manifest stops naming them."""
        first = trained_on == self.sketch_threshold()
        basis, tag = ("sketch.safetensors", "") if first else (f"sketch-{trained_on}.safetensors", f".{trained_on}")
        return basis, [(f"layers/{i:02d}{tag}.p", f"layers/{i:02d}{tag}.n") for i in range(self.geometry.layers)]

    def sketch_target(self, n: int) -> int | None:
        """The events the sketch of a store of n events is fitted on: the threshold t, doubled while
        the store holds twice as many (t, 2t, 4t, ...), so the basis follows a stream that drifts
        (measured on a 512k passkey store: a basis fitted on the first 20,000 events left 10k-11k
        of 41.7k events within reach of the selection in 7 layers, one fitted on all of them
        23-747), at a cost that doubles only when the store does."""
        t = self.sketch_threshold()
        if t is None or n < t:
            return None
        return t << ((n // t).bit_length() - 1)

    def update_sketch(self) -> bool:
        """Sketch the events appended since the last call, fitting the basis first (again) when the
        store has reached `sketch_target`'s next size. Data only: the next manifest commits it, and
        `_retire` deletes a replaced sketch's files after that. Returns whether anything was written."""
        self.tidy()
        n = self.events.rows
        target = self.sketch_target(n)
        if target is None:
            return False
        sk = self.manifest.get("sketch")
        if sk is None or sk["trained_on"] < target:
            self._fit_sketch(target)
        assert self.sketch_files is not None
        wrote = False
        for i, (p, nrm) in enumerate(self.sketch_files):
            if p.rows == n:
                continue
            mean, basis = self.sketch_basis(i)
            r = self.layer_files[i][2]
            for a in range(p.rows, n, sketch.FIT_BLOCK_ROWS):  # a block at a time: a (re)fit sketches every event
                b = min(n, a + sketch.FIT_BLOCK_ROWS)
                coords, norms = sketch.project(r.read_copy(a, b).float().reshape(b - a, -1), mean, basis)
                p.append(coords)
                nrm.append(norms)
            wrote = True
        return wrote

    def _fit_sketch(self, t: int) -> None:
        """Fit every layer's basis on the first t events (all of them at the first fit; at a
        refit, `threshold` of them drawn at random with a seed fixed by t, so a fit always costs
        the same and fitting again after a crash gives the same bytes; a stride would alias with a
        periodic stream: every 2nd event of the 512k passkey store gave a basis 5x worse than
        all of them). The file is written (atomically) before any manifest names it. A replaced
        sketch's files are retired, not yet deleted."""
        from safetensors.torch import save

        m = min(t, self.sketch_threshold() or t)
        idx = torch.arange(t) if m == t else torch.randperm(t, generator=torch.Generator().manual_seed(t))[:m].sort().values

        def sample(r: RowFile) -> Callable[[int, int], Tensor]:
            return lambda a, b: r.take(idx[a:b]).float().reshape(b - a, -1)

        tensors: dict[str, Tensor] = {}
        for i, (_, _, r) in enumerate(self.layer_files):
            mean, basis = sketch.fit_blocks(m, sample(r))
            tensors.update({f"{i}.mean": mean, f"{i}.basis": basis})
        name, layer_names = self._sketch_names(t)
        self.folder.write_atomic(name, save(tensors))
        old = self.manifest.get("sketch")
        if old is not None and self.sketch_files is not None:
            for p, nrm in self.sketch_files:
                p.close()
                nrm.close()
                self._retired += [p.name, nrm.name]
            self._retired.append(old["file"])
        self._basis = tensors
        dims = tensors["0.basis"].shape[1]
        self.manifest["sketch"] = {"file": name, "dims": dims, "trained_on": t}
        self.manifest["version"] = FORMAT_VERSION
        mk = lambda name, row, dtype: RowFile(self.folder, name, row, dtype, 0, True)  # noqa: E731
        self.sketch_files = [
            (mk(p, (dims,), torch.float16), mk(n, (3,), torch.float32)) for p, n in layer_names
        ]

    def _retire(self) -> None:
        """Delete a replaced sketch's files, now that the manifest names the new one (a reader
        that opened the old one keeps its open files)."""
        for name in self._retired:
            self.folder.unlink(name)
        self._retired = []

    def commit_sketch(self) -> bool:
        """Sketch what is committed but not sketched yet (a store written before sketches existed,
        or an ingest stopped between), and commit that alone. Returns whether it did anything."""
        self.tidy()
        if not self.update_sketch():
            return False
        for rf in self.all_files():
            rf.sync()
        self.manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._write_manifest()
        self._retire()
        return True

    def set_job(self, tokens: Tensor, documents: list[dict]) -> None:
        """Start an ingest job of `tokens` [n] (begin_job, its tokens, commit_job)."""
        job = self.begin_job()
        try:
            job.append(tokens.to(torch.int32))
            self.commit_job(job, documents)
        except BaseException:
            self.abort_job(job)
            raise

    def begin_job(self) -> RowFile:
        """A new job file to append the job's tokens to (streamed: nothing is held in RAM);
        commit_job makes it the store's job, abort_job removes it."""
        self.tidy()
        old = self.manifest.get("job")
        name = f"job-{(old or {}).get('generation', 0) + 1}.i32"
        self.folder.unlink(name)  # a job file no manifest named yet: a crash's leftover
        return RowFile(self.folder, name, (), torch.int32, 0, True)

    def abort_job(self, job: RowFile) -> None:
        job.close()
        self.folder.unlink(job.name)

    def commit_job(self, job: RowFile, documents: list[dict]) -> None:
        """Make `job` the current ingest job (so --resume needs no input): its file is synced and
        the manifest committed at once, naming it. The previous job's file (whose pending tail
        must be part of the new one) is deleted only after that."""
        old = self.manifest.get("job")
        gen = (old or {}).get("generation", 0) + 1
        assert job.name == f"job-{gen}.i32"
        job.sync()
        if self.job is not None:
            self.job.close()
        self.job = job
        self.manifest["job"] = {"file": job.name, "generation": gen, "tokens": job.rows, "done": 0,
                                "complete": False, "documents": len(documents)}
        self.manifest["documents"] = self.manifest["documents"] + documents
        self._write_manifest()
        if old and old["file"] != job.name:
            self.folder.unlink(old["file"])

    def load_state(self) -> dict[str, Tensor]:
        """The tensors that continue the stream (a reader's from the file it opened with its manifest)."""
        from safetensors.torch import load

        if not self.manifest["state"]:
            return {}
        name = self.manifest["state"]["file"]
        fd = os.dup(self._state_fd) if self._state_fd is not None else self._open(name)
        try:
            with os.fdopen(fd, "rb") as f:
                f.seek(0)
                return load(f.read())
        except Exception as e:  # noqa: BLE001 - any parse failure is a damaged file
            raise StoreError(f"cannot read {name}: {e}; the store is damaged") from None

    def _write_manifest(self) -> None:
        self.manifest["checksum"] = _checksum(self.manifest)
        self.folder.write_atomic(MANIFEST, (json.dumps(self.manifest, indent=1) + "\n").encode())
        if self._unpublished is not None:
            self._publish()

    def _drop_old_sketch(self) -> None:
        """A version-2 sketch (outlier lists) is not used: the manifest stops naming it first,
        then its files go (by _drop_stale_states), and the next commit fits a current one."""
        if self.manifest["version"] < 3 and self.manifest.get("sketch"):
            self.manifest["sketch"] = None
            self._write_manifest()

    def _drop_stale_states(self) -> None:
        """Remove the files of this store's own layout that no manifest names (a crash's leftovers:
        a state or job file written before its commit, a sketch fitted or replaced, temporaries).
        Only names of the layout are touched; a link is removed itself, never followed."""
        keep = {(self.manifest["state"] or {}).get("file"), (self.manifest.get("job") or {}).get("file")}
        sk = self.manifest.get("sketch")
        if sk:
            basis, layer_names = self._sketch_names(sk["trained_on"])
            keep |= {basis, *(x for t in layer_names for x in t)}
        top = re.compile(r"(state-\d+\.safetensors|job-\d+\.i32|sketch(-\d+)?\.safetensors|manifest\.json)(\.tmp)?")
        for name in self.folder.names():
            if top.fullmatch(name) and name not in keep and name != MANIFEST:
                self.folder.unlink(name)
        try:
            layer_files = self.folder.names("layers")
        except (FileNotFoundError, UnsafePath):
            layer_files = []
        for name in layer_files:
            if re.fullmatch(r"\d+(\.\d+)?\.[pon](\.tmp)?", name) and f"layers/{name}" not in keep:
                self.folder.unlink(f"layers/{name}")

    # -- reading -------------------------------------------------------------------------------
    def bytes_on_disk(self) -> dict[str, int]:
        parts = {"tokens": 0, "events": 0, "keys+values": 0, "representative keys": 0, "sketch": 0, "state": 0, "job": 0}
        names = [n for n in self.folder.names()]
        try:
            names += [f"layers/{n}" for n in self.folder.names("layers")]
        except (FileNotFoundError, UnsafePath):
            pass
        for rel in names:
            st = self.folder.lstat(rel)
            if not stat.S_ISREG(st.st_mode):
                continue
            n, name = st.st_size, rel.rsplit("/", 1)[-1]
            suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
            if suffix in (".k", ".v"):
                parts["keys+values"] += n
            elif suffix == ".r":
                parts["representative keys"] += n
            elif suffix in (".p", ".o", ".n") or name.startswith("sketch"):
                parts["sketch"] += n
            elif name.startswith("state-"):
                parts["state"] += n
            elif name.startswith("job-"):
                parts["job"] += n
            elif name == "events.i32":
                parts["events"] += n
            elif name in ("tokens.i32", "surprise.f32", "flags.u8"):
                parts["tokens"] += n
        return parts


# -- marks: cut a store back to an earlier commit ---------------------------------------------------
def save_mark(path: Path, mark: Path) -> None:
    """Save in the new folder `mark` what cuts the store at `path` back to its present commit later
    (cut_back): its manifest and the files it names that later commits replace (state, job), a few
    MB. Arrays are append-only, so the rows past the saved counts are all a cut drops. The store
    must be closed (its writer lock is taken meanwhile); a sketch is refused (refits rewrite it).
    Files of the caller's may be added to the mark: they are not put back."""
    fd = _lock(path)
    try:
        manifest = read_manifest(path)
        if manifest.get("sketch"):
            raise StoreError(f"{path} has a sketch: it cannot be marked and cut back")
        tmp = mark.with_name(mark.name + ".tmp")  # a mark cut short is never taken for one
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for part in ("state", "job"):
            if manifest.get(part):
                _write_atomic(tmp / manifest[part]["file"], (path / manifest[part]["file"]).read_bytes())
        _write_atomic(tmp / MANIFEST, (path / MANIFEST).read_bytes())
        _write_atomic(tmp / MARK_NOTE, json.dumps({"tokens_sha256": _tokens_hash(path, manifest)}).encode())
        shutil.rmtree(mark, ignore_errors=True)
        tmp.rename(mark)
        _fsync_dir(mark.parent)
    finally:
        os.close(fd)


def cut_back(path: Path, mark: Path) -> None:
    """Bring the store at `path` back to the commit saved in `mark` by save_mark (the mark stays).
    The files the mark's manifest names are put back before the manifest, so a crash at any moment
    leaves the store at its last commit or at the mark's, and a second call finishes the first;
    the writer's next open truncates the rows past the mark's counts (so no reader may have the
    store open). A mark that is another store's or damaged raises StoreError before anything is
    written; a failed write (a full disk) raises CutBackFailed, and the store and the mark stay."""
    fd = _lock(path)
    try:
        try:
            saved = read_manifest(mark)
            note = json.loads((mark / MARK_NOTE).read_text())["tokens_sha256"]
            files = [saved[part]["file"] for part in ("state", "job") if saved.get(part)]
            if lost := [f for f in files if not (mark / f).is_file()]:
                raise FileNotFoundError(f"no {', '.join(lost)}")
        except (StoreError, OSError, ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{mark} is incomplete or damaged ({e})") from None
        now = read_manifest(path)
        if (saved["created"], saved["identity"]) != (now["created"], now["identity"]):
            raise StoreError(f"{mark} was not saved from the store at {path}")
        if any(now["rows"][k] < saved["rows"][k] for k in saved["rows"]):
            raise StoreError(f"{path} holds fewer rows than {mark} was saved at: it cannot be cut back to it")
        if note != _tokens_hash(path, saved):
            raise StoreError(f"{mark} was not saved from the store at {path} (other tokens)")
        try:
            for f in files:
                _put_back(mark / f, path / f)
            _write_atomic(path / MANIFEST, (mark / MANIFEST).read_bytes())
        except OSError as e:
            raise CutBackFailed(f"cannot cut {path} back to {mark}: {e.strerror or e}; nothing is lost "
                             f"(the store is at its last commit or at the mark, which stays): run again") from None
    finally:
        os.close(fd)


def _put_back(src: Path, dst: Path) -> None:
    """Make dst a copy of src atomically. A hard link writes no bytes (cut_back runs when the disk
    is nearly full) and is safe: a store never changes a file its manifest names in place."""
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        _write_atomic(dst, src.read_bytes())  # another file system, or one without hard links
        return
    os.replace(tmp, dst)
    tmp.unlink(missing_ok=True)  # rename leaves both names when they were links to one file already
    _fsync_dir(dst.parent)


MARK_NOTE = "mark.json"  # in a mark: the hash of the store's tokens at the mark


def _tokens_hash(path: Path, manifest: dict) -> str:
    """sha256 of the first rows of tokens.i32 the manifest commits (4 bytes a token)."""
    h = hashlib.sha256()
    left = manifest["rows"]["tokens"] * 4
    with open(path / "tokens.i32", "rb") as f:
        while left > 0 and (buf := f.read(min(left, 1 << 22))):
            h.update(buf)
            left -= len(buf)
    return h.hexdigest()


MANIFEST_LIMIT = 256 << 20  # bytes: a manifest larger than this is refused unread
MIN_VERSION = 1
_INT_LIMIT = 1 << 40  # rows, tokens, generations: far above any real store, far below overflow


def read_manifest(path: Path, folder: Folder | None = None) -> dict:
    """The committed manifest, validated: every field's type and range, and every file it names a
    plain name of this store's layout (it is read without following a link, and never past 256 MiB).
    A store is untrusted input; the checksum only catches accidents (anyone can recompute it)."""
    own = folder is None
    try:
        folder = folder or Folder(path)
    except OSError as e:
        raise StoreError(f"cannot open the store at {path}: {e.strerror or e}") from None
    try:
        raw = folder.read(MANIFEST, MANIFEST_LIMIT)
        manifest = json.loads(raw.decode("utf-8"))
    except UnsafePath as e:
        raise StoreError(f"{e}: the store is refused") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise StoreError(f"{path / MANIFEST} is unreadable ({getattr(e, 'strerror', None) or e}): the store is damaged") from None
    finally:
        if own:
            folder.close()
    if not isinstance(manifest, dict) or manifest.get("format") != "emllm-store":
        raise StoreError(f"{path} is not an emllm store (its {MANIFEST} is of another kind)")
    v = manifest.get("version")
    if type(v) is not int or v < MIN_VERSION:
        raise StoreError(f"{path} has store format version {v!r}, which no emllm wrote: the store is damaged")
    if v > FORMAT_VERSION:
        raise StoreError(
            f"{path} has store format version {v}, newer than this emllm reads ({FORMAT_VERSION}): upgrade emllm"
        )
    if manifest.get("checksum") != _checksum(manifest):
        raise StoreError(f"{path / MANIFEST} fails its checksum: it was edited or damaged; restore it or re-ingest")
    try:
        _validate(manifest)
    except _Invalid as e:
        raise StoreError(f"{path / MANIFEST}: {e}: the store is damaged or was edited") from None
    return manifest


class _Invalid(Exception):
    pass


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Invalid(what)


def _int(d: Any, key: str, lo: int = 0, hi: int = _INT_LIMIT, at: str = "") -> int:
    _need(isinstance(d, dict) and key in d, f"no {at}{key}")
    x = d[key]
    _need(type(x) is int and lo <= x <= hi, f"{at}{key} is {str(x)[:40]!r}, not an integer in [{lo}, {hi}]")
    return x


def _str(d: Any, key: str, optional: bool = False, at: str = "") -> None:
    _need(isinstance(d, dict), f"no {at}{key}")
    if optional and key not in d:
        return
    _need(isinstance(d.get(key), str), f"{at}{key} is missing or not a string")


def _validate(m: dict) -> None:
    """Every field a store's readers and writers use, its type and range (raises _Invalid)."""
    for k in ("created", "updated"):
        _str(m, k)
    ident = m.get("identity")
    for k in ("model", "config_hash", "weights_hash", "tokenizer_hash"):
        _str(ident, k, at="identity.")
    _str(ident, "weights_sample", optional=True, at="identity.")
    prof = m.get("profile")
    _need(isinstance(prof, dict), "no profile")
    _str(prof, "name", at="profile.")
    g = m.get("geometry")
    _need(isinstance(g, dict) and set(g) == set(Geometry.__dataclass_fields__), "geometry has other fields")
    for k, hi in (("layers", 1024), ("kv_heads", 1024), ("q_heads", 4096), ("head_dim", 4096), ("vocab", 1 << 24)):
        _int(g, k, 1, hi, at="geometry.")
    _need(g["q_heads"] % g["kv_heads"] == 0, "q_heads is not a multiple of kv_heads")
    _need(g["dtype"] in ("float32", "float16", "bfloat16"), f"dtype {g['dtype']!r} is not one a store holds")
    rows = m.get("rows")
    t, e, et = (_int(rows, k, at="rows.") for k in ("tokens", "events", "event_tokens"))
    _need(e <= et, f"rows do not add up ({e} events of {et} tokens)")
    st = m.get("state")
    if st is not None:
        gen = _int(st, "generation", 1)
        _need(st.get("file") == f"state-{gen}.safetensors", "state names a file not of this store's layout")
        if "tokens" in st or "events" in st:  # a stream's state (stores of the tests' own have none)
            _need(_int(st, "tokens") == t and _int(st, "events") == e, "the state is not the one of these rows")
            _need(et <= t, f"rows do not add up ({et} event tokens in a stream of {t})")
    else:
        _need(t == 0, "rows without a state")
    job = m.get("job")
    if job is not None:
        gen = _int(job, "generation", 1, at="job.")
        _need(job.get("file") == f"job-{gen}.i32", "job names a file not of this store's layout")
        n = _int(job, "tokens", at="job.")
        _int(job, "done", 0, n, at="job.")
        _need(isinstance(job.get("complete"), bool), "job.complete is not true or false")
        if "documents" in job:
            _int(job, "documents")
    sk = m.get("sketch")
    if sk is not None:
        f = _int(sk, "trained_on", 1)
        _int(sk, "dims", 1, 4096)
        _need(sk.get("file") in ("sketch.safetensors", f"sketch-{f}.safetensors"), "sketch names a file not of this store's layout")
    docs = m.get("documents", [])
    _need(isinstance(docs, list), "documents is not a list")
    for d in docs:
        _str(d, "name")
        _str(d, "sha256", optional=True)
        for k in ("start", "tokens"):
            _int(d, k)
        if "chars" in d:
            _int(d, "chars")
    if "stream" in m:
        s = m["stream"]
        _need(isinstance(s, dict) and isinstance(s.get("chat"), bool), "stream.chat is not true or false")
        _str(s, "prefix")
        _str(s, "suffix")


def _lock(path: Path) -> int:
    """Take the store's writer lock (non-blocking); readers never take it."""
    try:
        fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StoreError(f"{path / 'lock'} is a symbolic link: the store is refused") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StoreError(f"{path / 'lock'} is not a regular file: the store is refused")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise StoreLockedError(f"{path} is being written by another emllm process; wait for it to finish") from None
        raise
    return fd


__all__ = [
    "Store", "StoreError", "StoreLockedError", "StoredEvents", "Identity", "Geometry", "RowFile",
    "FORMAT_VERSION", "is_store", "read_manifest", "save_mark", "cut_back", "weights_hash", "weights_sample", "tokenizer_hash",
]
