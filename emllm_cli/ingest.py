"""`emllm ingest`: stream documents into a store that outlives the process."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from . import render
from .errors import UserError, guarded
from .options import DtypeOpt, FormatOpt, ModelOpt, ProfileOpt
from .stores import complete_store_names, store_path


@guarded
def ingest(
    paths: list[str] = typer.Argument(None, metavar="PATH", help="Text files to ingest in order (- for stdin)."),
    model: str = ModelOpt,
    profile: str = ProfileOpt,
    dtype: str = DtypeOpt,
    kv_format: str = FormatOpt,
    store: str = typer.Option(None, "--store", "-s", help="Store name (under the emllm home) or path; default: the first file's name.", autocompletion=complete_store_names),
    append: bool = typer.Option(False, "--append", help="Add the documents to an existing store."),
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
      cat notes/*.md | emllm ingest - --store notes
      emllm ingest chapter2.txt --store book --append
      emllm ingest --resume --store book            # after an interruption
    """
    from emllm.app import ingest as ing
    from emllm.app import stream
    from emllm import models
    from emllm.home import store_name_for
    from emllm.store import Store, is_store, read_manifest
    from emllm.app.textinput import TextSource, file_sha256

    paths = paths or []
    if resume and paths:
        raise typer.BadParameter("--resume continues the interrupted job; give no files", param_hint="--resume")
    if not resume and not paths:
        raise typer.BadParameter("give at least one file (or - for stdin)", param_hint="PATH")
    if resume and append:
        raise typer.BadParameter("use --resume or --append, not both", param_hint="--append")
    if paths.count("-") > 1:
        raise typer.BadParameter("stdin (-) can be read once", param_hint="PATH")
    if store is None:
        if resume or append:
            raise typer.BadParameter("say which store with --store", param_hint="--store")
        if paths[0] == "-":
            raise typer.BadParameter("reading stdin: name the store with --store", param_hint="--store")
        store = store_name_for(paths[0])

    path = store_path(store)
    existing = is_store(path)
    if (append or resume) and not existing:
        raise UserError(f"no store at {path} to {'append to' if append else 'resume'}; create it with `emllm ingest FILE --store {store}`")
    if existing:
        m = read_manifest(path)
        job = m.get("job")
        unfinished = bool(job and not job["complete"])
        if paths and unfinished and ing.continues_job(m, [file_sha256(p) for p in paths]):
            render.err.print(f"[yellow]note:[/yellow] continuing the interrupted ingest of these documents "
                             f"({job['done']} of {job['tokens']} tokens read)")
            paths, resume, append = [], True, False
        elif append and unfinished:
            raise UserError(f"store {store!r} has an unfinished ingest ({job['done']} of {job['tokens']} tokens "
                            f"read): finish it first with `emllm ingest --resume --store {store}`")
        elif not (append or resume):
            if ing.is_empty(m):  # an earlier emllm's create, interrupted before its text was saved
                render.err.print(f"[yellow]note:[/yellow] {render.shown(str(path))} held an empty store (an interrupted "
                                 f"create): it is made anew")
                Store.remove_empty(path)
                existing = False
            else:
                where = f"{store!r}" + (f" ({path})" if str(path) != store else "")
                raise UserError(f"store {where} already exists: add with --append, or choose another --store")
        elif resume and not unfinished and ing.is_empty(m):
            raise UserError(f"store {store!r} holds nothing: the ingest that created it was interrupted before its "
                            f"text was saved; run it again: emllm ingest FILE --store {store}")
    warn = lambda m: render.err.print(f"[yellow]warning:[/yellow] {render.shown(m)}")  # noqa: E731
    docs = [(p if p != "-" else "stdin", TextSource.open(p, warn)) for p in paths]  # bad files fail before any work

    log = lambda m: render.err.print(f"[dim]{render.shown(m)}[/dim]")  # noqa: E731
    if existing:
        if raw and m.get("stream", {}).get("chat"):  # the layout is the store's, fixed when it was made
            raise typer.BadParameter("this store's stream is in the model's chat template (set when it was "
                                     "created): omit --raw, or ingest into a new store", param_hint="--raw")
        with render.status(f"loading the model of {render.shown(path.name)} and opening it"):
            opened = stream.open_store(path, writable=True, model=model, profile=profile, log=log, dtype=dtype)
        st, mdl, tok = opened.store, opened.model, opened.tok
        if kv_format not in (None, "auto", st.kv_format.name):
            opened.close()
            raise UserError(f"store {store!r} keeps keys and values in {st.kv_format.name} (fixed when it was "
                            f"created): omit --format, or ingest into a new store")
    else:
        src = models.resolve(model, profile, log=log)
        with render.status(f"loading {render.shown(src.name)}"):
            mdl, tok = models.load(src, dtype=dtype)
        name = str(src.path.resolve()) if Path(src.name).exists() else src.name
        st = stream.create_store(path, name, mdl, tok, src.profile, chat=not raw, kv_format=kv_format)

    with st:
        engine = stream.open_engine(st, mdl, kv_cache_mb)
        before = st.tokens.rows + len(stream.pending_tokens(st))  # the stream's length before this run
        if docs:
            held = list(st.manifest["documents"])
            try:
                ing.add_documents(st, tok, docs, check_space=True)
            except KeyboardInterrupt:
                st.discard()
                what = "the store was not created" if not existing else "the store is unchanged"
                render.err.print(f"emllm: interrupted before the text was saved: {what}; run the same command again")
                raise typer.Exit(130)
            except BaseException:
                st.discard()
                raise
            for doc_name, was in ing.duplicates(held, docs):  # allowed (it may be meant), but rarely what one wants
                render.err.print(f"[yellow]note:[/yellow] {render.shown(doc_name)}: the store held this text already "
                                 f"(as {render.shown(was)}); it was added again")
        job = st.manifest["job"]
        t0, done0, was_complete = time.perf_counter(), job["done"], job["complete"]
        if not docs and not was_complete:  # a resume: what is left of the job must fit too
            ing.check_disk(st, job["tokens"] - job["done"])
        try:
            with render.progress(transient=False) as bar:
                task = bar.add_task("ingesting", total=job["tokens"], completed=job["done"], rate="")

                def show(p: ing.Progress) -> None:
                    rate = (p.done - done0) / max(time.perf_counter() - t0, 1e-9)
                    bar.update(task, completed=p.done, rate=f"{rate:.0f} tok/s · {p.events} events")

                ing.run_job(st, engine, commit_every, show)
        except KeyboardInterrupt:
            j = st.manifest["job"]
            render.err.print(f"emllm: interrupted: the store keeps {j['done']} of {j['tokens']} tokens of this job; "
                             f"finish with: emllm ingest --resume --store {render.shown(store)} (or the same command again)")
            raise typer.Exit(130)
        summary = ing.run_summary(st, before, done0, was_complete, bool(docs), time.perf_counter() - t0)
    if as_json:
        render.print_json(summary)
        return
    pending, read = summary["pending_tokens"], summary["read_tokens"]
    where = f"{summary['tokens']} tokens, {summary['events']} events in {path} ({summary['bytes'] / 2**20:.1f} MiB"
    if resume and was_complete:
        render.err.print(f"nothing to resume: the last ingest finished; {render.shown(where)}). An --append interrupted "
                         "before its text was saved leaves no trace: run that append again")
    elif read:
        render.err.print(f"[green]stored[/green] {render.shown(where)}, {summary['tokens_per_second']:.0f} tok/s)")
    else:  # an append shorter than what completes a chunk: nothing for the model to read yet
        render.err.print(f"[green]stored[/green] {render.shown(where)}; {pending} tokens wait for the next append or question)")

