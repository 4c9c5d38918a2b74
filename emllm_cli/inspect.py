"""`emllm inspect`: what stores hold, and what each layer retrieves for a query."""

from __future__ import annotations

import typer

import emllm

from . import render
from .errors import UserError, guarded
from .options import StoreModelOpt
from .stores import complete_store_names, existing_store


@guarded
def inspect(
    store: str = typer.Argument(None, metavar="STORE", help="Store name or path; none: list the stores (as `emllm list`).",
                                autocompletion=complete_store_names),
    query: str = typer.Option(None, "--query", "-q", help="Show the retrieval for this question, layer by layer."),
    layer: int = typer.Option(None, "--layer", min=0, help="With --query: the events one layer retrieved."),
    top: int = typer.Option(None, "--top", min=1, help="With --query: how many retrieved events to preview (default 8)."),
    as_json: bool = typer.Option(False, "--json", help="Print everything as one JSON document."),
    model: str = StoreModelOpt,
    verify: bool = typer.Option(False, "--verify", help="Read every byte the store has committed and check it against "
                                "its digest; exit 1 if any differs. (Opening a store checks only each file's last bytes.)"),
) -> None:
    """Show the stores, one store's contents, or the per-layer retrieval of a query as a heatmap.

    Examples:

    \b
      emllm inspect                                  # list stores
      emllm inspect book                             # tokens, events, sizes, bytes on disk
      emllm inspect book --query "who hid the key?"  # layers × position, shaded by retrieval
      emllm inspect book --query "who hid the key?" --layer 12
      emllm inspect book --verify                    # every byte against its digest
    """
    if query is None and (layer is not None or top is not None or model is not None):  # ignored without a word
        raise typer.BadParameter("needs --query (it shows part of a query's retrieval)" if model is None else
                                 "needs --query (the model reads the query; without one none is loaded)",
                                 param_hint="--layer" if layer is not None else "--top" if top is not None else "--model")
    if query is not None and not query.strip():
        raise typer.BadParameter("the query is empty", param_hint="--query")
    top = 8 if top is None else top
    if verify and (store is None or query is not None):
        raise typer.BadParameter("needs a store, and no --query" if store is None else "cannot go with --query",
                                 param_hint="--verify")
    if store is None:
        if query is not None:
            raise typer.BadParameter("--query needs a store", param_hint="--query")
        from .manage import list_cmd

        list_cmd(as_json)
        return
    path = existing_store(store)
    if verify:
        _verify(path, as_json)
        return
    summary = emllm.store_summary(path)
    if query is None:
        if as_json:
            render.print_json(summary)
        else:
            render.out.print(render.store_summary(summary))
        return
    n_layers = summary["layers"]
    if layer is not None and layer >= n_layers:
        raise UserError(f"--layer {layer}: the model has {n_layers} layers (0..{n_layers - 1})")
    with render.status(f"loading the model of {render.shown(path.name)}"):
        mem = emllm.open(path, model=model, log=lambda m: render.err.print(f"[dim]{render.shown(m)}[/dim]"))
    with mem, render.status("reading the query"):
        retrieval = mem.retrieval(query, layer, top)
    if as_json:
        render.print_json({**summary, "retrieval": retrieval})
    else:
        render.out.print(render.retrieval_view(retrieval, summary["processed_tokens"]))  # the span the bins cover


def _verify(path, as_json: bool) -> None:
    with render.progress() as bar:
        task = bar.add_task(f"verifying {render.shown(path.name)}", total=None, rate="")
        report = emllm.verify_store(path, lambda done, total: bar.update(task, completed=done, total=total))
    if as_json:
        render.print_json(report)
    elif not report["checked"]:
        render.out.print(f"{render.shown(path.name)}: written before emllm kept digests of a store's bytes; only its "
                         "manifest and sizes were checked")
    elif not report["problems"]:
        render.out.print(f"{render.shown(path.name)}: every committed byte as written ({report['files']} files, "
                         f"{render.size(report['bytes'])})")
    if report["problems"]:
        more = len(report["problems"]) - 1
        more = f" (and {more} more: --json lists them)" if more and not as_json else ""
        raise UserError(f"{path}: {report['problems'][0]}{more}: the store is damaged or was edited")
