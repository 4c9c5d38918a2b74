"""Files inside one folder, never outside it: a store is untrusted input (it may come from anyone).

Every name is checked to be a plain relative name (no `..`, not absolute, no empty part); every
folder on the way is opened relative to the one above it without following a symbolic link, and
the file itself is opened with O_NOFOLLOW and checked to be a regular file. So a store whose
`layers` folder or `tokens.i32` is a link to somewhere else, or whose manifest names `../../x`, is
refused instead of read, truncated or deleted. Opening a FIFO or a device never blocks (O_NONBLOCK
on open; the check refuses them).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path

from emllm.errors import EmllmError, open_files

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(EmllmError, OSError):
    """A name or a file that would take emllm outside the folder, or is no regular file."""


def check_name(rel: str) -> list[str]:
    """The parts of a plain relative name, or UnsafePath."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel:
        raise UnsafePath(f"{rel!r} is not a plain file name inside the store")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePath(f"{rel!r} is not a plain file name inside the store")
    return parts


class Folder:
    """A folder opened once; files under it are reached only through its descriptor."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open_files():
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _parent(self, rel: str, create: bool = False) -> tuple[int, str]:
        """(descriptor of the folder holding rel, its last part); the caller closes the descriptor."""
        parts = check_name(rel)
        with open_files():
            fd = os.dup(self.fd)
        try:
            for p in parts[:-1]:
                if create:
                    try:
                        os.mkdir(p, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                try:
                    with open_files():
                        nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise UnsafePath(f"{p} in the store is a link or not a folder") from None
                    raise
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def open(self, rel: str, flags: int = os.O_RDONLY, mode: int = 0o644, single_link: bool = False) -> int:
        """A descriptor of the regular file rel (flags as os.open; O_CREAT creates the folders on
        the way). single_link: refuse a file with other names (a writer changes only its own files)."""
        dfd, name = self._parent(rel, create=bool(flags & os.O_CREAT))
        try:
            with open_files():
                fd = os.open(name, flags | _NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePath(f"{rel} in the store is a symbolic link") from None
            raise
        finally:
            os.close(dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (single_link and st.st_nlink > 1):
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else "linked to other files (hard link)"
            raise UnsafePath(f"{rel} in the store is {what}")
        os.set_blocking(fd, True)
        return fd

    def read(self, rel: str, limit: int) -> bytes:
        """The bytes of rel, refused past `limit` bytes (a hostile file must not exhaust memory)."""
        fd = self.open(rel)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise UnsafePath(f"{rel} in the store is {size} bytes, more than the {limit} it may be")
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read(limit + 1)
        finally:
            os.close(fd)

    def write_atomic(self, rel: str, data: bytes) -> None:
        """rel replaced by data: a new file written, fsynced and renamed over it; the folder fsynced."""
        dfd, name = self._parent(rel, create=True)
        try:
            tmp = name + ".tmp"
            try:
                os.unlink(tmp, dir_fd=dfd)  # a link planted there is removed, never written through
            except FileNotFoundError:
                pass
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=dfd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def unlink(self, rel: str) -> None:
        """Remove rel if it is there (a link is removed itself, never what it points to)."""
        dfd, name = self._parent(rel)
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)

    def names(self, sub: str = "") -> list[str]:
        """Names in the folder (or its sub-folder `sub`, reached without following a link)."""
        if not sub:
            return os.listdir(self.fd)
        dfd, name = self._parent(sub + "/x")
        try:
            return os.listdir(dfd)
        finally:
            os.close(dfd)

    def lstat(self, rel: str) -> os.stat_result:
        dfd, name = self._parent(rel)
        try:
            return os.stat(name, dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)

    def sync(self) -> None:
        os.fsync(self.fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """path replaced by data (written beside it, fsynced, renamed; a link at the temporary name is
    removed, never written through)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def lock_folder(path: Path) -> int:
    """Take the store's writer lock (non-blocking); readers never take it."""
    try:
        fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{path / 'lock'} is a symbolic link: the store is refused") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePath(f"{path / 'lock'} is not a regular file: the store is refused")
    for _ in range(LOCK_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
        time.sleep(0.01)  # (`folder_written` holds the lock shared for an instant: never a writer's refusal)
    os.close(fd)
    raise FolderLocked(f"{path} is being written by another emllm process; wait for it to finish")


LOCK_TRIES = 20  # of a writer's lock, 10 ms apart


def folder_written(path: Path) -> bool:
    """Whether a writer holds the store's lock now, seen without blocking or creating anything: the
    lock taken shared for an instant (a writer that starts then waits for it, `lock_folder`)."""
    try:
        fd = os.open(path / "lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file (never written since it was made), or not ours to open
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)


class FolderLocked(OSError):
    """Another process holds the folder's lock."""


def descriptors_in_use() -> int | None:
    """How many file descriptors this process has open (Linux's /proc, macOS's /dev/fd), or None
    where the system does not say."""
    for where in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(where))
        except OSError:
            continue
    return None
