"""User-caused errors end in one line on stderr and exit 1; `--debug` shows the traceback."""

from __future__ import annotations

import errno
import functools
import os
import sys
from pathlib import Path
from typing import Callable, TypeVar

import click
import typer

F = TypeVar("F", bound=Callable)
DEBUG = {"on": False}
# Typer vendors its own Click: usage errors may come from either copy.
_CLICK_ERRORS = tuple(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException") + (
    click.exceptions.ClickException,
)


class UserError(Exception):
    """An error the user can fix; its message says what is wrong and what to do."""


def _user_errors() -> tuple[type[BaseException], ...]:
    import emllm

    return (UserError, emllm.EmllmError, FileNotFoundError, IsADirectoryError)


def _hint(e: BaseException) -> str:
    """What to type next, for library errors that name no flags themselves."""
    import emllm

    if isinstance(e, emllm.ModelMismatchError):
        return f": use -m {e.store_model} or another --store"
    if isinstance(e, emllm.ProfileMismatchError):
        return " (omit --profile)"
    return ""


def _disk_full(e: BaseException) -> str | None:
    """The message for a write that found no space (a full disk or quota), else None."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" writing {Path(e.filename).name}" if e.filename else ""
        return (f"no space left on the device{where}: what was committed before stays intact; "
                "free some space and run the same command again")
    return None


def guarded(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, *_CLICK_ERRORS):
            raise  # usage errors: Click prints them and exits 2
        except BrokenPipeError:  # e.g. `emllm ask q | head -1`: the reader has what it wanted, not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0)
        except KeyboardInterrupt:
            print("emllm: interrupted", file=sys.stderr)
            raise typer.Exit(130)
        except Exception as e:  # noqa: BLE001 - the one place that turns errors into exit codes
            if DEBUG["on"]:
                raise
            known = isinstance(e, _user_errors())
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if (full := _disk_full(e)) is not None:
                known, msg = True, full
            msg += _hint(e)
            if not known:
                msg = f"internal error: {type(e).__name__}: {msg} (run with --debug for the traceback)"
            from .render import printable  # (names from files and stores: never an escape sequence raw)

            print(f"emllm: error: {printable(msg)}", file=sys.stderr)
            raise typer.Exit(1)

    return wrapper  # type: ignore[return-value]
