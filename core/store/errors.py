"""The errors of the store layer: what is wrong, and what to do, without naming CLI flags."""

from __future__ import annotations

from emllm.errors import EmllmError


class StoreError(EmllmError):
    """A store that cannot be used as asked; the message says what is wrong and what to do."""


class CutBackFailed(StoreError):
    """A cut back whose writes failed (a full disk): the store and its mark stay, for a later cut."""


class StoreLockedError(StoreError):
    """Another process is writing the store."""


class ModelMismatchError(StoreError):
    """The model (config, weights or tokenizer) is not the one the store was written with."""

    def __init__(self, message: str, store_model: str) -> None:
        super().__init__(message)
        self.store_model = store_model  # how the store names its model


def lock_store(path):  # -> int
    """Take the store's writer lock (non-blocking; readers never take it), or a StoreError."""
    from .files import FolderLocked, UnsafePath, lock_folder

    try:
        return lock_folder(path)
    except FolderLocked as e:
        raise StoreLockedError(str(e)) from None
    except UnsafePath as e:
        raise StoreError(str(e)) from None
