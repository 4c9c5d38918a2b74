"""Reading the user's text: files or stdin, with clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

from . import render
from .errors import UserError


def read_text(path: str) -> str:
    """The text of `path` ('-' for stdin). Invalid UTF-8 is decoded with replacement characters
    and a warning (the rest of the text stays usable); binary files and empty files are refused."""
    if path == "-":
        if sys.stdin is None or sys.stdin.closed:
            raise UserError("stdin is closed: pipe the text in, or give a file")
        data = sys.stdin.buffer.read()
        name = "stdin"
    else:
        p = Path(path)
        try:
            if not p.exists():
                raise UserError(f"{path}: no such file")
            if p.is_dir():
                raise UserError(f"{path}: is a directory, not a text file")
            data = p.read_bytes()
        except OSError as e:
            raise UserError(f"{path}: cannot read: {e.strerror}") from None
        name = path
    if not data.strip():
        raise UserError(f"{name}: is empty: nothing to read")
    if b"\x00" in data[:65536]:
        raise UserError(f"{name}: looks like a binary file (NUL bytes); give a text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        render.err.print(f"[yellow]warning:[/yellow] {name} is not valid UTF-8 (byte {e.start}); "
                         "undecodable bytes were replaced with U+FFFD")
        return data.decode("utf-8", errors="replace")
