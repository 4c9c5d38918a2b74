"""Finding stores for a command: `--store` as given, or the most recently written (the rules are
the library's: `emllm.store_path`, `emllm.list_stores`)."""

from __future__ import annotations

from pathlib import Path

import typer

import emllm

from .errors import UserError


def store_path(name: str | None) -> Path:
    """`--store` as given: a path when it looks like one or is a store here, else a name under the
    home (`emllm.store_path`)."""
    if name is None:
        raise ValueError("no store name")
    if not name.strip():
        raise typer.BadParameter("an empty store name")  # --store, or inspect's STORE
    return emllm.store_path(name)


def existing_store(name: str | None) -> Path:
    """The store to read: `--store` if given, else the most recently written one."""
    if name is not None:
        p = store_path(name)
        if not p.exists():
            raise UserError(f"no store {name!r} (looked at {p}); list stores with `emllm list`")
        if not p.is_dir():
            raise UserError(f"{p} is a file, not a store (a store is a folder); list stores with `emllm list`")
        return p
    stores = emllm.list_stores()
    if not stores:
        raise UserError(f"no store yet under {emllm.stores_dir()}: create one with `emllm ingest FILE`")
    from . import render

    path = Path(stores[0]["path"])
    render.err.print(f"[dim]store {render.shown(path.name)} (the most recently updated; choose with --store)[/dim]")
    return path


def complete_store_names(incomplete: str) -> list[str]:
    """Shell completion of store names: the folders under the home (no manifest read, no torch)."""
    root = emllm.stores_dir()
    try:
        names = [p.name for p in root.iterdir() if not p.name.startswith(".") and emllm.is_store(p)]
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(incomplete))
