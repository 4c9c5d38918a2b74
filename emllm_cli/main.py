"""The `emllm` command: a thin Typer layer over the library `emllm`."""

from __future__ import annotations

import os
import sys
from importlib.metadata import PackageNotFoundError, version

import typer

from .errors import _CLICK_ERRORS, DEBUG
from .ask import ask
from .chat import chat
from .ingest import ingest
from .inspect import inspect
from .manage import list_cmd, mv, rm, show
from .passkey import passkey
from .segment import segment
from .serve import serve

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


def _raise_open_files_limit() -> None:
    """The soft limit of open files raised to the hard one (as Go's runtime does): an open store
    holds a few files a layer, and a soft limit of 1,024 (256 on macOS) holds few stores besides
    a server's sockets (an 80-layer model's store alone needs ~400)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    # (macOS says its hard limit is unlimited and refuses more than OPEN_MAX, 10,240)
    for want in (hard if hard != resource.RLIM_INFINITY else 65536, 10240):
        if soft >= want:
            return
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return
        except (ValueError, OSError):
            continue


@app.callback()
def main(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors."),
    show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    DEBUG["on"] = debug
    _raise_open_files_limit()
    # Our own progress replaces the libraries' (which would print on every model load); set for
    # when transformers is imported, not by importing it (help and completion stay light).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "transformers" in sys.modules:  # already imported (the CLI run inside a Python program): tell it directly
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


app.command("ingest")(ingest)
app.command("ask")(ask)
app.command("chat")(chat)
app.command("passkey")(passkey)
app.command("inspect")(inspect)
app.command("segment")(segment)
app.command("list")(list_cmd)
app.command("ls", hidden=True)(list_cmd)  # as a shell user types it
app.command("show")(show)
app.command("rm")(rm)
app.command("mv")(mv)
app.command("serve")(serve)


# Typer writes a required argument as {NAME} in the usage line; the convention (and Click's) is NAME.
def _usage_name(self) -> str:  # type: ignore[no-untyped-def]
    name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
    return name + ("..." if self.nargs != 1 and not name.endswith("...") else "")


typer.core.TyperArgument._usage_display_name = _usage_name


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
