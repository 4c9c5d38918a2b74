"""`emllm segment`: the event boundaries of a text, as JSON or a readable view."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import typer

from . import render
from .errors import UserError, guarded
from .inputs import read_text
from .options import DtypeOpt, ModelOpt, ProfileOpt

PREVIEW = 60


# emllm.app.document.METHODS, written here so completion needs no torch (tests/test_cli.py checks they agree)
METHOD_NAMES = ("F", "S", "SM", "SC", "FM", "FC", "random", "all")


@guarded
def segment(
    path: str = typer.Argument(..., metavar="PATH", help="A text file, or - for stdin."),
    method: str = typer.Option("S", "--method", help="F, S, SM, SC, FM, FC, random; 'all' with --metrics.",
                               autocompletion=lambda incomplete: [m for m in METHOD_NAMES if m.startswith(incomplete)]),
    gamma: float = typer.Option(None, "--gamma", help="Surprise threshold: mean + gamma * std (default: the profile's)."),
    model: str = ModelOpt,
    profile: str = ProfileOpt,
    dtype: str = DtypeOpt,
    out: Path = typer.Option(None, "--out", "-o", help="Write the JSON document to this file."),
    with_metrics: bool = typer.Option(False, "--metrics", help="Also score the segmentation against random."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random segmentation."),
    as_json: bool = typer.Option(False, "--json", help="Print the JSON document on stdout."),
) -> None:
    """Cut a text into events: fixed blocks (F), surprise (S), refined by modularity (M) or conductance (C).

    Examples:

    \b
      emllm segment book.txt --method SM --out boundaries.json
      emllm segment notes.md --metrics --method all
    """
    from emllm.app import document
    from emllm import models
    from emllm.engine.stream import Engine

    methods = list(document.METHODS[:-1]) if method == "all" else [method]
    if method == "all" and not with_metrics:
        raise typer.BadParameter("--method all compares methods: use it with --metrics", param_hint="--method")
    if any(m not in document.METHODS for m in methods):
        raise typer.BadParameter(f"{method!r}: choose one of {', '.join(document.METHODS)} (or all)", param_hint="--method")
    if gamma is not None and not math.isfinite(gamma):
        raise typer.BadParameter(f"{gamma} is not a finite number", param_hint="--gamma")
    if gamma is not None and not any(m.startswith("S") for m in methods):  # F, FM, FC, random: no surprise
        raise typer.BadParameter(f"--method {method} does not use surprise: --gamma applies to S, SM and SC",
                                 param_hint="--gamma")
    if out is not None:
        _check_writable(out)  # before minutes of model work, not after
    text = read_text(path)
    src = models.resolve(model, profile, log=lambda m: render.err.print(f"[dim]{render.shown(m)}[/dim]"))
    prof = src.profile.replace(segmentation="S", **({"gamma": gamma} if gamma is not None else {}))
    with render.status(f"loading {render.shown(src.name)}"):
        mdl, tok = models.load(src, dtype=dtype)
    if not getattr(tok, "is_fast", False):
        raise UserError(f"the tokenizer of {src.name} has no fast (Rust) version: segment needs its character offsets")
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if not ids:
        raise UserError(f"{path}: no tokens in the text")
    import torch

    t0 = time.perf_counter()
    with render.progress() as bar:
        task = bar.add_task("reading", total=len(ids), rate="")
        a = document.analyse(Engine(mdl, prof), torch.tensor(ids),
                             progress=lambda r: bar.update(task, completed=r.tokens_done,
                                                           rate=f"{r.tokens_done / (time.perf_counter() - t0):.0f} tok/s"))
    args = (prof.min_block, prof.max_block, prof.chunk_size)
    docs = {}
    for m in methods:
        starts = document.boundaries(a, m, *args, seed=seed)
        docs[m] = _doc(src.name, m, prof, text, ids, offsets, starts, a)
        if with_metrics:  # against random segmentation with the same number of events
            rand = document.random_like(len(ids), starts.numel(), prof.min_block, seed)
            docs[m]["metrics"] = document.metrics(a, starts, prof.chunk_size)
            docs[m]["random_metrics"] = document.metrics(a, rand, prof.chunk_size)
    if method == "all":
        table = {m: {k: d["metrics"][k] - d["random_metrics"][k] for k in d["metrics"]} for m, d in docs.items()}
        if as_json or out:
            payload = {"model": src.name, "tokens": len(ids), "difference_to_random": table,
                       "methods": {m: {"events": len(d["events"]), **d["metrics"]} for m, d in docs.items()},
                       "random": {m: d["random_metrics"] for m, d in docs.items()}}
            _emit(payload, out, as_json)
        else:
            render.out.print(render.metrics_table(table, len(ids)))
        return
    doc = docs[method]
    if out or as_json:
        _emit(doc, out, as_json)
    else:
        render.out.print(render.events_view(text, doc))
        if with_metrics:  # computed: shown, not dropped
            render.out.print(render.metrics_table({method: {k: doc["metrics"][k] - doc["random_metrics"][k]
                                                            for k in doc["metrics"]}}, len(ids)))


def _doc(model, method, prof, text, ids, offsets, starts, a) -> dict:
    from emllm.app.document import char_ranges

    st = starts.tolist()
    ends = st[1:] + [len(ids)]
    chars = char_ranges(offsets, st, len(text))
    events = []
    for i, (s, e, (c0, c1)) in enumerate(zip(st, ends, chars)):
        sup = a.surprise[s]
        events.append({"index": i, "tokens": [s, e], "chars": [c0, c1],
                       "surprise": None if sup != sup else round(float(sup), 3),
                       "preview": text[c0:c1][:PREVIEW]})
    return {"model": model, "method": method,
            "parameters": {"gamma": prof.gamma, "tau": prof.surprise_window, "min_block": prof.min_block,
                           "max_block": prof.max_block, "chunk_size": prof.chunk_size, "n_local": prof.n_local},
            "tokens": len(ids), "characters": len(text), "events": events}


def _check_writable(out: Path) -> None:
    if out.is_dir():
        raise UserError(f"--out {out}: is a directory; give a file name")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"--out {out}: no folder {parent}")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise UserError(f"--out {out}: not writable")


def _emit(doc: dict, out: Path | None, as_json: bool) -> None:
    if as_json:  # printed first: a failing write below must not lose the result
        render.print_json(doc)
    if out:
        tmp = out.with_name(out.name + ".tmp")
        try:
            tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            tmp.replace(out)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise UserError(f"--out {out}: cannot write: {e.strerror}") from None
        render.err.print(f"wrote {len(doc.get('events', []))} events to {out}" if "events" in doc else f"wrote {out}")
