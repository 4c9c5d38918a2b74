"""`emllm chat`: a conversation in the terminal that the store remembers."""

from __future__ import annotations

import sys

import typer

import emllm

from . import render
from .errors import UserError, guarded
from .options import (DtypeOpt, ModelOpt, ProfileOpt, RepetitionPenaltyOpt, SeedOpt, StopOpt, TemperatureOpt, TopKOpt,
                      TopPOpt, sampling_of)
from .stores import complete_store_names, existing_store, store_path

HELP = """commands:
  /help        this list
  /retrieval   what each layer retrieved for the last question
  /reread      answer by re-reading what the memory chose, or not (toggles; see --reread)
  /undo        forget the last exchange (it is cut from the store)
  /quit        leave (also Ctrl-D)
a line ending with \\ continues on the next; a line of \"\"\" starts and ends a block"""


def read_message(prompt: str = "› ") -> str | None:
    """One message from the terminal (line editing and history through readline): a line, lines
    joined by a trailing backslash, or a block between two lines of three quotes. None: end of input."""
    tty = sys.stdin.isatty()
    if tty:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
    else:
        prompt = ""  # piped: no prompts in the output
    try:
        line = input(prompt)
    except EOFError:
        return None
    if line.strip() == '"""':
        lines = []
        while True:
            try:
                more = input("… " if tty else "")
            except EOFError:
                break
            if more.strip() == '"""':
                break
            lines.append(more)
        return "\n".join(lines)
    lines = [line]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        try:
            lines.append(input("… " if tty else ""))
        except EOFError:
            break
    return "\n".join(lines)


@guarded
def chat(
    store: str = typer.Option(None, "--store", "-s", help="Store name or path; default: the most recently written, or a new store 'chat'.",
                              autocompletion=complete_store_names),
    model: str = ModelOpt,
    profile: str = ProfileOpt,
    dtype: str = DtypeOpt,
    remember: bool = typer.Option(True, "--remember/--no-remember", help="Append each exchange to the store (default), or leave the store unchanged."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", min=1, help="Longest answer, in tokens."),
    temperature: float = TemperatureOpt,
    top_p: float = TopPOpt,
    top_k: int = TopKOpt,
    repetition_penalty: float = RepetitionPenaltyOpt,
    seed: int = SeedOpt,
    stop: list[str] = StopOpt,
    reread: bool = typer.Option(None, "--reread/--no-reread", show_default=False, help="--reread: answer as `emllm ask --reread` does: the question is read against the memory, and the model answers from the passages the most layers chose and the few whose words best match the question (the recent turns among them), read as one ordinary context, those whose words best match the question last. Costs one more forward over emllm's attention span per answer. Default (emllm.REREAD_CONVERSATION): emllm's own reading. /reread switches it during the conversation."),
) -> None:
    """Talk with a store: each exchange is answered from its memory and appended to it, so later
    questions (today or days later) recall it, however long the conversation grows.

    Examples:

    \b
      emllm chat --store book                  # about a document, remembered
      emllm chat --store diary -m smollm2      # a new store: a conversation from nothing
      emllm chat --store book --no-remember    # the store stays as it is
      emllm chat --store book --reread         # answers read again from the passages retrieved
    """
    if sys.stdin is None or sys.stdin.closed:  # `emllm chat <&-`: nothing to read messages from
        raise UserError("standard input is closed: chat reads its messages from it (a terminal, or a pipe)")
    if store is None:
        path = existing_store(None) if emllm.list_stores() else store_path("chat")
    else:
        path = store_path(store)
    log = lambda m: render.err.print(f"[dim]{render.shown(m)}[/dim]")  # noqa: E731
    if emllm.is_store(path):
        with render.status(f"loading the model of {render.shown(path.name)}"):
            mem = emllm.open(path, model=model, profile=profile, log=log, dtype=dtype)
    else:
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise UserError(f"{path} exists and is not a store")
        if not remember:
            raise UserError(f"no store at {path}: with --no-remember a conversation needs a store to talk with")
        with render.status(f"loading {render.shown(model or emllm.default_model())}"):
            loaded = emllm.load(model, profile, dtype, log)
        mem = emllm.create(path, loaded, publish=True)
        render.err.print(f"[dim]new store {render.shown(path)}[/dim]")
    mem.close()  # the conversation opens the store for each exchange
    sampling = sampling_of(mem.loaded, temperature, top_p, top_k, repetition_penalty, seed)
    render.err.print(f"[dim]talking with {render.shown(path.name)}"
                     f"{'' if remember else ' (not remembered)'}; /help for commands, Ctrl-D to leave[/dim]")
    with mem.conversation(remember=remember, reread=reread) as talk:
        while True:
            try:
                msg = read_message()
            except KeyboardInterrupt:
                if not sys.stdin.isatty():
                    raise  # (a script's Ctrl-C: it ends)
                sys.stdout.write("\n")  # at a terminal, as a shell: the line is dropped, the conversation goes on
                render.err.print("[dim]Ctrl-D or /quit leaves[/dim]")
                continue
            if msg is None:
                sys.stdout.write("\n")
                break
            cmd = msg.strip()
            if not cmd:
                continue
            if cmd in ("/quit", "/exit", "/q"):
                break
            if cmd == "/help":
                render.err.print(HELP, markup=False, highlight=False)  # (ours: its lines as written)
                continue
            if cmd == "/undo":
                try:
                    talk.undo()
                    render.err.print("[dim]the last exchange is forgotten[/dim]")
                except Exception as e:  # noqa: BLE001 - said, and the conversation goes on
                    render.err.print(f"[yellow]{render.shown(e)}[/yellow]")
                continue
            if cmd == "/reread":
                talk.reread = not talk.reread
                render.err.print(f"[dim]re-read answers {'on' if talk.reread else 'off'}[/dim]")
                continue
            if cmd == "/retrieval":
                if talk.last_retrieval is None:
                    render.err.print("[dim]no question yet[/dim]")
                else:
                    r = talk.last_retrieval
                    render.err.print(render.retrieval_view(r, r["span"]))
                continue
            if cmd.startswith("/"):
                render.err.print(f"[yellow]unknown command {render.shown(cmd)}[/yellow]; /help lists them")
                continue
            shown = ""
            try:
                for piece in talk.say(msg, max_new_tokens, sampling, stop, trace=True):
                    shown += piece
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                render.err.print("[dim]interrupted: this exchange is not remembered[/dim]")
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
