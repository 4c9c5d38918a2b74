"""Reading the user's text: files or stdin, with clear errors."""

from __future__ import annotations

from . import render
from .errors import UserError


# `segment` holds the whole text and its tokens: far past what it reads in reasonable time on a
# CPU, and an endless stream (`yes | emllm segment -`) ends here instead of filling memory.
SEGMENT_MAX_CHARS = 64 << 20


def read_text(path: str, max_chars: int = SEGMENT_MAX_CHARS) -> str:
    """The text of `path` ('-' for stdin), read as `emllm ingest` reads it (`TextSource`): devices,
    binary and empty input refused, invalid UTF-8 replaced with a warning; at most max_chars."""
    from emllm import InputError, TextSource

    warn = lambda m: render.err.print(f"[yellow]warning:[/yellow] {render.shown(m)}")  # noqa: E731
    try:
        src = TextSource.open(path, warn=warn)
        parts, n = [], 0
        for piece in src.pieces():
            parts.append(piece)
            n += len(piece)
            if n > max_chars:
                src.close()
                raise UserError(f"{src.name}: longer than {max_chars >> 20} Mi characters: segment a part of it "
                                "(emllm ingest reads any length)")
    except InputError as e:
        raise UserError(str(e)) from None
    return "".join(parts)
