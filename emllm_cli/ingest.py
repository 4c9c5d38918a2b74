"""`emllm ingest`: stream documents into a store that outlives the process."""

from __future__ import annotations

import contextlib
import os
import time

import typer

import emllm

from . import render
from .errors import guarded
from .options import DtypeOpt, FormatOpt, ModelOpt, ProfileOpt
from .stores import complete_store_names, store_path


@guarded
def ingest(
    paths: list[str] = typer.Argument(None, metavar="PATH", help="Text files or folders to ingest in order (- for stdin). A folder is read as a code base: its text files in the order of their paths, each opening with a line that names it; .gitignore rules are honoured, hidden, binary and empty files and links left out."),
    model: str = ModelOpt,
    profile: str = ProfileOpt,
    dtype: str = DtypeOpt,
    kv_format: str = FormatOpt,
    store: str = typer.Option(None, "--store", "-s", help="Store name (under the emllm home) or path; default: the first file's name.", autocompletion=complete_store_names),
    append: bool = typer.Option(False, "--append", help="Add the documents to an existing store (a folder's files that it holds unchanged are not read again)."),
    resume: bool = typer.Option(False, "--resume", help="Finish an interrupted ingest (needs no files)."),
    raw: bool = typer.Option(False, "--raw", help="Do not wrap the stream in the model's chat template."),
    commit_every: int = typer.Option(4, "--commit-every", min=1, help="Commit the store every N chunks."),
    kv_cache_mb: int = typer.Option(None, "--kv-cache-mb", min=0, help="RAM for the keys and values of recently retrieved events, all layers (default: the profile's kv_cache_mb, 0: none; the page cache serves reads). Helps only where the store's files are not in the page cache. Does not change results."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout. Progress goes to stderr on a terminal; elsewhere set EMLLM_PROGRESS=60 for a line a minute."),
) -> None:
    """Read documents into an episodic memory on disk: ingest once, ask many times, append later.

    Examples:

    \b
      emllm ingest book.txt                         # store 'book', the default model
      emllm ingest ~/src/myproject                  # a code base: store 'myproject'
      cat notes/*.md | emllm ingest - --store notes
      emllm ingest chapter2.txt --store book --append
      emllm ingest --resume --store book            # after an interruption
    """
    paths = paths or []
    if resume and paths:
        raise typer.BadParameter("--resume continues the interrupted job; give no files", param_hint="--resume")
    if not resume and not paths:
        raise typer.BadParameter("give at least one file or folder (or - for stdin)", param_hint="PATH")
    if resume and append:
        raise typer.BadParameter("use --resume or --append, not both", param_hint="--append")
    if paths.count("-") > 1:
        raise typer.BadParameter("stdin (-) can be read once", param_hint="PATH")
    if store is None:
        if resume or append:
            raise typer.BadParameter("say which store with --store", param_hint="--store")
        if paths[0] == "-":
            raise typer.BadParameter("reading stdin: name the store with --store", param_hint="--store")
        store = emllm.store_name_for(os.path.abspath(paths[0]))  # (a folder's own name, "." included)

    warn = lambda m: render.err.print(f"[yellow]warning:[/yellow] {render.shown(m)}")  # noqa: E731
    left_out: list[dict] = []
    # bad files fail before any work; a folder's unreadable ones are left out, and said so
    folders = [p for p in paths if p != "-" and os.path.isdir(p)]
    with render.status(f"finding the text files in {render.shown(', '.join(folders))}") if folders else contextlib.nullcontext():
        docs = emllm.open_documents(paths, warn, lambda name, why: left_out.append({"name": name, "why": why}))
    if left_out:
        render.err.print(f"[yellow]note:[/yellow] {render.shown(_left_out(left_out))}")
    path = store_path(store)
    try:
        plan = emllm.plan_ingest(path, [src.path for _, src in docs], append=append, resume=resume,
                                 name=store, chat=not raw, kv_format=kv_format)
    except emllm.UsageError as e:
        if raw:
            raise typer.BadParameter(str(e), param_hint="--raw") from None
        raise
    for note in plan.notes:
        render.err.print(f"[yellow]note:[/yellow] {render.shown(note)}")
    if plan.mode == "resume":
        for _, src in docs:
            src.close()
        docs, resume, append = [], True, False
    unchanged: list[str] = []
    if plan.mode == "append":  # a folder read before: only its new and changed files are added
        same = set(emllm.unchanged_files(path, docs))
        unchanged = [name for i, (name, _) in enumerate(docs) if i in same]
        docs = [d for i, d in enumerate(docs) if i not in same]
        if unchanged and docs:
            render.err.print(f"[yellow]note:[/yellow] {len(unchanged)} files unchanged since the store read them: not read again")
        elif unchanged:
            render.err.print(f"nothing to add: the store holds each of these {len(unchanged)} files as it is")
            if as_json:
                render.print_json({"store": str(path), "ingested_tokens": 0, "read_tokens": 0, "left_out": left_out,
                                   "unchanged": unchanged})
            return

    log = lambda m: render.err.print(f"[dim]{render.shown(m)}[/dim]")  # noqa: E731
    if plan.mode == "create":
        with render.status(f"loading {render.shown(model or emllm.default_model())}"):
            loaded = emllm.load(model, profile, dtype, log)
        mem = emllm.create(path, loaded, chat=not raw, kv_format=kv_format)
    else:
        with render.status(f"loading the model of {render.shown(path.name)} and opening it"):
            mem = emllm.open(path, writable=True, model=model, profile=profile, log=log, dtype=dtype)

    with mem, _terminate_as_interrupt() as stopped:
        if docs:
            try:
                duplicates = mem.add(*docs, check_space=True, kv_cache_mb=kv_cache_mb)
            except KeyboardInterrupt:
                what = "the store was not created" if plan.mode == "create" else "the store is unchanged"
                render.err.print(f"emllm: {stopped.how} before the text was saved: {what}; run the same command again")
                raise typer.Exit(stopped.code) from None
            for doc_name, was in duplicates:  # allowed (it may be meant), but rarely what one wants
                render.err.print(f"[yellow]note:[/yellow] {render.shown(doc_name)}: the store held this text already "
                                 f"(as {render.shown(was)}); it was added again")
        job = mem.job
        t0, done0 = time.perf_counter(), job.done if job is not None else 0
        try:
            with render.progress(transient=False) as bar:
                task = bar.add_task("ingesting", total=job.tokens if job is not None else 0, completed=done0, rate="")

                def show(p: emllm.Progress) -> None:
                    rate = (p.done - done0) / max(time.perf_counter() - t0, 1e-9)
                    bar.update(task, completed=p.done, rate=f"{rate:.0f} tok/s · {p.events} events")

                report = mem.resume(commit_every=commit_every, progress=show, kv_cache_mb=kv_cache_mb)
        except KeyboardInterrupt:
            j = mem.job
            render.err.print(f"emllm: {stopped.how}: the store keeps {j.done} of {j.tokens} tokens of this job; "
                             f"finish with: emllm ingest --resume --store {render.shown(store)} (or the same command again)")
            raise typer.Exit(stopped.code) from None
    summary = report.summary
    if as_json:
        render.print_json({**summary, "left_out": left_out, "unchanged": unchanged})
        return
    pending, read = summary["pending_tokens"], summary["read_tokens"]
    where = f"{summary['tokens']} tokens, {summary['events']} events in {path} ({summary['bytes'] / 2**20:.1f} MiB"
    if report.nothing_to_resume:
        render.err.print(f"nothing to resume: the last ingest finished; {render.shown(where)}). An --append interrupted "
                         "before its text was saved leaves no trace: run that append again")
    elif read:
        render.err.print(f"[green]stored[/green] {render.shown(where)}, {summary['tokens_per_second']:.0f} tok/s)")
    else:  # an append shorter than what completes a chunk: nothing for the model to read yet
        render.err.print(f"[green]stored[/green] {render.shown(where)}; {pending} tokens wait for the next append or question)")


class _Stopped:
    how, code = "interrupted", 130  # Ctrl-C's; SIGTERM's once it came


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (a service stopped, `kill`, a container's end) stops an ingest as Ctrl-C does: the
    store keeps its last commit and a line says how to finish; exit code 143. The handler before
    is put back after (a library's caller, a test, keeps its own)."""
    import signal

    stopped = _Stopped()

    def on_term(_signum: int, _frame: object) -> None:
        stopped.how, stopped.code = "terminated", 143
        raise KeyboardInterrupt

    try:
        before = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # (not the main thread: signals stay as they are)
        yield stopped
        return
    try:
        yield stopped
    finally:
        signal.signal(signal.SIGTERM, before)


def _left_out(files: list[dict]) -> str:
    """One line for the files of folders left out, by reason, a few named."""
    by: dict[str, list[str]] = {}
    for f in files:
        by.setdefault(f["why"], []).append(f["name"])
    return "left out: " + "; ".join(f"{len(names)} {why}{'s' * (why == 'link' and len(names) > 1)} "
                                    f"({', '.join(names[:3])}{', …' if len(names) > 3 else ''})"
                                    for why, names in by.items())
