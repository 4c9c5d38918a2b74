"""The stores under the emllm home, managed as ollama manages models: found by name or path,
listed, summarised, renamed, removed. Nothing here loads torch (a listing stays instant).

    store_path("book")          # ~/.local/share/emllm/stores/book (a name), or the path as given
    list_stores()               # one row per store, most recently updated first
    summary(path)               # what one store holds
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Callable

from emllm.errors import UsageError
from emllm.home import stores_dir


def store_path(name: str) -> Path:
    """A store as a user names it: a path when it looks like one (a "/", a leading "." or "~") or
    is a store in the current folder (followed where it is a link: the user's), else a name under
    the home's stores folder (refused where that is a link). A bare name that is some other file
    or folder here stays a name: `emllm ingest proj` run beside the folder proj makes the store
    proj under the home, not in the folder it reads."""
    if not name.strip():  # Path("") is the current folder: never a store by accident
        raise UsageError("an empty store name")
    p = Path(name).expanduser()
    if "/" in name or name.startswith((".", "~")) or is_store(p):
        return p  # a path the user typed: a link in it is theirs, and followed
    p = stores_dir() / name
    if p.is_symlink():  # a name never leads out of the home, whoever put the link there
        raise UsageError(f"store {name!r} under {stores_dir()} is a symbolic link: emllm follows no link under its "
                         f"home; name the store by its path (--store {os.readlink(p)})")
    return p


def is_store(path: Path) -> bool:
    from emllm.store.manifest import is_store as has_manifest

    return has_manifest(Path(path))


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under path (links are not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(root, f))
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _manifests() -> list[tuple[Path, Any]]:
    """(path, manifest) of every store under the home, most recently updated first; a store whose
    manifest is refused comes with why instead. A link under the home is not followed."""
    from emllm.store import StoreError, read_info
    from emllm.store.manifest import MANIFEST

    out: list = []
    root = stores_dir()
    if root.is_dir():
        for p in root.iterdir():
            if not p.is_symlink() and is_store(p):
                try:
                    out.append((p, read_info(p)))
                except StoreError as e:
                    out.append((p, str(e)))
    return sorted(out, key=lambda x: ("" if isinstance(x[1], str) else x[1].updated, (x[0] / MANIFEST).lstat().st_mtime),
                  reverse=True)


def list_stores() -> list[dict]:
    """One row per store under the home, most recently updated first: name, path, status
    (complete; writing: an ingest under way in another process; incomplete: an ingest stopped
    before its end; damaged: refused when opened, with "error" saying why), model, dtype, format,
    tokens, events, bytes, updated."""
    from emllm.store.files import folder_written

    rows = []
    for path, m in _manifests():
        if isinstance(m, str):
            rows.append({"name": path.name, "path": str(path), "status": "damaged", "model": None, "dtype": None,
                         "format": None, "tokens": 0, "events": None, "bytes": folder_bytes(path), "updated": None,
                         "error": m})
            continue
        rows.append({
            "name": path.name, "path": str(path),
            "status": "complete" if m.complete else "writing" if folder_written(path) else "incomplete",
            "model": m.model, "dtype": m.geometry.dtype, "format": m.kv_format, "tokens": m.rows.tokens + m.pending,
            "events": m.rows.events, "bytes": folder_bytes(path), "updated": m.updated,
        })
    return rows


def summary(path: Path) -> dict:
    """What the store at `path` holds (opened read-only, validated): identity, profile, sizes,
    event sizes, documents, bytes on disk (`report.store_summary`); and whether an ingest is
    writing it now ("writing": another process's, its job not complete)."""
    from emllm.app.report import store_summary
    from emllm.store import Store
    from emllm.store.files import folder_written

    with Store.open(Path(path)) as st:
        out = store_summary(st)
    return {**out, "writing": not out["complete"] and folder_written(Path(path))}


def verify_store(path: Path, progress: Callable[[int, int], None] | None = None) -> dict:
    """Every committed byte of the store at `path` read and checked against its digest.

    {"store", "checked" (False: a store written before digests), "files", "bytes", "problems"
    (one line each: a file and what differs)}. progress(done, total) in bytes as it reads. A store
    whose manifest or last bytes fail the checks at open raises StoreError before any is read."""
    from emllm.store import Store

    with Store.open(Path(path)) as st:
        total, done = st.total_bytes(), 0

        def step(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total)

        v = st.verify(step)
    if v is None:
        return {"store": str(path), "checked": False, "files": 0, "bytes": 0, "problems": []}
    return {"store": str(path), "checked": True, "files": v.files, "bytes": v.bytes, "problems": [str(p) for p in v.problems]}


def remove_store(path: Path) -> None:
    """Delete a store (refused while a writer holds it, and for a folder that is not a store)."""
    from emllm.store import remove_store as remove

    remove(Path(path))


def move_store(src: Path, dst: Path) -> None:
    """Rename or move a store to `dst`, which must not exist (refused while a writer holds it)."""
    from emllm.store import move_store as move

    move(Path(src), Path(dst))


__all__ = ["store_path", "is_store", "folder_bytes", "list_stores", "summary", "verify_store", "remove_store", "move_store"]
