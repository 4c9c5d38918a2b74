"""Text read as a stream: files, FIFOs and stdin in pieces, tokenized piece by piece.

Memory does not grow with the input: a piece is read, decoded (UTF-8, incrementally), checked
and tokenized, and only its tokens go on. Pieces are tokenized apart only where the tokenizer cuts
anyway (between a word and the newlines before a line that starts with a non-space character),
and only for tokenizers checked to give the same ids cut there as whole (byte-level BPE does; a
tokenizer that adds a prefix space to every call does not, and gets the whole text at once).
"""

from __future__ import annotations

import codecs
import hashlib
import os
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Iterator

PIECE = 1 << 20  # bytes read at a time
_PROBES = ("Hello world\nNext line, with words.", "a b\n\nc d", "x = 1\n    y = 2\nz", "über\nœuvre 12 34\n5",
           "end.\n\nNext 42\n\n\nmore\nsp", "tab\n\tx\ny z\n\n")


class InputError(Exception):
    """Input that cannot be read as text; the message says what is wrong."""


@dataclass
class TextSource:
    """One document to read: a file, a FIFO or stdin, opened and checked (first piece) up front."""

    name: str
    stream: BinaryIO
    first: bytes
    warn: Callable[[str], None] | None = None
    sha256: str = ""  # of the text as decoded, known once read to the end
    chars: int = 0
    _used: bool = field(default=False, repr=False)

    @classmethod
    def open(cls, path: str, warn: Callable[[str], None] | None = None) -> "TextSource":
        """`path`, or stdin for "-": refused at once when missing, unreadable, a folder or a device,
        empty, or binary (NUL bytes in the first piece)."""
        if path == "-":
            if sys.stdin is None or sys.stdin.closed:
                raise InputError("stdin is closed: pipe the text in, or give a file")
            try:
                stream: BinaryIO = os.fdopen(os.dup(sys.stdin.fileno()), "rb")
            except (OSError, ValueError):
                raise InputError("stdin is closed: pipe the text in, or give a file") from None
            name = "stdin"
        else:
            name = path
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise InputError(f"{path}: no such file") from None
            except IsADirectoryError:
                raise InputError(f"{path}: is a directory, not a text file") from None
            except OSError as e:
                raise InputError(f"{path}: cannot read: {e.strerror}") from None
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                os.close(fd)
                raise InputError(f"{path}: is a directory, not a text file")
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                if not path.startswith("/dev/fd/") and not path.startswith("/proc/self/fd/"):
                    os.close(fd)
                    raise InputError(f"{path}: is a device, not a text file")
            stream = os.fdopen(fd, "rb")
        try:
            first = stream.read(PIECE)
        except OSError as e:
            stream.close()
            raise InputError(f"{name}: cannot read: {e.strerror}") from None
        if b"\x00" in first:
            stream.close()
            raise InputError(f"{name}: looks like a binary file (NUL bytes); give a text file")
        if not first.strip():
            rest = first
            while rest and not rest.strip():  # a file of blanks longer than a piece
                rest = stream.read(PIECE)
                if b"\x00" in rest:
                    stream.close()
                    raise InputError(f"{name}: looks like a binary file (NUL bytes); give a text file")
            if not rest:
                stream.close()
                raise InputError(f"{name}: is empty: nothing to read")
            first += rest
        return cls(name, stream, first, warn)

    def pieces(self) -> Iterator[str]:
        """The text, a piece at a time (once); sha256 and chars are set when it ends."""
        assert not self._used, "a stream is read once"
        self._used = True
        bad: list[int] = []

        def replace(e: UnicodeDecodeError) -> tuple[str, int]:  # as errors="replace", noting the first
            if not bad:
                bad.append(at + e.start)
            return "\ufffd", e.end

        handler = f"emllm-replace-{id(self)}"
        codecs.register_error(handler, replace)
        dec = codecs.getincrementaldecoder("utf-8")(errors=handler)
        h = hashlib.sha256()
        data, at = self.first, 0
        try:
            while True:
                final = not data
                text = dec.decode(data, final=final)
                if bad and self.warn is not None:
                    self.warn(f"{self.name} is not valid UTF-8 (byte {bad[0]}); "
                              "undecodable bytes were replaced with U+FFFD")
                    self.warn = None
                if text:
                    h.update(text.encode())
                    self.chars += len(text)
                    yield text
                if final:
                    break
                at += len(data)
                try:
                    data = self.stream.read(PIECE)
                except OSError as e:
                    raise InputError(f"{self.name}: cannot read: {e.strerror}") from None
                if (nul := data.find(b"\x00")) >= 0:
                    raise InputError(f"{self.name}: NUL bytes at byte {at + nul}: a binary file; give a text file")
        finally:
            self.stream.close()
        self.sha256 = h.hexdigest()

    def close(self) -> None:
        self.stream.close()


def file_sha256(path: str) -> str | None:
    """sha256 of a regular file's text as ingest would decode it (None for stdin or a FIFO)."""
    if path == "-":
        return None
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        src = TextSource.open(path)
    except (OSError, InputError):
        return None
    for _ in src.pieces():
        pass
    return src.sha256


def cuts_cleanly(tok: Any) -> bool:
    """Whether the tokenizer gives the same ids for the probes cut where `_last_cut` cuts as whole."""
    enc = lambda t: tok(t, add_special_tokens=False, split_special_tokens=True)["input_ids"]  # noqa: E731
    for s in _PROBES:
        for i in range(1, len(s)):
            if _cuts_at(s, i) and enc(s) != enc(s[:i]) + enc(s[i:]):
                return False
    return True


def _cuts_at(text: str, i: int) -> bool:
    """A cut before text[i]: the start of a run of newlines after a letter or digit, the run followed
    by a non-space character. Pre-tokenizers end a word there, and their look-ahead (whitespace not
    followed by a non-space) sees the same characters on both sides of the cut."""
    if not (0 < i < len(text)) or text[i] != "\n" or not text[i - 1].isalnum():
        return False
    j = i
    while j < len(text) and text[j] == "\n":
        j += 1
    return j < len(text) and not text[j].isspace()


def _last_cut(text: str) -> int:
    """The last place `_cuts_at` allows (0: none)."""
    i = len(text)
    while (i := text.rfind("\n", 0, i)) > 0:
        k = i
        while k > 0 and text[k - 1] == "\n":
            k -= 1
        if _cuts_at(text, k):
            return k
        i = k
    return 0


def token_pieces(encode: Callable[[str], list[int]], pieces: Iterator[str], piecewise: bool) -> Iterator[list[int]]:
    """Token ids of the text given in pieces: equal to encode(whole text) (see the module's note)."""
    buf = ""
    for p in pieces:
        buf += p
        if not piecewise:
            continue
        cut = _last_cut(buf)
        if cut:
            yield encode(buf[:cut])
            buf = buf[cut:]
    if buf:
        yield encode(buf)
