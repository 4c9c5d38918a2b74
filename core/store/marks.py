"""Marks: cut a store back to an earlier commit (the passkey grid's shared prefixes)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

from emllm.store.errors import CutBackFailed, StoreError, lock_store
from emllm.store.files import fsync_dir, write_atomic
from emllm.store.manifest import MANIFEST, read_manifest


# -- marks: cut a store back to an earlier commit ---------------------------------------------------
def save_mark(path: Path, mark: Path) -> None:
    """Save in the new folder `mark` what cuts the store at `path` back to its present commit later
    (cut_back): its manifest and the files it names that later commits replace (state, job), a few
    MB. Arrays are append-only, so the rows past the saved counts are all a cut drops. The store
    must be closed (its writer lock is taken meanwhile); a sketch is refused (refits rewrite it).
    Files of the caller's may be added to the mark: they are not put back."""
    fd = lock_store(path)
    try:
        manifest = read_manifest(path)
        if manifest.get("sketch"):
            raise StoreError(f"{path} has a sketch: it cannot be marked and cut back")
        tmp = mark.with_name(mark.name + ".tmp")  # a mark cut short is never taken for one
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for part in ("state", "job"):
            if manifest.get(part):
                write_atomic(tmp / manifest[part]["file"], (path / manifest[part]["file"]).read_bytes())
        write_atomic(tmp / MANIFEST, (path / MANIFEST).read_bytes())
        write_atomic(tmp / MARK_NOTE, json.dumps({"tokens_sha256": _tokens_hash(path, manifest)}).encode())
        shutil.rmtree(mark, ignore_errors=True)
        tmp.rename(mark)
        fsync_dir(mark.parent)
    finally:
        os.close(fd)


def cut_back(path: Path, mark: Path) -> None:
    """Bring the store at `path` back to the commit saved in `mark` by save_mark (the mark stays).
    The files the mark's manifest names are put back before the manifest, so a crash at any moment
    leaves the store at its last commit or at the mark's, and a second call finishes the first;
    the writer's next open truncates the rows past the mark's counts (so no reader may have the
    store open). A mark that is another store's or damaged raises StoreError before anything is
    written; a failed write (a full disk) raises CutBackFailed, and the store and the mark stay."""
    fd = lock_store(path)
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
            write_atomic(path / MANIFEST, (mark / MANIFEST).read_bytes())
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
        write_atomic(dst, src.read_bytes())  # another file system, or one without hard links
        return
    os.replace(tmp, dst)
    tmp.unlink(missing_ok=True)  # rename leaves both names when they were links to one file already
    fsync_dir(dst.parent)


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
