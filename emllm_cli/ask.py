"""`emllm ask`: answer a question from a store, streaming the answer to stdout."""

from __future__ import annotations

import sys
import time

import typer

from . import render
from .errors import UserError, guarded
from .stores import complete_store_names, existing_store


@guarded
def ask(
    question: str = typer.Argument(..., metavar="QUESTION", help="The question (- reads it from stdin)."),
    store: str = typer.Option(None, "--store", "-s", help="Store name or path; default: the most recently written.", autocompletion=complete_store_names),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", min=1, help="Longest answer, in tokens."),
    show_retrieval: bool = typer.Option(False, "--show-retrieval", help="Draw what each layer retrieved, on stderr."),
    kv_cache_mb: int = typer.Option(None, "--kv-cache-mb", min=0, help="RAM for the keys and values of recently retrieved events, all layers (default: the profile's kv_cache_mb, 128; 0: none). Does not change results."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document with the answer instead of streaming."),
) -> None:
    """Answer from a stored document. The store is not changed: every question sees the same memory.

    Examples:

    \b
      emllm ask "who hid the key?"
      echo "summarise chapter 2" | emllm ask - --store book --json
    """
    from emllm.app.ask import Session
    from emllm.app.stream import open_store

    if question == "-":
        question = sys.stdin.read()
    if not question.strip():
        raise UserError("the question is empty")
    path = existing_store(store)
    t0 = time.perf_counter()
    with render.status(f"loading the model of {render.shown(path.name)} and opening it"):
        o = open_store(path, log=lambda m: render.err.print(f"[dim]{render.shown(m)}[/dim]"))
    with o:
        st, tok = o.store, o.tok
        with render.status("reading the question"):
            session = Session(st, o.model, tok, kv_cache_mb)
        if session.unfinished:
            done, total = session.unfinished
            render.err.print(f"[yellow]note:[/yellow] the store's last ingest is unfinished ({done} of {total} tokens read: "
                             "being written, or interrupted); answering from its last commit")
        trace = None
        if show_retrieval:
            from emllm.app.trace import Trace

            trace = Trace.attach(session.engine)
        out: list[int] = []
        shown = ""
        first = None
        try:
            for t in session.answer(question, max_new_tokens):
                if first is None:
                    first = time.perf_counter() - t0
                out.append(t)
                if not as_json:
                    text = tok.decode(out, skip_special_tokens=True)
                    if not text.endswith("\ufffd"):  # hold back half a multi-byte character
                        sys.stdout.write(text[len(shown):])
                        sys.stdout.flush()
                        shown = text
        except KeyboardInterrupt:
            if shown and not shown.endswith("\n"):
                sys.stdout.write("\n")  # the message goes on a line of its own, not after the answer
                sys.stdout.flush()
            raise
        if first is None:  # the first token chosen was a stop token: that choice is the "first token"
            first = time.perf_counter() - t0
        answer = tok.decode(out, skip_special_tokens=True)
        if trace is not None:
            from emllm.app.report import retrieval_doc

            retrieval = retrieval_doc(trace, st, tok, question, window_start=session.engine.window_start)
    if not as_json:
        sys.stdout.write(answer[len(shown):] + "\n")
        sys.stdout.flush()
    if trace is not None and not as_json:  # with --json the retrieval is in the document
        render.err.print(render.retrieval_view(retrieval, st.manifest["rows"]["tokens"]))
    if as_json:
        render.print_json({
            "store": str(path), "question": question, "answer": answer.strip(), "tokens": len(out),
            "seconds_to_first_token": round(first or 0.0, 3), "seconds": round(time.perf_counter() - t0, 3),
            **({"retrieval": retrieval} if trace is not None else {}),
        })
