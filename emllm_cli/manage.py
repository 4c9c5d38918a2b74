"""`emllm list`, `show`, `rm`, `mv`: the stores under the emllm home, managed as ollama manages
models (`list`, `show`, `rm`) and a shell moves files (`mv`). Nothing here loads torch."""

from __future__ import annotations

from pathlib import Path

import typer

from . import render
from .errors import UserError, guarded
from .stores import complete_store_names, existing_store, folder_bytes, list_stores, store_path


def store_rows() -> list[dict]:
    """One row per store under the home, most recently updated first."""
    from emllm.store.manifest import pending_count

    rows = []
    for path, m in list_stores():
        if "error" in m:
            status = "damaged"
        else:
            job = m.get("job") or {}
            status = "complete" if job.get("complete", True) else "incomplete"
        rows.append({
            "name": path.name, "path": str(path), "status": status,
            "model": (m.get("identity") or {}).get("model"), "dtype": (m.get("geometry") or {}).get("dtype"),
            "format": m.get("kv_format") or (m.get("geometry") or {}).get("dtype"),
            "tokens": (m.get("rows") or {}).get("tokens", 0) + (pending_count(m) if status != "damaged" else 0),
            "events": (m.get("rows") or {}).get("events"),
            "bytes": folder_bytes(path), "updated": m.get("updated"),
            **({"error": m["error"]} if "error" in m else {}),
        })
    return rows


@guarded
def list_cmd(as_json: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
    """List the stores under the emllm home: status, model, format, tokens, size, last update.

    An incomplete store has an ingest that stopped before its end (`emllm ingest --resume`); a
    damaged one is refused when opened (the error says why).
    """
    rows = store_rows()
    if as_json:
        render.print_json({"stores": rows})
    elif not rows:
        from emllm.home import stores_dir

        render.err.print(f"no stores under {render.shown(stores_dir())}; create one with `emllm ingest FILE`")
    else:
        render.print_stores(rows)


@guarded
def show(
    store: str = typer.Argument(..., metavar="STORE", help="Store name or path.", autocompletion=complete_store_names),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """What one store holds: model, profile, tokens, events, documents, bytes on disk.

    Examples:

    \b
      emllm show book
      emllm show book --json
    """
    from emllm.app.report import store_summary
    from emllm.store import Store

    with Store.open(existing_store(store)) as st:
        summary = store_summary(st)
    if as_json:
        render.print_json(summary)
    else:
        render.out.print(render.store_summary(summary))


@guarded
def rm(
    stores: list[str] = typer.Argument(..., metavar="STORE...", help="Store names or paths.",
                                       autocompletion=complete_store_names),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask."),
    as_json: bool = typer.Option(False, "--json", help="Print what was removed as one JSON document."),
) -> None:
    """Remove stores (asks first unless --yes; a store being written is refused).

    Examples:

    \b
      emllm rm book
      emllm rm old-notes draft --yes
    """
    from emllm.store.store import remove_store

    paths = [existing_store(s) for s in stores]  # every name checked before anything is removed
    if not yes:
        if not render.err.is_terminal:
            raise UserError("not removing without a terminal to ask in: add --yes")
        what = ", ".join(render.shown(p.name) for p in paths)
        size = sum(folder_bytes(p) for p in paths)
        if not typer.confirm(f"remove {what} ({size / 2**20:.1f} MiB)?", default=False, err=True):
            raise typer.Exit(1)
    removed = []
    for p in paths:
        remove_store(p)
        removed.append(str(p))
        if not as_json:
            render.err.print(f"removed {render.shown(p)}")
    if as_json:
        render.print_json({"removed": removed})


@guarded
def mv(
    store: str = typer.Argument(..., metavar="STORE", help="Store name or path.", autocompletion=complete_store_names),
    new: str = typer.Argument(..., metavar="NEW", help="New name (under the emllm home) or path."),
    as_json: bool = typer.Option(False, "--json", help="Print the old and new paths as one JSON document."),
) -> None:
    """Rename or move a store (a store being written is refused).

    Examples:

    \b
      emllm mv book book-v1
      emllm mv book /data/stores/book
    """
    from emllm.store.store import move_store

    src = existing_store(store)
    dst = store_path(new)
    move_store(src, dst)
    if as_json:
        render.print_json({"from": str(src), "to": str(dst)})
    else:
        render.err.print(f"moved {render.shown(src)} to {render.shown(dst)}")


__all__ = ["list_cmd", "show", "rm", "mv", "store_rows", "Path"]
