"""`emllm passkey`: the paper's passkey retrieval test as a grid of lengths x depths."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Group
from rich.live import Live

from . import render
from .errors import UserError, guarded
from .options import DtypeOpt, FormatOpt, ModelOpt, ProfileOpt


def _items(value: str, what: str, example: str) -> list[str]:
    items = value.split(",")
    if any(not x.strip() for x in items):  # "4k,,16k": a typo, not a shorter grid
        raise typer.BadParameter(f"a comma-separated list of {what}, none empty: {value!r} (e.g. {example})")
    return items


def _lengths(value: str) -> list[int]:
    from emllm.evals.passkey import parse_length

    try:
        return list(dict.fromkeys(parse_length(x) for x in _items(value, "lengths", "4k,16k")))  # each once
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _depths(value: str) -> list[float]:
    items = _items(value, "depths", "0,0.5,1")
    try:
        d = [float(x) for x in items]
    except ValueError:
        raise typer.BadParameter(f"not a list of numbers: {value!r} (e.g. 0,0.5,1)") from None
    if not d or any(not 0 <= x <= 1 for x in d):
        raise typer.BadParameter("depths must lie in [0, 1], e.g. 0,0.25,0.5,0.75,1")
    return list(dict.fromkeys(d))  # a cell named twice is one cell (its trials were counted twice)


@guarded
def passkey(
    lengths: str = typer.Option("4k,16k,32k", "--lengths", "-l", callback=lambda v: _lengths(v), help="Prompt lengths in tokens: 4k, 16k, 1m, 1500000 ..."),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", "--depths", "-d", callback=lambda v: _depths(v), help="Needle depths in [0, 1]."),
    trials: int = typer.Option(2, "--trials", "-t", min=1, help="Trials per cell (a new key each)."),
    seed: int = typer.Option(0, "--seed", help="Keys and prompts depend only on the seed and the cell."),
    baseline: bool = typer.Option(False, "--baseline", help="Also run the plain model, truncated from the left to its context."),
    reread: bool = typer.Option(False, "--reread", help="Also answer as `emllm ask --reread` does, from emllm's same read of each prompt (one more forward over emllm's attention span per trial); its rows say whether the passages read again held the needle."),
    model: str = ModelOpt,
    profile: str = ProfileOpt,
    dtype: str = DtypeOpt,
    kv_format: str = FormatOpt,
    memory_dir: Path = typer.Option(None, "--memory-dir", file_okay=False, help="Keep emllm's memory on disk, in temporary stores under this folder (removed at the end; with --resume, kept until the grid completes): RAM stays bounded. Needed from a few hundred thousand tokens (SmolLM2 keeps 46 kB of keys and values per token). The filler before the needles, the same in every haystack, is then read once for the whole grid (trials run in the order of their needle's position; same results), at the cost of up to two stores' size on disk (with less free, a trial continues the shared store itself, which is cut back after it)."),
    resume: bool = typer.Option(False, "--resume", help="With --memory-dir: keep the grid's progress there (the trials answered, and the stores of the filler and of the trial under way, committed every 64 chunks), so that the same command, run again after a kill, a crash or Ctrl-C, carries on where it stopped instead of starting over. Removed when the grid completes."),
    as_json: bool = typer.Option(False, "--json", help="Print all results as one JSON document. Progress goes to stderr on a terminal; elsewhere set EMLLM_PROGRESS=60 for a line a minute."),
) -> None:
    """Hide a 5-digit key at each depth of a filler haystack and ask for it.

    Scored by the first integer of the answer. Each cell is filled as its trials finish.

    Examples:

    \b
      emllm passkey --lengths 16k,32k --trials 2 --baseline
      emllm passkey --lengths 16k --reread
      emllm passkey -l 4k -d 0.5 -t 1 --json
      emllm passkey -l 1m -d 0.5 -t 1 --memory-dir /var/tmp --resume
    """
    import emllm
    from emllm.evals import results_log
    from emllm.evals.passkey import check_lengths, read_plan, run_grid
    from emllm.evals.scratch import TrunkStores

    ls, ds = lengths, depths  # parsed by the option callbacks (bad values: usage error, exit 2)
    if resume and memory_dir is None:
        raise typer.BadParameter("needs --memory-dir, the folder that keeps the progress", param_hint="'--resume'")
    log = lambda m: render.err.print(f"[dim]{m}[/dim]")  # noqa: E731
    with render.status(f"loading {render.shown(model or emllm.default_model())}"):
        src = emllm.load(model, profile, dtype, log)
    mdl, tok, name = src.model, src.tokenizer, src.given
    try:
        check_lengths(tok, ls)
    except emllm.UsageError as e:
        raise typer.BadParameter(str(e), param_hint="'--lengths'") from None
    methods = ["emllm"] + (["reread"] if reread else []) + (["baseline"] if baseline else [])
    n_trials = len(ls) * len(ds) * trials * len(methods)
    if memory_dir and not resume and (memory_dir / TrunkStores.KEPT).exists():
        log(f"{memory_dir / TrunkStores.KEPT} holds the progress of a run with --resume: add --resume to carry it on")
    if kv_format not in (None, "auto") and memory_dir is None:
        raise typer.BadParameter("a store format needs stores: add --memory-dir", param_hint="'--format'")
    engines = TrunkStores(mdl, tok, src.profile, memory_dir, name, log=log, keep=resume,
                          kv_format=None if kv_format == "auto" else kv_format) if memory_dir else None
    # With --resume, every answer is on disk before the next trial starts, in the folder the stores
    # are kept in (locked: ours alone), and a later run of the same grid takes them.
    journal = engines.folder / "passkey-results.jsonl" if resume else None
    grid = {"model": name, "profile": asdict(src.profile), "dtype": str(mdl.dtype).removeprefix("torch."),
            "kv_format": kv_format or "auto", "seed": seed, "lengths": ls, "depths": ds,
            "trials": trials, "baseline": baseline, **({"reread": True} if reread else {})}
    interrupted, finished = False, False
    try:
        done = _kept_answers(journal, grid) if journal else []
        if done:
            log(f"resuming: {len(done)} of {n_trials} trials answered already ({journal})")
        if journal:
            _write(results_log.start_run, journal, grid)
        skip = {(r["length"], r["depth"], r["trial"], r["method"]) for r in done}
        # Progress counts tokens, so the ETA weighs a 32k trial 8 times a 4k one (the plain model
        # reads at most its context; with --memory-dir the filler before the needles is read once).
        ctx = getattr(mdl.config, "max_position_embeddings", None) or max(ls)
        span = src.profile.n_init + src.profile.n_mem + src.profile.n_local  # what a re-read reads again, at most
        plan = read_plan(ls, ds, trials, shared=engines is not None)

        def cost(r: dict) -> int:
            n = r["length"]
            if r["method"] == "emllm":
                return plan.get((n, r["depth"], r["trial"]), n)
            return min(n, ctx if r["method"] == "baseline" else span)

        total = sum(cost({"method": m, "length": n, "depth": d, "trial": t})
                    for m in methods for n in ls for d in ds for t in range(trials))
        # In a terminal the grid fills in as trials finish (one live view: table + progress);
        # piped, progress goes to stderr and the table or JSON comes once at the end.
        interactive = render.out.is_terminal and not as_json
        bar = render.progress(console=render.out if interactive else render.err)
        task = bar.add_task("passkey", total=total, rate="", completed=sum(cost(r) for r in done))
        live = Live(Group(render.passkey_table(done, ls, ds, methods), bar), console=render.out,
                    refresh_per_second=4) if interactive else bar
        t0 = time.perf_counter()

        def on_result(r) -> None:
            done.append(asdict(r))
            if journal:
                _write(results_log.append, journal, done[-1])
            ok = sum(x["correct"] for x in done)
            bar.update(task, advance=cost(done[-1]), rate=f"tokens · {len(done)}/{n_trials} trials, {ok} correct")
            if interactive:
                live.update(Group(render.passkey_table(done, ls, ds, methods), bar))

        try:
            with live:
                run_grid(mdl, tok, engines or (lambda: emllm.Engine(mdl, src.profile)), ls, ds, trials, seed, baseline,
                         on_result, skip=skip, reread=reread)
        except KeyboardInterrupt:
            interrupted = True  # keep what finished: print it below
        doc = {
            "model": name, "profile": asdict(src.profile), "lengths": ls, "depths": ds, "trials": trials,
            "seed": seed, "seconds": round(time.perf_counter() - t0, 1), "complete": not interrupted, "results": done,
            "resumed_trials": len(skip),
            "accuracy": {m: {str(n): _acc(done, m, n) for n in ls} for m in methods},
        }
        if as_json:
            render.print_json(doc)
        elif interactive:
            pass  # the live view (grid and bar) stays on screen
        else:
            render.out.print(render.passkey_table(done, ls, ds, methods))
        finished = not interrupted
    finally:
        # The kept answers go only once they are printed: a failure to print keeps them.
        if engines is not None and (finished or not resume):
            engines.close()
        elif engines is not None:
            engines.release()  # --resume: the next run carries on from here
    if interrupted:
        kept = f"; run the same command again to carry on (kept in {engines.folder})" if resume else ""
        render.err.print(f"emllm: interrupted after {len(done)} of {n_trials} trials; the results above are partial{kept}",
                         soft_wrap=True)
        raise typer.Exit(130)


def _kept_answers(journal: Path, grid: dict) -> list[dict]:
    """The answers a killed run of this grid kept in `journal`, one per trial (the last written).
    A folder keeping another grid's progress is refused: carrying on here would discard it."""
    from emllm.evals import results_log
    other, ours = results_log.last_grid(journal), results_log.normal(grid)
    if other is not None and other != ours:
        differ = ", ".join(k for k in sorted(set(ours) | set(other)) if other.get(k) != ours.get(k))
        raise UserError(f"{journal.parent} holds the progress of another passkey grid (other {differ}): run that "
                        "grid again with --resume to finish it, remove that folder, or use another --memory-dir")
    methods = ["emllm"] + (["reread"] if grid.get("reread") else []) + (["baseline"] if grid["baseline"] else [])
    cells = {(n, d, t, m) for n in grid["lengths"] for d in grid["depths"] for t in range(grid["trials"]) for m in methods}
    answers: dict[tuple, dict] = {}
    for r in results_log.results_of(journal, grid):
        cell = (r.get("length"), r.get("depth"), r.get("trial"), r.get("method"))
        if cell in cells and isinstance(r.get("correct"), bool) and isinstance(r.get("answer"), str):
            answers[cell] = r
    return list(answers.values())


def _write(fn, journal: Path, record: dict) -> None:
    try:
        fn(journal, record)
    except OSError as e:
        raise UserError(f"cannot keep the progress in {journal}: {e.strerror or e}") from None


def _acc(results: list[dict], method: str, length: int) -> float | None:
    r = [x["correct"] for x in results if x["method"] == method and x["length"] == length]
    return sum(r) / len(r) if r else None



