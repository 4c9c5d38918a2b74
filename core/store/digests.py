"""Digests of a store's committed bytes: what ties its files to what its manifest says they hold.

Every append-only file is cut into blocks of `BLOCK` bytes. A complete block's SHA-256 is a record
of `digests.bin` (append-only like the rest; the manifest counts its committed records), the
partial block at a file's committed end has its digest in the manifest (`digests.tails`). Each
digest covers the store's layout too (geometry, keys-and-values format, equaliser, representative
heads) and the file's name and row shape, so a manifest edited to claim another format, or a file
put in another's place, fails on the same bytes.

At open, every file's tail is checked (at most one block a file: cheap); `verify` reads every
committed byte (`emllm inspect --verify`). Blocks appended since the last commit are hashed at the
commit, read back from the page cache. The manifest's checksum and these digests catch accidents
and edits; anyone can recompute both, so a store from someone else is also checked as it is read
(keys and values that are not finite are refused).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from emllm.store.errors import StoreError
from emllm.store.rows import RowFile

BLOCK = 1 << 16  # bytes a record covers
NAME = "digests.bin"
RECORD = 48  # bytes: the file's key (8), the block's number (8, little-endian), its SHA-256 (32)
_READ = 1 << 24  # bytes read at a time by `verify`

LAYOUT_KEYS = ("geometry", "kv_format", "key_equaliser", "repr_heads")


def layout_tag(manifest: dict) -> bytes:
    """What the bytes mean: the manifest's fields that say how rows are laid out and decoded."""
    return json.dumps({k: manifest.get(k) for k in LAYOUT_KEYS}, sort_keys=True).encode()


def file_key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()[:8]


def block_digest(tag: bytes, rf: RowFile, block: int, data: bytes | memoryview) -> bytes:
    h = hashlib.sha256(tag)
    h.update(f"\0{rf.name}\0{rf.row}\0{rf.dtype}\0{block}\0".encode())
    h.update(data)
    return h.digest()


def committed_bytes(rf: RowFile) -> int:
    return rf.rows * rf.row_bytes


def _read(rf: RowFile, start: int, stop: int) -> bytes:
    """Bytes [start, stop) of a store's file (pread through its descriptor)."""
    fd, out, pos = rf._reader_fd(), bytearray(), start
    while pos < stop:
        got = os.pread(fd, stop - pos, pos)
        if not got:
            break  # truncated: the digest then differs
        out += got
        pos += len(got)
    return bytes(out)


def _tail(tag: bytes, rf: RowFile) -> str:
    n = committed_bytes(rf)
    return block_digest(tag, rf, n // BLOCK, _read(rf, n - n % BLOCK, n)).hex()


@dataclass
class Problem:
    name: str
    what: str

    def __str__(self) -> str:
        return f"{self.name} {self.what}"


@dataclass
class Verified:
    """What `verify` read, and each file whose bytes differ from their digests."""

    files: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)


class Digests:
    """A store's digests: the records file and the tails, sealed at each commit by its writer."""

    def __init__(self, folder, manifest: dict, files: Iterable[RowFile], writable: bool) -> None:
        entry = manifest.get("digests") or {"records": 0, "tails": {}}
        self.manifest = manifest
        self.records = RowFile(folder, NAME, (RECORD,), torch.uint8, entry["records"], writable)
        self.tails: dict[str, str] = dict(entry["tails"])
        # complete blocks each file has records for (committed): a writer hashes only the ones after
        self.sealed = {rf.name: committed_bytes(rf) // BLOCK for rf in files}

    def tag(self) -> bytes:
        return layout_tag(self.manifest)

    def check_open(self, files: list[RowFile]) -> list[Problem]:
        """The tails of every file the manifest names, and no tail of a file it does not name."""
        tag, names = self.tag(), {rf.name for rf in files}
        out = [Problem(n, "has a digest but is not one of the store's files") for n in sorted(set(self.tails) - names)]
        for rf in files:
            want = self.tails.get(rf.name)
            if want is None:
                out.append(Problem(rf.name, "has no digest"))
            elif _tail(tag, rf) != want:
                out.append(Problem(rf.name, "ends in bytes that differ from their digest (edited, damaged, or "
                                            "read in another format than they were written in)"))
        try:
            self.records.check_size()
        except StoreError:
            out.append(Problem(NAME, "is truncated or missing"))
        return out

    def seal(self, files: list[RowFile]) -> dict:
        """Hash what `files` hold past their sealed blocks (appending a record per complete block),
        sync the records; the manifest entry to commit with them."""
        tag, tails, new, sealed = self.tag(), {}, [], {}
        for rf in files:
            n = committed_bytes(rf)
            first, last = self.sealed.get(rf.name, 0), n // BLOCK
            if last > first:
                data = _read(rf, first * BLOCK, last * BLOCK)
                key = file_key(rf.name)
                for b in range(first, last):  # (a commit's new blocks: a few per file)
                    off = (b - first) * BLOCK
                    new.append(key + b.to_bytes(8, "little") + block_digest(tag, rf, b, memoryview(data)[off : off + BLOCK]))
            sealed[rf.name] = last
            tails[rf.name] = _tail(tag, rf)
        if new:
            self.records.append(torch.frombuffer(bytearray(b"".join(new)), dtype=torch.uint8).reshape(-1, RECORD))
        self.records.sync()
        self.sealed.update(sealed)  # only once their records are written: a failed seal is done again whole
        self.tails = tails
        return {"file": NAME, "block": BLOCK, "records": self.records.rows, "tails": tails}

    def verify(self, files: list[RowFile], progress: Callable[[int], None] | None = None) -> Verified:
        """Every committed byte of `files` against its digest. progress(bytes) after each read.
        (The tails are the store's open's to check: `Store.open` refused the store if one failed.)"""
        out = Verified()
        raw = self.records.read_copy(0, self.records.rows).numpy() if self.records.rows else np.zeros((0, RECORD), np.uint8)
        keys, blocks = raw[:, :8].copy().view("<u8").ravel(), raw[:, 8:16].copy().view("<u8").ravel()
        tag = self.tag()
        for rf in files:
            n, key, bad = committed_bytes(rf), file_key(rf.name), []
            out.files += 1
            # this file's records, the last of each block (a block hashed again after a crash or a cut back)
            mine = np.flatnonzero(keys == np.frombuffer(key, "<u8")[0])[::-1]
            _, first = np.unique(blocks[mine], return_index=True)
            have = {int(blocks[i]): raw[i, 16:].tobytes() for i in mine[first]}
            for start in range(0, n - n % BLOCK, _READ):
                stop = min(start + _READ, n - n % BLOCK)
                data = memoryview(_read(rf, start, stop))
                for off in range(0, stop - start, BLOCK):
                    b = (start + off) // BLOCK
                    if have.get(b) != block_digest(tag, rf, b, data[off : off + BLOCK]):
                        bad.append(b)
                out.bytes += stop - start
                if progress is not None:
                    progress(stop - start)
            out.bytes += n % BLOCK
            if bad:
                span = f"bytes {bad[0] * BLOCK}-{(bad[-1] + 1) * BLOCK - 1}"
                out.problems.append(Problem(rf.name, f"has {len(bad)} block(s) that differ from their digests ({span})"))
        return out

    def close(self) -> None:
        self.records.close()
