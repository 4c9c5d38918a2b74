"""Finding stores: by name under the emllm home, by path, or the most recently written."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import typer

from emllm.home import stores_dir
from emllm.store.manifest import MANIFEST, is_store

from .errors import UserError


def store_path(name: str | None) -> Path:
    """`--store` as given: a path when it looks like one or exists, else a name under the home."""
    if name is None:
        raise ValueError("no store name")
    if not name.strip():  # Path("") is the current folder: never a store by accident
        raise typer.BadParameter("an empty store name")  # --store, or inspect's STORE
    p = Path(name).expanduser()
    if "/" in name or name.startswith(".") or p.exists():
        return p
    return stores_dir() / name


def list_stores() -> list[tuple[Path, dict]]:
    """(path, manifest) of every store under the home, most recently updated first; a store whose
    manifest is refused comes with {"error": why} instead."""
    from emllm.store import StoreError, read_manifest

    out = []
    root = stores_dir()
    if root.is_dir():
        for p in root.iterdir():
            if not p.is_symlink() and is_store(p):
                try:
                    out.append((p, read_manifest(p)))
                except StoreError as e:
                    out.append((p, {"error": str(e)}))
    return sorted(out, key=lambda x: (str(x[1].get("updated", "")), (x[0] / MANIFEST).lstat().st_mtime), reverse=True)


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under path (links are not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(root, f))
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def existing_store(name: str | None) -> Path:
    """The store to read: `--store` if given, else the most recently written one."""
    if name is not None:
        p = store_path(name)
        if not p.exists():
            raise UserError(f"no store {name!r} (looked at {p}); list stores with `emllm list`")
        if not p.is_dir():
            raise UserError(f"{p} is a file, not a store (a store is a folder); list stores with `emllm list`")
        return p
    stores = list_stores()
    if not stores:
        raise UserError(f"no store yet under {stores_dir()}: create one with `emllm ingest FILE`")
    from . import render

    path = stores[0][0]
    render.err.print(f"[dim]store {render.shown(path.name)} (the most recently updated; choose with --store)[/dim]")
    return path


def complete_store_names(incomplete: str) -> list[str]:
    """Shell completion of store names: the folders under the home (no manifest read, no torch)."""
    root = stores_dir()
    try:
        names = [p.name for p in root.iterdir() if not p.name.startswith(".") and (p / MANIFEST).is_file()]
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(incomplete))
