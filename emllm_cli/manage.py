"""`emllm list`, `show`, `rm`, `mv`: the stores under the emllm home, managed as ollama manages
models (`list`, `show`, `rm`) and a shell moves files (`mv`). Nothing here loads torch."""

from __future__ import annotations

import typer

import emllm

from . import render
from .errors import UserError, guarded
from .stores import complete_store_names, existing_store, store_path


@guarded
def list_cmd(as_json: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
    """List the stores under the emllm home: status, model, format, tokens, size, last update.

    A store being written has an ingest under way in another process; an incomplete one has an
    ingest that stopped before its end (`emllm ingest --resume`); a damaged one is refused when
    opened (the error says why).
    """
    rows = emllm.list_stores()
    if as_json:
        render.print_json({"stores": rows})
    elif not rows:
        render.err.print(f"no stores under {render.shown(emllm.stores_dir())}; create one with `emllm ingest FILE`")
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
    summary = emllm.store_summary(existing_store(store))
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
    paths = [existing_store(s) for s in stores]  # every name checked before anything is removed
    if not yes:
        if not render.err.is_terminal:
            raise UserError("not removing without a terminal to ask in: add --yes")
        what = ", ".join(render.shown(p.name) for p in paths)
        size = sum(emllm.folder_bytes(p) for p in paths)
        if not typer.confirm(f"remove {what} ({size / 2**20:.1f} MiB)?", default=False, err=True):
            raise typer.Exit(1)
    removed = []
    for p in paths:
        emllm.remove_store(p)
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
    src = existing_store(store)
    dst = store_path(new)
    emllm.move_store(src, dst)
    if as_json:
        render.print_json({"from": str(src), "to": str(dst)})
    else:
        render.err.print(f"moved {render.shown(src)} to {render.shown(dst)}")


__all__ = ["list_cmd", "show", "rm", "mv"]
