"""`emllm ask`: answer a question from a store, streaming the answer to stdout."""

from __future__ import annotations

import sys
import time

import typer

import emllm

from . import render
from .errors import UserError, guarded
from .options import (RepetitionPenaltyOpt, SeedOpt, StopOpt, StoreModelOpt, TemperatureOpt, TopKOpt, TopPOpt,
                      sampling_of)
from .stores import complete_store_names, existing_store


@guarded
def ask(
    question: str = typer.Argument(..., metavar="QUESTION", help="The question (- reads it from stdin)."),
    store: str = typer.Option(None, "--store", "-s", help="Store name or path; default: the most recently written.", autocompletion=complete_store_names),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", min=1, help="Longest answer, in tokens."),
    show_retrieval: bool = typer.Option(False, "--show-retrieval", help="Draw what each layer retrieved, on stderr."),
    kv_cache_mb: int = typer.Option(None, "--kv-cache-mb", min=0, help="RAM for the keys and values of recently retrieved events, all layers (default: the profile's kv_cache_mb, 0: none; the page cache serves reads). Helps only where the store's files are not in the page cache: without it a reader indexes a map of the files (faster; their pages count in its RSS as file pages). Does not change results."),
    temperature: float = TemperatureOpt,
    top_p: float = TopPOpt,
    top_k: int = TopKOpt,
    repetition_penalty: float = RepetitionPenaltyOpt,
    seed: int = SeedOpt,
    stop: list[str] = StopOpt,
    remember: bool = typer.Option(False, "--remember", help="Append this exchange (question and answer) to the store, as `emllm chat` does."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document with the answer instead of streaming."),
    logprobs: int = typer.Option(None, "--logprobs", min=0, max=20, help="With --json: each answer token's log probability under the model (before temperature or penalties) and this many likeliest alternatives (0: the token's alone)."),
    model: str = StoreModelOpt,
    raw: bool = typer.Option(False, "--raw", help="A completion: QUESTION is text that continues the stored text as it is, with no chat turn around it, and the model continues it (emllm's own reading). For base models, and stores ingested with --raw. --remember appends the text and its continuation."),
    reread: bool = typer.Option(None, "--reread/--no-reread", show_default=False, help="How the answer is read. --reread, the default (emllm.REREAD_QUESTIONS): the question is read against the memory, then the passages (~128 tokens each) that the most layers retrieved and those whose words best match the question are read again with it as one ordinary prompt of emllm's attention span, the best matches last; costs one more forward over that span. --no-reread: emllm's own answer, the paper's method, each answer token attending to the events its layers retrieve. The store is not changed either way (docs/benchmarks.md compares them)."),
) -> None:
    """Answer from a stored document. The store is not changed (unless --remember): every question sees the same memory.

    Examples:

    \b
      emllm ask "who hid the key?"
      echo "summarise chapter 2" | emllm ask - --store book --json
      emllm ask "list the characters" --temperature 0.7 --top-p 0.9 --repetition-penalty 1.2 --seed 1
      emllm ask "what is the key for the blue door?" --no-reread   # emllm's own reading (the paper's)
      emllm ask --raw "The key was hidden by" -n 20 --store book   # a completion, for a base model
    """
    if question == "-":
        question = sys.stdin.read()
    if not question.strip():
        raise UserError("the question is empty")
    if logprobs is not None and not as_json:
        raise UserError("--logprobs goes with --json (the log probabilities are printed in the JSON document)")
    if raw:  # (a completion is emllm's own reading, traced by nothing)
        given = [name for name, v in (("--reread", reread), ("--show-retrieval", show_retrieval or None),
                                      ("--kv-cache-mb", kv_cache_mb)) if v is not None]
        if given:
            raise UserError(f"{given[0]} does not go with --raw (a completion is emllm's own reading of the memory)")
    path = existing_store(store)
    t0 = time.perf_counter()
    with render.status(f"loading the model of {render.shown(path.name)} and opening it"):
        mem = emllm.open(path, model=model, log=lambda m: render.err.print(f"[dim]{render.shown(m)}[/dim]"))
    with mem:
        opts = sampling_of(mem.loaded, temperature, top_p, top_k, repetition_penalty, seed)
        with render.status("reading the question"):
            if raw:
                answer = mem.complete(question, max_new_tokens, stop, sampling=opts, top_logprobs=logprobs)
            else:
                answer = mem.answer(question, max_new_tokens, stop, reread=reread, trace=show_retrieval, sampling=opts,
                                    kv_cache_mb=kv_cache_mb, top_logprobs=logprobs)
        if answer.unfinished:
            done, total = answer.unfinished
            why = "being written now" if answer.being_written else \
                f"interrupted: `emllm ingest --resume --store {path}` finishes it"
            render.err.print(f"[yellow]note:[/yellow] the store's last ingest is unfinished ({done} of {total} tokens read, "
                             f"{render.shown(why)}); answering from its last commit")
        first = None
        parts: list[str] = []
        try:
            for piece in answer:
                if first is None:
                    first = time.perf_counter() - t0
                parts.append(piece)
                if not as_json:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            if parts and not "".join(parts).endswith("\n"):
                sys.stdout.write("\n")  # the message goes on a line of its own, not after the answer
                sys.stdout.flush()
            raise
        if first is None:  # the first token chosen was a stop token: that choice is the "first token"
            first = time.perf_counter() - t0
        if not as_json:
            sys.stdout.write("\n")
            sys.stdout.flush()
        if remember:
            with render.status("remembering the exchange"):
                mem.remember(answer)
        span = mem.info.rows.tokens
    if answer.retrieval is not None and not as_json:  # with --json the retrieval is in the document
        render.err.print(render.retrieval_view(answer.retrieval, span))
    if as_json:
        reread_used = not raw and (emllm.REREAD_QUESTIONS if reread is None else reread)
        text = "".join(parts)
        render.print_json({
            "store": str(path), "question": question, "answer": text if raw else text.strip(), "tokens": answer.tokens,
            "seconds_to_first_token": round(first or 0.0, 3), "seconds": round(time.perf_counter() - t0, 3),
            **({"retrieval": answer.retrieval} if answer.retrieval is not None else {}),
            **({"logprobs": _logprobs(mem.tokenizer, answer.logprobs, answer.prompt_ids[-1] if raw else None)}
               if answer.logprobs is not None else {}),
            **({"unfinished": {"done": answer.unfinished[0], "tokens": answer.unfinished[1],
                               "being_written": answer.being_written}} if answer.unfinished else {}),
            **({"reread": {"passages": [list(p) for p in answer.passages],
                           "tokens": sum(e - s for s, e in answer.passages)}} if reread_used else {}),
        })


def _logprobs(tok, entries: list, before: int | None) -> list[dict]:  # (entries: emllm.engine.sampling.TokenLogprob)
    """Each token's text as it reads after the one before it (a completion's first: after the
    prompt's last token), so that they join to the answer's text."""
    def one(token: int, text: str, logprob: float) -> dict:
        return {"token": text, "id": token, "logprob": logprob}

    return [{**one(e.token, text, e.logprob), "top": [one(t, alt, lp) for (t, lp), alt in zip(e.top, alts)]}
            for e, (text, alts) in zip(entries, emllm.logprob_texts(tok, entries, before))]
