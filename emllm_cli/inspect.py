"""`emllm inspect`: what stores hold, and what each layer retrieves for a query."""

from __future__ import annotations

import typer

from . import render
from .errors import UserError, guarded
from .stores import existing_store, folder_bytes, list_stores

BINS = 64
PREVIEW = 70


@guarded
def inspect(
    store: str = typer.Argument(None, metavar="STORE", help="Store name or path; none: list the stores."),
    query: str = typer.Option(None, "--query", "-q", help="Show the retrieval for this question, layer by layer."),
    layer: int = typer.Option(None, "--layer", "-l", min=0, help="With --query: the events one layer retrieved."),
    top: int = typer.Option(None, "--top", min=1, help="With --query: how many retrieved events to preview (default 8)."),
    as_json: bool = typer.Option(False, "--json", help="Print everything as one JSON document."),
) -> None:
    """Show the stores, one store's contents, or the per-layer retrieval of a query as a heatmap.

    Examples:

    \b
      emllm inspect                                  # list stores
      emllm inspect book                             # tokens, events, sizes, bytes on disk
      emllm inspect book --query "who hid the key?"  # layers × position, shaded by retrieval
      emllm inspect book --query "who hid the key?" --layer 12
    """
    if query is None and (layer is not None or top is not None):  # they would be ignored without a word
        raise typer.BadParameter("needs --query (it shows part of a query's retrieval)",
                                 param_hint="--layer" if layer is not None else "--top")
    if query is not None and not query.strip():
        raise typer.BadParameter("the query is empty", param_hint="--query")
    top = 8 if top is None else top
    if store is None:
        if query is not None:
            raise typer.BadParameter("--query needs a store", param_hint="--query")
        _list(as_json)
        return
    from emllm.store import Store

    path = existing_store(store)
    with Store.open(path) as st:
        summary = _summary(st)
        if query is None:
            if as_json:
                render.print_json(summary)
            else:
                render.out.print(render.store_summary(summary))
            return
        retrieval = _retrieval(st, query, layer, top)
    if as_json:
        render.print_json({**summary, "retrieval": retrieval})
    else:
        render.out.print(render.retrieval_view(retrieval, summary["processed_tokens"]))  # the span the bins cover


def _list(as_json: bool) -> None:
    rows = []
    for path, m in list_stores():
        rows.append({
            "name": path.name, "path": str(path), "model": m.get("identity", {}).get("model"),
            "tokens": m.get("rows", {}).get("tokens", 0) + _pending(m), "events": m.get("rows", {}).get("events"),
            "bytes": folder_bytes(path), "updated": m.get("updated"),
            **({"error": m["error"]} if "error" in m else {}),
        })
    if as_json:
        render.print_json({"stores": rows})
    elif not rows:
        from emllm.home import stores_dir

        render.err.print(f"no stores under {stores_dir()}; create one with `emllm ingest FILE`")
    else:
        render.out.print(render.stores_table(rows))


def _pending(m: dict) -> int:
    job = m.get("job") or {}
    return job.get("tokens", 0) - job.get("done", 0)


def _summary(st) -> dict:
    import torch

    m = st.manifest
    lengths = st.events.read().long()
    hist: dict[str, int] = {}
    if lengths.numel():
        lo, hi = m["profile"]["min_block"], m["profile"]["max_block"]
        edges = sorted({lo, *[2**i for i in range(1, 12) if lo < 2**i < hi], hi + 1})
        idx = torch.bucketize(lengths, torch.tensor(edges), right=True) - 1
        counts = torch.bincount(idx.clamp(0, len(edges) - 2), minlength=len(edges) - 1)
        hist = {f"{edges[i]}-{edges[i + 1] - 1}": int(c) for i, c in enumerate(counts.tolist())}
    job = m.get("job") or {}
    return {
        "store": str(st.path), "format_version": m["version"], "model": m["identity"]["model"],
        "identity": m["identity"], "profile": m["profile"], "created": m["created"], "updated": m["updated"],
        "tokens": m["rows"]["tokens"] + _pending(m),
        "processed_tokens": m["rows"]["tokens"], "events": m["rows"]["events"],
        "event_tokens": m["rows"]["event_tokens"],
        "mean_event_size": round(float(lengths.float().mean()), 2) if lengths.numel() else None,
        "event_sizes": hist, "documents": m["documents"], "complete": bool(job.get("complete", True)),
        "bytes": st.bytes_on_disk(),
    }


def _retrieval(st, query: str, layer: int | None, top: int) -> dict:
    from emllm.app import ingest as ing
    from emllm import models
    from emllm.app.ask import Session
    from emllm.app.trace import Trace

    name = st.manifest["identity"]["model"]
    src = models.resolve(name, log=lambda m: render.err.print(f"[dim]{render.shown(m)}[/dim]"))
    mdl, tok = models.load(src)
    st.check_identity(ing.identity_of(name, mdl, tok))
    n_layers = st.geometry.layers
    if layer is not None and layer >= n_layers:
        raise UserError(f"--layer {layer}: the model has {n_layers} layers (0..{n_layers - 1})")
    session = Session(st, mdl, tok)
    trace = Trace.attach(session.engine)
    session.read_question(query)
    trace.detach()
    return retrieval_doc(trace, st, tok, query, layer, top)


def retrieval_doc(trace, st, tok, query: str, layer: int | None = None, top: int = 8) -> dict:
    """The retrieval recorded in `trace` as data: coverage heatmap, most retrieved events, one layer."""
    n_layers = st.geometry.layers
    n = st.manifest["rows"]["tokens"]
    cov = trace.coverage(n, BINS) if n else None
    counts = trace.counts()  # [layers, E]
    spans = trace.event_spans()
    ids = st.tokens.read()

    def event(e: int, score: float | None = None) -> dict:
        s, t = spans[e].tolist()
        d = {"event": e, "tokens": [s, t], "layers": int((counts[:, e] > 0).sum()),
             "preview": tok.decode(ids[s:t].tolist(), skip_special_tokens=True)[:PREVIEW]}
        if score is not None:
            d["score"] = round(score, 4)
        return d

    by_layers = (counts > 0).sum(0)
    order = torch_argsort_desc(by_layers)[:top]
    out = {
        "query": query, "layers": n_layers, "bins": BINS, "steps": trace._step + 1,
        "coverage": [[round(x, 3) for x in row] for row in cov.tolist()] if cov is not None else [],
        "top_events": [event(int(e)) for e in order if by_layers[e] > 0],
    }
    if layer is not None:
        recs = [r for r in trace.records if r.layer == layer]
        out["layer"] = {"index": layer, "steps": [
            {"step": r.step, "events": [event(int(e), float(s)) for e, s in zip(r.ids, r.scores)]} for r in recs]}
    return out


def torch_argsort_desc(x):
    import torch

    return torch.sort(x, descending=True, stable=True).indices.tolist()
