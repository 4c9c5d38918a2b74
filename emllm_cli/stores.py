"""Finding stores: by name under the emllm home, by path, or the most recently written."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from core.home import stores_dir
from core.store import MANIFEST, is_store

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
    """(path, manifest) of every readable store under the home, most recently updated first."""
    out = []
    root = stores_dir()
    if root.is_dir():
        for p in root.iterdir():
            if is_store(p):
                try:
                    out.append((p, json.loads((p / MANIFEST).read_text())))
                except (OSError, ValueError):
                    out.append((p, {}))
    return sorted(out, key=lambda x: (x[1].get("updated", ""), (x[0] / MANIFEST).stat().st_mtime), reverse=True)


def existing_store(name: str | None) -> Path:
    """The store to read: `--store` if given, else the most recently written one."""
    if name is not None:
        p = store_path(name)
        if not p.exists():
            raise UserError(f"no store {name!r} (looked at {p}); list stores with `emllm inspect`")
        if not p.is_dir():
            raise UserError(f"{p} is a file, not a store (a store is a folder); list stores with `emllm inspect`")
        return p
    stores = list_stores()
    if not stores:
        raise UserError(f"no store yet under {stores_dir()}: create one with `emllm ingest FILE`")
    return stores[0][0]
