"""`emllm segment`: the event boundaries of a text, as JSON or a readable view."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import typer

import emllm

from . import render
from .errors import UserError, guarded
from .inputs import read_text
from .options import DtypeOpt, ModelOpt, ProfileOpt

# The library's methods (emllm.segment), written here so completion needs no torch (tests/test_cli.py checks they agree)
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
    methods = list(METHOD_NAMES[:-2]) if method == "all" else [method]
    if method == "all" and not with_metrics:
        raise typer.BadParameter("--method all compares methods: use it with --metrics", param_hint="--method")
    if any(m not in METHOD_NAMES[:-1] for m in methods):
        raise typer.BadParameter(f"{method!r}: choose one of {', '.join(METHOD_NAMES[:-1])} (or all)", param_hint="--method")
    if gamma is not None and not math.isfinite(gamma):
        raise typer.BadParameter(f"{gamma} is not a finite number", param_hint="--gamma")
    if gamma is not None and not any(m.startswith("S") for m in methods):  # F, FM, FC, random: no surprise
        raise typer.BadParameter(f"--method {method} does not use surprise: --gamma applies to S, SM and SC",
                                 param_hint="--gamma")
    if out is not None:
        _check_writable(out)  # before minutes of model work, not after
    text = read_text(path)
    log = lambda m: render.err.print(f"[dim]{render.shown(m)}[/dim]")  # noqa: E731
    with render.status(f"loading {render.shown(model or emllm.default_model())}"):
        loaded = emllm.load(model, profile, dtype, log)
    t0 = time.perf_counter()
    with render.progress() as bar:
        task = bar.add_task("reading", total=None, rate="")

        def show(done: int, total: int) -> None:
            bar.update(task, total=total, completed=done, rate=f"{done / (time.perf_counter() - t0):.0f} tok/s")

        try:
            docs = emllm.segment(text, loaded, methods, gamma=gamma, seed=seed, metrics=with_metrics, progress=show)
        except emllm.UsageError as e:
            raise UserError(f"{path}: {e}" if str(e) == "no tokens in the text" else str(e)) from None
    n_tokens = next(iter(docs.values()))["tokens"]
    name = loaded.given or loaded.name
    if method == "all":
        table = {m: d["difference_to_random"] for m, d in docs.items()}
        if as_json or out:
            payload = {"model": name, "tokens": n_tokens, "difference_to_random": table,
                       "methods": {m: {"events": len(d["events"]), **d["metrics"]} for m, d in docs.items()},
                       "random": {m: d["random_metrics"] for m, d in docs.items()}}
            _emit(payload, out, as_json)
        else:
            render.out.print(render.metrics_table(table, n_tokens))
        return
    doc = docs[method]
    if out or as_json:
        _emit(doc, out, as_json)
    else:
        render.out.print(render.events_view(text, doc))
        if with_metrics:  # computed: shown, not dropped
            render.out.print(render.metrics_table({method: doc["difference_to_random"]}, n_tokens))


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
