"""The base of every error a user can cause and fix: a bad file, an unknown model, a damaged or
locked store, a profile out of bounds. Its message says what is wrong and what to do; the CLI shows
it as one line and exits 1, the server answers it with a 4xx."""

from __future__ import annotations


class EmllmError(Exception):
    """An error the user can fix (see the module's docstring)."""


class UsageError(EmllmError, ValueError):
    """A value the library cannot take: an empty store name, sampling out of its bounds, a
    conversation whose last message is not the user's."""


class NotFiniteError(EmllmError):
    """The model's output holds NaN or infinities: read from keys or values that do (a damaged or
    edited store), or from weights that do."""


__all__ = ["EmllmError", "UsageError", "NotFiniteError"]
