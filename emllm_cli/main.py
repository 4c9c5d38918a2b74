"""The `emllm` command: a thin Typer layer over the engine in `core`."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import typer

from .errors import DEBUG
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
    rich_markup_mode="rich",
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
