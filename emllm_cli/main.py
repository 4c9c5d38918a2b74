"""The `emllm` command: a thin Typer layer over the engine in `core`."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

import typer

from .errors import _CLICK_ERRORS, DEBUG
from .ask import ask
from .ingest import ingest
from .inspect import inspect
from .passkey import passkey
from .segment import segment

app = typer.Typer(
    name="emllm",
    help="Episodic memory for Hugging Face causal LMs (EM-LLM): read documents of any length with a small window.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        try:
            v = version("emllm")
        except PackageNotFoundError:
            v = "unknown"
        typer.echo(f"emllm {v}")
        raise typer.Exit()


@app.callback()
def main(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors."),
    show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    DEBUG["on"] = debug
    # Our own progress bars replace the libraries' (which would print on every model load).
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


app.command("ingest")(ingest)
app.command("ask")(ask)
app.command("passkey")(passkey)
app.command("inspect")(inspect)
app.command("segment")(segment)


def cli() -> None:
    """The `emllm` executable: the app, with a usage error in one line on stderr (exit 2), as
    every other error, where Typer would draw the usage, a hint and a boxed message."""
    try:
        code = app(standalone_mode=False)
    except _CLICK_ERRORS as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `emllm`: the help (which the error holds)
            typer.echo(e.ctx.get_help())  # on stdout, as --help
            sys.exit(e.exit_code)
        ctx = getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        msg = " ".join(e.format_message().split())
        print(f"emllm: error: {msg}{hint}", file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Abort:  # Ctrl-D at a prompt
        print("emllm: aborted", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
