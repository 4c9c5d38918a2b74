"""Text read as a stream: files, FIFOs and stdin in pieces, tokenized piece by piece.

Memory does not grow with the input: a piece is read, decoded (UTF-8, or UTF-16 after its byte
order mark; incrementally), checked and tokenized, and only its tokens go on. Pieces are
tokenized apart only where the tokenizer cuts anyway (between a word and the newlines before a
line that starts with a non-space character), and only for tokenizers checked to give the same
ids cut there as whole (byte-level BPE does; a tokenizer that adds a prefix space to every call
does not, and gets the whole text at once).
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Iterator

from emllm.errors import EmllmError

PIECE = 1 << 16  # bytes read (and about the characters tokenized) at a time: the tokenizer's allocations for
# a megabyte at once fragment the heap; 64 KiB keeps RSS flat (docs/benchmarks.md, reading input)
_PROBES = ("Hello world\nNext line, with words.", "a b\n\nc d", "x = 1\n    y = 2\nz", "über\nœuvre 12 34\n5",
           "end.\n\nNext 42\n\n\nmore\nsp", "tab\n\tx\ny z\n\n", "It's a dog's life; isn't it?\n(yes) [no]\n",
           "def f(x):\n    return x  # ok\n\nclass A:\n    pass\n", "日本語の文章。\n次の行\nmix 中文 words",
           "a  b   c\td\r\ne\r\n\r\nf", "x1 y2 z3 4a 5 b6c", "naïve café — “quoted” text…\nÉcole")


class InputError(EmllmError):
    """Input that cannot be read as text; the message says what is wrong, `kind` in a word
    ("binary", "empty", "unreadable", "missing", "folder", "device")."""

    def __init__(self, message: str, kind: str = "unreadable") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class TextSource:
    """One document to read: a file, a FIFO or stdin, checked (first piece) up front.

    A regular file is closed once checked and opened again when read, so a job of thousands of
    files (a code base) holds one open file and one piece at a time; a pipe or stdin, which
    cannot be read twice, stays open with its first piece."""

    name: str
    stream: BinaryIO | None  # None: a regular file at `path`, opened when read
    first: bytes
    warn: Callable[[str], None] | None = None
    sha256: str = ""  # of the text as decoded (the header left out), known once read to the end
    chars: int = 0
    path: str | None = None  # the file's path ("-": stdin)
    header: str = ""  # text read before the file's own (a folder's file: its name), not in sha256 or chars
    encoding: str = "utf-8"  # "utf-8-sig" or "utf-16" where the text opens with a byte order mark
    _used: bool = field(default=False, repr=False)

    @classmethod
    def open(cls, path: str, warn: Callable[[str], None] | None = None, header: str = "") -> "TextSource":
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
                raise InputError(f"{path}: no such file", "missing") from None
            except IsADirectoryError:
                raise InputError(f"{path}: is a directory, not a text file", "folder") from None
            except OSError as e:
                raise InputError(f"{path}: cannot read: {e.strerror}") from None
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                os.close(fd)
                raise InputError(f"{path}: is a directory, not a text file", "folder")
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                if not path.startswith("/dev/fd/") and not path.startswith("/proc/self/fd/"):
                    os.close(fd)
                    raise InputError(f"{path}: is a device, not a text file", "device")
            stream = os.fdopen(fd, "rb")
        try:
            first = stream.read(PIECE)
        except OSError as e:
            stream.close()
            raise InputError(f"{name}: cannot read: {e.strerror}") from None
        encoding = _encoding(first)
        if encoding == "utf-16":  # (its NUL bytes are half its ASCII characters)
            if len(first) < PIECE and not first.decode("utf-16", errors="replace").strip():  # (the whole file)
                stream.close()
                raise InputError(f"{name}: is empty: nothing to read", "empty")
        elif b"\x00" in first:
            stream.close()
            raise InputError(f"{name}: looks like a binary file (NUL bytes); give a text file", "binary")
        elif not first.removeprefix(codecs.BOM_UTF8).strip():
            rest = first.removeprefix(codecs.BOM_UTF8)
            while rest and not rest.strip():  # a file of blanks longer than a piece
                rest = stream.read(PIECE)
                if b"\x00" in rest:
                    stream.close()
                    raise InputError(f"{name}: looks like a binary file (NUL bytes); give a text file", "binary")
            if not rest:
                stream.close()
                raise InputError(f"{name}: is empty: nothing to read", "empty")
            first += rest
        if path != "-" and stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
            stream.close()
            return cls(name, None, b"", warn, path=path, header=header, encoding=encoding)
        return cls(name, stream, first, warn, path=path, header=header, encoding=encoding)

    def _reopen(self) -> None:
        """Open the regular file again, at its first piece (checked again: it may have changed)."""
        try:
            self.stream = open(self.path, "rb")  # noqa: SIM115 (closed by `pieces`)
            self.first = self.stream.read(PIECE)
        except OSError as e:
            if self.stream is not None:
                self.stream.close()
            raise InputError(f"{self.name}: cannot read: {e.strerror}") from None
        if _encoding(self.first) != self.encoding:
            self.stream.close()
            raise InputError(f"{self.name}: changed since it was checked (its encoding is not the same); read it again")
        if self.encoding != "utf-16" and (nul := self.first.find(b"\x00")) >= 0:
            self.stream.close()
            raise InputError(f"{self.name}: NUL bytes at byte {nul}: a binary file; give a text file", "binary")

    def pieces(self) -> Iterator[str]:
        """The text, a piece at a time (once); sha256 and chars are set when it ends."""
        assert not self._used, "a stream is read once"
        self._used = True
        if self.stream is None:
            self._reopen()
        bad: list[int] = []

        def replace(e: UnicodeDecodeError) -> tuple[str, int]:  # as errors="replace", noting the first
            if not bad:
                bad.append(at + e.start)
            return "\ufffd", e.end

        handler = f"emllm-replace-{id(self)}"
        codecs.register_error(handler, replace)
        dec = codecs.getincrementaldecoder(self.encoding)(errors=handler)  # (utf-16 drops its byte order mark)
        h = hashlib.sha256()
        data, at = self.first, 0
        try:
            if self.header:
                yield self.header
            while True:
                final = not data
                text = dec.decode(data, final=final)
                if bad and self.warn is not None:
                    self.warn(f"{self.name} is not valid {self.encoding[:6].upper()} (byte {bad[0]}); "
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
                if self.encoding != "utf-16" and (nul := data.find(b"\x00")) >= 0:
                    raise InputError(f"{self.name}: NUL bytes at byte {at + nul}: a binary file; give a text file", "binary")
        finally:
            self.stream.close()
            self.first = b""
        self.sha256 = h.hexdigest()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def _encoding(first: bytes) -> str:
    """UTF-16 where the text opens with its byte order mark (as Windows tools write it), else UTF-8,
    less its byte order mark where it has one (the mark is no part of the text)."""
    if first.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    return "utf-8-sig" if first.startswith(codecs.BOM_UTF8) else "utf-8"


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


# Places where pre-tokenizers end a word whatever follows, most useful first; each is used only for
# a tokenizer that gives the same ids for every probe cut there as whole (`cut_rules`).
_RULES = {
    "newline": re.compile(r"(?<=\S)\n+(?=\S)"),  # a run of newlines between two non-space characters
    "word-newline": re.compile(r"(?<=[^\W_])\n+(?=\S)"),  # the same after a letter or digit only
    "space": re.compile(r"(?<=[^\W_]) (?=[^\W\d_])"),  # one space between a letter or digit and a letter
}
_TAIL = 1 << 16  # characters: a cut is looked for near the end of what is buffered


def cut_rules(tok: Any) -> list[re.Pattern]:
    """The rules at whose places this tokenizer's ids are the same cut as whole (on the probes)."""
    enc = lambda t: tok(t, add_special_tokens=False, split_special_tokens=True)["input_ids"]  # noqa: E731
    return [r for r in _RULES.values()
            if all(enc(s) == enc(s[: m.start()]) + enc(s[m.start():]) for s in _PROBES for m in r.finditer(s))]


def cuts_cleanly(tok: Any) -> bool:
    return bool(cut_rules(tok))


def _last_cut(text: str, rules: list[re.Pattern]) -> int:
    """The last place in text (its last _TAIL characters) where a rule allows a cut (0: none)."""
    lo = max(0, len(text) - _TAIL)
    best = 0
    for r in rules:
        for m in r.finditer(text, lo):
            if m.start() > best:
                best = m.start()
    return best


def token_pieces(encode: Callable[[str], list[int]], pieces: Iterator[str], rules: list[re.Pattern]) -> Iterator[list[int]]:
    """Token ids of the text given in pieces: equal to encode(whole text) (see the module's note).
    rules: `cut_rules(tok)`; none: the whole text is tokenized at once."""
    buf = ""
    for p in pieces:
        buf += p
        if not rules:
            continue
        cut = _last_cut(buf, rules)
        if cut:
            yield encode(buf[:cut])
            buf = buf[cut:]
    if buf:
        yield encode(buf)
