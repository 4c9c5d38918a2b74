"""The on-disk store: the episodic memory of a stream, outliving the process (spec §5, design.md).

A store is a folder:

    manifest.json            what is committed: version, identity, profile, geometry, row counts
    tokens.i32 surprise.f32 flags.u8          one row per processed token of the stream
    events.i32                                one row per event: its length in tokens
    layers/NN.k layers/NN.v                   per layer, one row [H_kv, D] per event token (pre-RoPE)
    layers/NN.r                               per layer, one row [H_r, D] per event (representative key;
                                              H_r: repr_heads, the query heads before version 7)
    sketch{-F}.safetensors   per layer, the basis of the sketches (once the store has sketch_threshold events;
                             F: the events it was fitted on, refitted as the store doubles)
    layers/NN{.F}.p layers/NN{.F}.n           per layer, each event's sketch [dims] and its norms [3]
    job-G.i32                the tokens of the current ingest job (so --resume needs no input)
    digests.bin              SHA-256 of each complete 64 KiB block of the files above (version 8;
                             each file's last partial block's digest is in the manifest: store.digests)
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
import glob
import hashlib
import json
import os
import re
import shutil
import stat
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from emllm.memory import sketch
from emllm.memory import quant
from emllm.memory.quant import kv_format
from emllm.store.errors import ModelMismatchError, StoreError, lock_store
from emllm.store.files import Folder, UnsafePath, fsync_dir
from emllm.store.identity import Geometry, Identity
from emllm.store.digests import NAME as DIGESTS, Digests, Problem, Verified
from emllm.store.manifest import FORMAT_VERSION, MANIFEST, Manifest, checksum, is_store, read_manifest
from emllm.store.rows import _BY_NAME, RowFile, finite


# A version-5 state leaves out what the layer files hold: each layer's initial tokens', remainder's
# and window's keys and values.
_IN_ROWS = tuple(f".{part}_{x}" for part in ("init", "rem", "local") for x in "kv")


def _remove_abandoned(path: Path) -> None:
    """Remove the hidden folders of creates of `path` that were interrupted (their lock is free)."""
    for p in path.parent.glob(f".{glob.escape(path.name)}.new-*"):
        if p.is_symlink() or not p.is_dir():
            continue
        try:
            fd = lock_store(p)
        except (StoreError, OSError):
            continue  # a create under way
        try:
            shutil.rmtree(p, ignore_errors=True)  # never follows links
        finally:
            os.close(fd)


def packed(parts: list[Tensor]) -> tuple[list[Tensor], list[int]]:
    """1-D tensors `parts` (one device) as bytes to concatenate: the pieces (each part's bytes, with
    zero bytes before it where needed) and each part's offset in their concatenation. Every part
    starts at a multiple of 16 bytes, so that its bytes view back as its dtype in place (no copy a
    part)."""
    pieces, offsets, off = [], [], 0
    for p in parts:
        pad = -off % 16
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=p.device))
            off += pad
        pieces.append(p.view(torch.uint8))
        offsets.append(off)
        off += p.nbytes
    return pieces, offsets


class Store:
    """One store folder, open for reading (any number of readers) or writing (one writer)."""

    def __init__(self, path: Path, manifest: dict, writable: bool, lock_fd: int | None, folder: Folder | None = None) -> None:
        self.path, self.manifest, self.writable, self._lock_fd = path, manifest, writable, lock_fd
        self.folder = folder or Folder(path)
        # rows a device step leaves on the device, brought to the host together at its end (`defer`)
        self._deferred: list[tuple[Callable[[list[Tensor]], None], list[Tensor]]] = []
        g = manifest["geometry"]
        self.geometry = Geometry.of(g)
        rows = manifest["rows"]
        # how keys and values are kept (stores before version 5: in the compute dtype)
        self.kv_format = kv_format(manifest.get("kv_format", self.geometry.dtype), self.geometry.head_dim)
        kvf = self.kv_format
        # Layout: from version 5 the key and value files hold every token of the stream as it is
        # read (rows.kv_tokens), the initial tokens, remainder and window included, and the state
        # only what is not in them (attention mass, counters): a commit writes each token once.
        # Before, they held the events' tokens and the state the rest, rewritten at every commit.
        self.all_tokens = "kv_tokens" in rows
        kv_rows = rows["kv_tokens"] if self.all_tokens else rows["event_tokens"]
        f = lambda name, row, dtype, n, w=writable: RowFile(self.folder, name, row, dtype, n, w)  # noqa: E731
        self.tokens = f("tokens.i32", (), torch.int32, rows["tokens"])
        self.surprise = f("surprise.f32", (), torch.float32, rows["tokens"])
        self.flags = f("flags.u8", (), torch.uint8, rows["tokens"])
        self.events = f("events.i32", (), torch.int32, rows["events"])
        h, d = self.geometry.kv_heads, self.geometry.head_dim
        # representative keys per event: one per KV head (version 7, mean keys of a GQA model: the
        # query heads of a group would share it) or one per query head
        self.repr_heads = hr = manifest.get("repr_heads", self.geometry.q_heads)
        self.layer_files = [
            (
                f(f"layers/{i:02d}.k", kvf.row(h, d), kvf.row_dtype, kv_rows),
                f(f"layers/{i:02d}.v", kvf.row(h, d), kvf.row_dtype, kv_rows),
                f(f"layers/{i:02d}.r", kvf.reprs.row(hr, d), kvf.reprs.row_dtype, rows["events"]),
            )
            for i in self.geometry.with_memory  # (by slot: layer_files[j] is the j-th layer with memory's)
        ]
        # An integer store of version 6 equalises each layer's keys per channel before quantising
        # them (memory.quant.fit_equaliser): `layers/NN.e` holds the layer's [2, H_kv, D] centre
        # and scale, fitted on its first rows and written before them, so it is committed with them.
        self.key_equalised = bool(manifest.get("key_equaliser")) and kvf.bits is not None
        eq_rows = 2 if self.key_equalised and kv_rows else 0
        self.equaliser_files = [f(f"layers/{i:02d}.e", (h, d), torch.float32, eq_rows)
                                for i in self.geometry.with_memory] if self.key_equalised else []
        self._equalisers: list[Tensor | None] = [None] * len(self.geometry.with_memory)
        self._equalisers_on: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}  # (slot, device): (host's, copy)
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
        self._info: Manifest | None = None  # the typed manifest, made again after each write
        # version 8: every committed byte has a digest (emllm.store.digests); older stores have none
        self.digests = Digests(self.folder, manifest, self.all_files(), writable) if manifest["version"] >= 8 else None

    @property
    def info(self) -> Manifest:
        """The committed manifest, typed: what code outside emllm.store reads of it."""
        if self._info is None:
            self._info = Manifest.of(self.manifest)
        return self._info

    # -- files -------------------------------------------------------------------------------
    def all_files(self) -> list[RowFile]:
        job = [self.job] if self.job is not None else []
        sk = [x for t in self.sketch_files for x in t] if self.sketch_files is not None else []
        return ([self.tokens, self.surprise, self.flags, self.events, *job] + [x for t in self.layer_files for x in t]
                + self.equaliser_files + sk)

    def close(self) -> None:
        for rf in self.all_files():
            rf.close()
        if self.digests is not None:
            self.digests.close()
        if self._state_fd is not None:
            os.close(self._state_fd)
            self._state_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self.folder.close()

    def reopened(self) -> "Store":
        """A writer's store as its last commit left it, the lock handed over: for a job stopped part
        way in this process (its files hold rows past the commit, which this handle counts as its
        own: a job continued through it would commit them as the stream's)."""
        assert self.writable and self._unpublished is None
        lock_fd, self._lock_fd = self._lock_fd, None
        self.close()
        return type(self)._validated(self.path, True, lock_fd)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- open / create -----------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, identity: Identity, profile: dict, geometry: Geometry, extra: dict | None = None,
               kv: str | None = None, repr_heads: int | None = None) -> "Store":
        """A new, empty store for `path` (which must not exist, or be an empty folder), keeping keys
        and values in format `kv` (emllm.memory.quant.FORMATS; None: the compute dtype) and
        representative keys of `repr_heads` heads (the KV heads or, None, the query heads).

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
        lock_fd = lock_store(tmp)
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        fmt = kv_format(kv or geometry.dtype, geometry.head_dim)
        hr = geometry.q_heads if repr_heads is None else repr_heads
        if hr not in (geometry.kv_heads, geometry.q_heads):
            raise ValueError(f"repr_heads {hr}: neither the KV heads nor the query heads")
        manifest = {
            "format": "emllm-store",
            "version": FORMAT_VERSION,
            "created": now,
            "updated": now,
            "identity": identity.as_dict(),
            "profile": profile,
            "geometry": geometry.as_dict(),
            "kv_format": fmt.name,
            "key_equaliser": fmt.bits is not None,
            **({"repr_heads": hr} if hr != geometry.q_heads else {}),
            "rows": {"tokens": 0, "events": 0, "event_tokens": 0, "kv_tokens": 0},
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
        fsync_dir(self.path.parent)
        self.folder.path = self.path

    def publish_empty(self) -> None:
        """Give a new store its name now, empty (a conversation that starts with nothing in it)."""
        if self._unpublished is not None:
            self._write_manifest()

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
            names = [MANIFEST, "tokens.i32", "surprise.f32", "flags.u8", "events.i32", DIGESTS]
            names += [f"layers/{i:02d}.{x}" for i in st.geometry.with_memory for x in "kvr"]
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
            raise StoreError(f"{path} holds files that are not a store's: remove them, or use another name ({e.strerror})") from None

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
            raise StoreError(f"{path} is not an emllm store (no {MANIFEST})")
        return cls._validated(path, writable, lock_store(path) if writable else None)

    @classmethod
    def _validated(cls, path: Path, writable: bool, lock_fd: int | None) -> "Store":
        """`open`'s reading and checks, a writer's lock taken already (closed if they fail)."""
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
        if self.digests is not None:
            problems = self.digests.check_open(self.all_files())
            if problems:
                raise StoreError(f"{self.path}: {problems[0]}: the store is damaged or was edited; it is refused "
                                 "(`emllm inspect --verify` checks every byte)")
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
        """Refuse a model or tokenizer other than the store's, naming the difference (in the order
        `Identity.difference` checks)."""
        have = self.manifest["identity"]
        key = identity.difference(have)
        if key == "weights_sample":  # a fine-tune, or the checkpoint replaced in place
            raise ModelMismatchError(
                f"this model's weights differ from those the store was written with ({have['model']!r}: same "
                f"shapes, other values, {identity.weights_sample} != {have['weights_sample']}): load that checkpoint",
                have["model"])
        if key is not None:
            what = {"config_hash": "model config differs", "weights_hash": "model weights differ",
                    "tokenizer_hash": "tokenizer differs"}[key]
            raise ModelMismatchError(f"the store was written with model {have['model']!r}; this {what} "
                                     f"({getattr(identity, key)} != {have.get(key, '')})", have["model"])

    # -- commit ------------------------------------------------------------------------------
    def commit(self, engine_state: dict[str, Tensor], meta: dict[str, Any], job_done: int | None = None,
               job_complete: bool = False) -> None:
        """Make everything appended so far durable, with the state that continues the stream
        (and, job_done given, how far the current job got, and whether it is complete).

        Order: data files fsynced, new state file written and fsynced, then the manifest swapped
        atomically; the previous state file is deleted only after the manifest no longer names it.
        """
        from safetensors.torch import save

        self.flush_deferred()
        kv = self.layer_files[0][0].rows
        if self.all_tokens and kv != self.tokens.rows:  # (before anything is written or changed)
            raise StoreError(f"{self.path}: {kv} tokens' keys and values written for a stream of "
                             f"{self.tokens.rows}: not committed")
        self.tidy()
        self.update_sketch()
        for rf in self.all_files():
            rf.sync()
        gen = (self.manifest["state"] or {}).get("generation", 0) + 1
        name = f"state-{gen}.safetensors"
        if self.all_tokens:  # the window's keys and values are in the layer files already
            engine_state = {k: v for k, v in engine_state.items() if not k.endswith(_IN_ROWS)}
        data = save({k: v.detach().cpu().contiguous() for k, v in engine_state.items()})
        self.folder.write_atomic(name, data)
        old = self.manifest["state"]
        self.manifest["state"] = {"file": name, "generation": gen, **meta, **self._sha256(data)}
        if job_done is not None:
            self.manifest["job"] = {**self.manifest["job"], "done": job_done, "complete": job_complete}
        rows = self.manifest["rows"]
        if self.all_tokens:
            new = self.events.read_copy(rows["events"], self.events.rows)
            rows = {"tokens": self.tokens.rows, "events": self.events.rows,
                    "event_tokens": rows["event_tokens"] + int(new.long().sum()), "kv_tokens": kv}
        else:
            rows = {"tokens": self.tokens.rows, "events": self.events.rows, "event_tokens": kv}
        self.manifest["rows"] = rows
        self.manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._write_manifest()
        self._retire()
        if old and old["file"] != name:
            self.folder.unlink(old["file"])

    # -- the sketch -----------------------------------------------------------------------------
    def sketch_threshold(self) -> int | None:
        """Events per layer from which the store keeps a sketch: the profile's sketch_threshold (in
        stores written before that key, faiss_threshold, which then governed both)."""
        prof = self.manifest["profile"]
        return prof["sketch_threshold"] if "sketch_threshold" in prof else prof.get("faiss_threshold")

    def sketch_basis(self, slot: int) -> tuple[Tensor, Tensor]:
        """(mean [dim], basis [dim, dims]) of a layer's sketch (slot: its index among the layers
        with memory, as `layer_files`; so are the other methods' slots)."""
        if self._basis is None:
            from safetensors.torch import load

            name = self.manifest["sketch"]["file"]
            fd = self._open(name)
            try:
                with os.fdopen(fd, "rb") as f:
                    self._basis = load(self._checked(f.read(), self.manifest["sketch"]))
                g = self.geometry
                for i in range(len(g.with_memory)):  # (keyed by slot, as layer_files)
                    mean, basis = self._basis[f"{i}.mean"], self._basis[f"{i}.basis"]
                    dim = self.repr_heads * g.head_dim
                    if mean.shape != (dim,) or basis.shape != (dim, self.manifest["sketch"]["dims"]):
                        raise ValueError(f"layer {i}'s basis has the wrong shape")
                    if mean.dtype != torch.float32 or basis.dtype != torch.float32:
                        raise ValueError(f"layer {i}'s basis is not float32")
            except Exception as e:  # noqa: BLE001 - any parse failure is a damaged file
                raise StoreError(f"cannot read {name}: {e}; the store is damaged") from None
        return self._basis[f"{slot}.mean"], self._basis[f"{slot}.basis"]

    def _sketch_names(self, trained_on: int) -> tuple[str, list[tuple[str, str]]]:
        """The basis file and each layer's (coordinates, norms) files of a sketch fitted on
        `trained_on` events. The first fit (on exactly the threshold) keeps version 3's names; a
        refit's files carry its size, so a reader still reading the previous sketch keeps its files
        until the manifest stops naming them."""
        first = trained_on == self.sketch_threshold()
        basis, tag = ("sketch.safetensors", "") if first else (f"sketch-{trained_on}.safetensors", f".{trained_on}")
        return basis, [(f"layers/{i:02d}{tag}.p", f"layers/{i:02d}{tag}.n") for i in self.geometry.with_memory]

    def sketch_target(self, n: int) -> int | None:
        """The events the sketch of a store of n events is fitted on: the threshold t, doubled while
        the store holds twice as many (t, 2t, 4t, ...), so the basis follows a stream that drifts
        (docs/store-format.md), at a cost that doubles only when the store does."""
        t = self.sketch_threshold()
        if t is None or n < t:
            return None
        return t << ((n // t).bit_length() - 1)

    def key_equaliser(self, slot: int, first_keys: Tensor | None = None) -> Tensor | None:
        """A layer's key equaliser [2, H_kv, D] float32 (None where the store keeps keys without
        one): read from its file, or fitted on `first_keys` [n, H_kv, D], the layer's first rows,
        and appended to the file by a writer (committed with those rows)."""
        if not self.key_equalised:
            return None
        eq = self._equalisers[slot]
        if eq is None:
            rf = self.equaliser_files[slot]
            g = self.geometry
            if rf.rows:
                eq = rf.read_copy(0, 2)
                if not quant.equaliser_ok(eq, g.kv_heads, g.head_dim):
                    raise StoreError(f"{rf.name} is not a key equaliser (a scale not positive, or not finite): "
                                     "the store is damaged")
            elif first_keys is None:
                raise StoreError(f"{rf.name} is missing while keys are stored: the store is damaged")
            else:
                eq = quant.fit_equaliser(first_keys)
                if self.writable:
                    rf.append(eq)
            self._equalisers[slot] = eq
        return eq

    def key_equaliser_on(self, slot: int, first_keys: Tensor) -> Tensor | None:
        """`key_equaliser` on the device of `first_keys` [n, H_kv, D] (the layer's next rows: read
        back only where the equaliser is fitted on them now), copied there once."""
        if not self.key_equalised:
            return None
        eq = self._equalisers[slot]
        if eq is None:
            eq = self.key_equaliser(slot, first_keys.cpu())
        held = self._equalisers_on.get((slot, first_keys.device))
        if held is None or held[0] is not eq:
            held = self._equalisers_on[(slot, first_keys.device)] = (eq, eq.to(first_keys.device))
        return held[1]

    def defer(self, write: Callable[[list[Tensor]], None], tensors: list[Tensor]) -> None:
        """Have `write` called with host copies of `tensors` (on a device) at `flush_deferred`:
        the rows every layer of a device step produces come back to the host in one read at the
        step's end, not one read a layer in its middle."""
        self._deferred.append((write, tensors))

    def flush_deferred(self) -> None:
        """Bring every deferred tensor to the host in one copy, then call the writes in order."""
        if not self._deferred:
            return
        items, self._deferred = self._deferred, []
        flat = [t.detach().contiguous().view(-1) for _, ts in items for t in ts]
        # one read back per device the parts live on (rows may also come from the host already)
        host: list[Tensor | None] = [p if p.device.type == "cpu" else None for p in flat]
        for dev in {p.device for p in flat if p.device.type != "cpu"}:
            at = [i for i, p in enumerate(flat) if p.device == dev]
            pieces, offsets = packed([flat[i] for i in at])
            back = torch.cat(pieces).cpu()  # (the step's one read back)
            for i, o in zip(at, offsets):
                host[i] = back[o : o + flat[i].nbytes].view(flat[i].dtype)
        parts_ = iter(host)
        for write, ts in items:  # (the writes copy what they keep: the views need not outlive them)
            write([next(parts_).view(t.shape) for t in ts])

    def forget_equaliser(self, slot: int) -> None:
        """Drop a layer's equaliser fitted in RAM (a reader's, on a store without keys yet)."""
        if self.key_equalised and not self.equaliser_files[slot].rows:
            self._equalisers[slot] = None

    def encode_keys(self, slot: int, k: Tensor) -> Tensor:
        """A layer's keys [n, H_kv, D], the next rows of its stream, as its key file keeps them."""
        return quant.encode_keys(self.kv_format, k, self.key_equaliser(slot, k))

    def decode_keys(self, slot: int, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows of a layer's key file -> keys [n, H_kv, D] in dtype."""
        return quant.decode_keys(self.kv_format, rows, self.key_equaliser(slot), dtype)

    def reprs_of(self, rows: Tensor) -> Tensor:
        """Representative keys [n, H_r, D] float32 from rows of a `layers/NN.r` file."""
        return self.kv_format.reprs.decode(rows, torch.float32)

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
                coords, norms = sketch.project(self.reprs_of(r.read_copy(a, b)).reshape(b - a, -1), mean, basis)
                p.append(coords)
                nrm.append(norms)
            wrote = True
        return wrote

    def _fit_sketch(self, t: int) -> None:
        """Fit every layer's basis on the first t events (all of them at the first fit; at a
        refit, `threshold` of them drawn at random with a seed fixed by t, so a fit always costs
        the same and fitting again after a crash gives the same bytes; a stride would alias with a
        periodic stream: every 2nd event of a passkey store gave a far worse basis than all of
        them). The file is written (atomically) before any manifest names it. A replaced
        sketch's files are retired, not yet deleted."""
        from safetensors.torch import save

        m = min(t, self.sketch_threshold() or t)
        idx = torch.arange(t) if m == t else torch.randperm(t, generator=torch.Generator().manual_seed(t))[:m].sort().values

        def sample(r: RowFile) -> Callable[[int, int], Tensor]:
            return lambda a, b: self.reprs_of(r.take(idx[a:b])).reshape(b - a, -1)

        tensors: dict[str, Tensor] = {}
        for i, (_, _, r) in enumerate(self.layer_files):
            mean, basis = sketch.fit_blocks(m, sample(r))
            tensors.update({f"{i}.mean": mean, f"{i}.basis": basis})
        name, layer_names = self._sketch_names(t)
        data = save(tensors)
        self.folder.write_atomic(name, data)
        old = self.manifest.get("sketch")
        if old is not None and self.sketch_files is not None:
            for p, nrm in self.sketch_files:
                p.close()
                nrm.close()
                self._retired += [p.name, nrm.name]
            self._retired.append(old["file"])
        self._basis = tensors
        dims = tensors["0.basis"].shape[1]
        self.manifest["sketch"] = {"file": name, "dims": dims, "trained_on": t, **self._sha256(data)}
        self.manifest["version"] = max(self.manifest["version"], 4)  # the sketch's layout is version 4's
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
                state = load(self._checked(f.read(), self.manifest["state"]))
        except Exception as e:  # noqa: BLE001 - any parse failure is a damaged file
            raise StoreError(f"cannot read {name}: {e}; the store is damaged") from None
        if self.all_tokens:
            state.update(self._window_rows(state))
        return state

    def _window_rows(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The initial tokens', remainder's and window's keys and values of each layer, [H_kv, n, D]
        in the compute dtype, read from the layer files (a version-5 state leaves them out):
        positions [0, min(n_init, w)), [rem_start, w) and [w, n), w the window's first position."""
        n, n_init = self.manifest["rows"]["tokens"], self.manifest["profile"].get("n_init", 0)
        dt = _BY_NAME[self.geometry.dtype][0]
        try:
            rem_start = int(state["rem_start"])
            out = {}
            for i, ((k, v, _), layer) in enumerate(zip(self.layer_files, self.geometry.with_memory)):
                w = n - state[f"layer{layer}.local_mass"].shape[1]
                if not 0 <= w <= n or not 0 <= rem_start or rem_start > max(w, n_init):
                    raise ValueError("the window does not fit the stream")
                spans = {"init": (0, min(n_init, w)), "rem": (min(rem_start, w), w), "local": (w, n)}
                for part, (a, b) in spans.items():
                    for x, rf in (("k", k), ("v", v)):
                        rows = rf.read_copy(a, b) if b > a else torch.zeros((0, *rf.row), dtype=rf.dtype)
                        x_ = self.decode_keys(i, rows, dt) if x == "k" else self.kv_format.decode(rows, dt)
                        if not finite(x_):
                            raise StoreError(f"{self.path}: layer {layer}'s keys or values are not finite: the store "
                                             "is damaged or was edited; it is refused")
                        out[f"layer{layer}.{part}_{x}"] = x_.transpose(0, 1).contiguous()
        except (KeyError, ValueError, IndexError) as e:
            raise StoreError(f"{self.path}: its state does not fit its rows ({e}): the store is damaged") from None
        return out

    def _sha256(self, data: bytes) -> dict:
        """A file's digest for its manifest entry (version 8)."""
        return {"sha256": hashlib.sha256(data).hexdigest()} if self.digests is not None else {}

    @staticmethod
    def _checked(data: bytes, entry: dict) -> bytes:
        """A whole file's bytes, checked against its manifest entry's digest where it has one."""
        if "sha256" in entry and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError("its bytes differ from their digest (edited or damaged)")
        return data

    def verify(self, progress: Callable[[int], None] | None = None) -> "Verified | None":
        """Every committed byte against its digest (None: a store written before digests)."""
        if self.digests is None:
            return None
        out = self.digests.verify(self.all_files(), progress)
        for part in ("state", "sketch"):
            entry = self.manifest.get(part)
            if entry:
                fd = self._open(entry["file"])
                with os.fdopen(fd, "rb") as f:
                    data = f.read()
                out.files += 1
                out.bytes += len(data)
                try:
                    self._checked(data, entry)
                except ValueError:
                    out.problems.append(Problem(entry["file"], "differs from its digest"))
        return out

    def total_bytes(self) -> int:
        """Committed bytes of the append-only files (what `verify` reads, but the state and sketch)."""
        return sum(rf.rows * rf.row_bytes for rf in self.all_files())

    def _write_manifest(self) -> None:
        past = self._rows_past_manifest()
        if past:  # its digests would seal rows the manifest does not count: the next open refuses the store
            raise StoreError(f"{self.path}: {', '.join(past)} hold rows the manifest does not count (written since "
                             "the last commit); nothing written: open the store again to continue from that commit")
        self._info = None
        if self.digests is not None:  # the bytes this manifest commits, hashed and their records synced
            self.manifest["digests"] = self.digests.seal(self.all_files())
        self.manifest["checksum"] = checksum(self.manifest)
        self.folder.write_atomic(MANIFEST, (json.dumps(self.manifest, indent=1) + "\n").encode())
        if self._unpublished is not None:
            self._publish()

    def _rows_past_manifest(self) -> list[str]:
        """The stream's files whose rows are not those the manifest counts (`rows`, as __init__
        reads them): rows a writer appended since its last commit, which only a commit may count."""
        rows = self.manifest["rows"]
        kv = rows["kv_tokens"] if self.all_tokens else rows["event_tokens"]
        want = [(self.tokens, rows["tokens"]), (self.surprise, rows["tokens"]), (self.flags, rows["tokens"]),
                (self.events, rows["events"])]
        want += [x for k, v, r in self.layer_files for x in ((k, kv), (v, kv), (r, rows["events"]))]
        return [rf.name for rf, n in want if rf.rows != n]

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
        parts = {"tokens": 0, "events": 0, "keys+values": 0, "representative keys": 0, "sketch": 0, "state": 0, "job": 0,
                 "digests": 0}
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
            if suffix in (".k", ".v", ".e"):
                parts["keys+values"] += n
            elif suffix == ".r":
                parts["representative keys"] += n
            elif suffix in (".p", ".o", ".n") or name.startswith("sketch"):
                parts["sketch"] += n
            elif name.startswith("state-"):
                parts["state"] += n
            elif name.startswith("job-"):
                parts["job"] += n
            elif name == DIGESTS:
                parts["digests"] += n
            elif name == "events.i32":
                parts["events"] += n
            elif name in ("tokens.i32", "surprise.f32", "flags.u8"):
                parts["tokens"] += n
        return parts


def remove_store(path: Path) -> None:
    """Delete the store at `path`: refused while a writer holds it (its lock is taken first) and
    for a folder that is not a store. Links inside are removed, never followed."""
    path = Path(path)
    if path.is_symlink() or not is_store(path):
        raise StoreError(f"{path} is not an emllm store")
    fd = lock_store(path)
    try:
        shutil.rmtree(path)  # fd-based on Linux: never follows a link out of the folder
    except OSError as e:
        raise StoreError(f"cannot remove {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def move_store(src: Path, dst: Path) -> None:
    """Rename the store at `src` to `dst` (which must not exist), atomically; refused while a
    writer holds it. Readers that have it open keep reading it."""
    src, dst = Path(src), Path(dst)
    if src.is_symlink() or not is_store(src):
        raise StoreError(f"{src} is not an emllm store")
    if dst.exists() or dst.is_symlink():
        raise StoreError(f"{dst} exists already")
    fd = lock_store(src)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.rename(src, dst)
    except OSError as e:
        hint = " (another file system: copy the folder, then remove the store)" if e.errno == errno.EXDEV else ""
        raise StoreError(f"cannot move {src} to {dst}: {e.strerror or e}{hint}") from None
    finally:
        os.close(fd)
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)
