"""The base of every error a user can cause and fix: a bad file, an unknown model, a damaged or
locked store, a profile out of bounds. Its message says what is wrong and what to do; the CLI shows
it as one line and exits 1, the server answers it with a 4xx."""

from __future__ import annotations

import contextlib
import errno
from typing import Iterator


class EmllmError(Exception):
    """An error the user can fix (see the module's docstring)."""


class UsageError(EmllmError, ValueError):
    """A value the library cannot take: an empty store name, sampling out of its bounds, a
    conversation whose last message is not the user's."""


class NotFiniteError(EmllmError):
    """The model's output holds NaN or infinities: read from keys or values that do (a damaged or
    edited store), or from weights that do."""


class TooManyOpenFiles(EmllmError):
    """The process holds as many open files as its limit allows (each store open holds a few a
    layer): not a damaged store."""


class Cancelled(EmllmError):
    """An answer stopped by its `cancel()` before it was complete (a server's client gone)."""


@contextlib.contextmanager
def open_files() -> Iterator[None]:
    """Turns running out of file descriptors (EMFILE, ENFILE) into TooManyOpenFiles: the errors
    of a store's files otherwise read as damage."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise TooManyOpenFiles(f"too many files open (this process may open {soft}, `ulimit -n`): raise the "
                               "limit, or keep fewer stores open at once") from None


__all__ = ["EmllmError", "UsageError", "NotFiniteError", "TooManyOpenFiles", "Cancelled", "open_files"]
