"""Append-only files of fixed-shape rows, read by pread or a map through a descriptor opened safely."""

from __future__ import annotations

import mmap
import os
import warnings

import numpy as np
import torch
from torch import Tensor

from emllm.errors import open_files
from emllm.store.errors import StoreError
from emllm.store.files import Folder, UnsafePath


READ_GAP = 4 << 10  # bytes: scattered rows closer than this are read in one call
_BLOCKS: dict[tuple[torch.dtype, tuple[int, ...]], Tensor] = {}  # read_block's buffers, one per row shape

# A reader maps its layer files for gathering (`RowFile.rows_at`) while they total at most this
# share of the machine's memory: the page cache then holds them, and a step costs one copy. A
# store larger than that faults from the disk; pread with WILLNEED reads its runs together, faster
# then than the map (a 1M-token store on a machine of its size: docs/benchmark-log.md).
MAP_SHARE = 0.5


def mappable(nbytes: int) -> bool:
    """Whether files of `nbytes` in all fit the page cache well enough to be read through maps."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such query here: read as if they did not fit
        return False
    return nbytes <= MAP_SHARE * ram


# torch dtype <-> (name, numpy dtype of the raw bytes). bfloat16 has no numpy type: stored as u2.
_DTYPES = {
    torch.float32: ("float32", np.dtype("<f4")),
    torch.float16: ("float16", np.dtype("<f2")),
    torch.bfloat16: ("bfloat16", np.dtype("<u2")),
    torch.int32: ("int32", np.dtype("<i4")),
    torch.uint8: ("uint8", np.dtype("u1")),
}
_BY_NAME = {name: (t, n) for t, (name, n) in _DTYPES.items()}


def finite(*xs: Tensor) -> bool:
    """Whether every number in xs is finite: their sum is (NaN and infinities carry through a sum;
    one reduction, far cheaper than `isfinite().all()`)."""
    total = sum(x.sum(dtype=torch.float32) for x in xs)
    return bool(torch.isfinite(total)) if isinstance(total, Tensor) else True


# -- raw arrays -----------------------------------------------------------------------------------
class RowFile:
    """An append-only file of fixed-shape rows: scattered rows read with pread (`take`, a
    writer's) or indexed in a memory map (`rows_at`, a reader's), blocks into a reused buffer
    (`read_block`), whole ranges through the map (`read`).

    `rows` counts rows written by this process or committed before it; reads never reach past it.
    The map is refreshed lazily when a read needs rows written since it was made.
    """

    def __init__(self, folder: Folder, name: str, row: tuple[int, ...], dtype: torch.dtype, rows: int, writable: bool) -> None:
        self.folder, self.name = folder, name
        self.path, self.row, self.dtype, self.rows, self.writable = folder.path / name, tuple(row), dtype, rows, writable
        self.np_dtype = _DTYPES[dtype][1]
        self.row_bytes = int(np.prod(self.row, dtype=np.int64)) * self.np_dtype.itemsize
        self._map: np.ndarray | None = None
        self._mm: mmap.mmap | None = None
        self._mt: Tensor | None = None  # the map as a tensor (`rows_at`)
        self._fd: int | None = None
        self._rfd: int | None = None  # a reader's descriptor
        self._trimmed = False  # a writer drops the uncommitted tail at its first append, not at open
        if writable:
            try:  # a file the manifest gives rows must be there: never created empty in its place
                self._fd = folder.open(name, os.O_RDWR | (0 if rows else os.O_CREAT), single_link=True)
            except FileNotFoundError:
                raise StoreError(f"{name} is missing from the store: the store is damaged") from None
            except UnsafePath as e:
                raise StoreError(f"{e}: the store is refused (emllm writes only files that are its own)") from None
            if rows:
                self.check_size()  # never extend a truncated file with zeros

    def check_size(self) -> None:
        try:
            size = os.fstat(self._reader_fd()).st_size
        except FileNotFoundError:
            if self.rows == 0:
                return
            raise StoreError(f"{self.name} is missing from the store") from None
        if size < self.rows * self.row_bytes:
            raise StoreError(
                f"{self.name} is truncated ({size} bytes, the manifest needs "
                f"{self.rows * self.row_bytes}): the store is damaged; re-ingest the document"
            )

    def append(self, x: Tensor) -> None:
        """x [n, *row] in this file's dtype."""
        assert self._fd is not None, "read-only"
        if not self._trimmed:
            os.ftruncate(self._fd, self.rows * self.row_bytes)  # drop an uncommitted tail
            os.lseek(self._fd, 0, os.SEEK_END)
            self._trimmed = True
        data = x.detach().to("cpu", self.dtype).contiguous()
        if self.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        view = memoryview(data.numpy()).cast("B")  # (written from the tensor's own memory: no copy)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.rows += int(x.shape[0])

    def sync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def _mapped(self, need: int) -> np.ndarray:
        if self._map is None or self._map.shape[0] < need:
            self._map = None
            if self.rows == 0:
                return np.zeros((0, *self.row), dtype=self.np_dtype)
            # mapped through the descriptor opened safely, never by path
            with open_files():  # (a map holds a descriptor of its own)
                self._mm = mmap.mmap(self._reader_fd(), self.rows * self.row_bytes, access=mmap.ACCESS_READ)
            if hasattr(mmap, "MADV_RANDOM"):
                self._mm.madvise(mmap.MADV_RANDOM)  # faults read their page only (reads ask for the range ahead)
            self._map = np.frombuffer(self._mm, dtype=self.np_dtype).reshape(self.rows, *self.row)
        return self._map

    def _tensor(self, a: np.ndarray) -> Tensor:
        with warnings.catch_warnings():  # a read-only map: nobody writes through these tensors
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(np.ascontiguousarray(a))
        return t.view(torch.bfloat16) if self.dtype == torch.bfloat16 else t

    def take(self, idx: Tensor) -> Tensor:
        """Rows idx [n] (long, < rows) -> [n, *row], read (pread) a run of nearby rows at a time.

        The rows are sorted into runs (rows less than `READ_GAP` bytes apart share one: reading
        the gap costs less than another call); the kernel is told of every run first
        (POSIX_FADV_WILLNEED), so a cold read sends them to the disk together instead of one
        fault at a time, then each run is read with one pread. Nothing is mapped, so resident
        memory is the result alone however much of the store the chunks attend to, and a warm
        read costs no page faults (figures: docs/benchmark-log.md, the store at scale)."""
        if idx.numel() == 0:
            return torch.zeros((0, *self.row), dtype=self.dtype)
        rows = (idx if idx.device.type == "cpu" else idx.cpu()).numpy()
        inv = None
        if rows.size > 1 and not bool((rows[1:] > rows[:-1]).all()):
            rows, inv = np.unique(rows, return_inverse=True)
        first, starts, stops = self._runs(rows)
        self._willneed_runs(starts, stops)
        size = stops - starts
        at = np.cumsum(size) - size  # each run's first row in buf
        buf = torch.empty((int(size.sum()), *self.row), dtype=self.dtype)
        raw, rb, fd = memoryview(buf.view(torch.uint8).numpy().reshape(-1)), self.row_bytes, self._reader_fd()
        for a, n, o in zip((starts * rb).tolist(), (size * rb).tolist(), (at * rb).tolist()):  # one call per run
            if os.preadv(fd, [raw[o : o + n]], a) != n:  # short: only at the end of the file
                self._pread(buf[o // rb : (o + n) // rb], a // rb, (a + n) // rb)
        if inv is None and buf.shape[0] == rows.size:
            return buf  # no gaps, no repeats: the rows themselves
        pos = np.repeat(at - starts, np.diff(np.concatenate((first, [rows.size])))) + rows  # each row's place in buf
        return buf[torch.from_numpy(pos if inv is None else pos[inv])]

    def rows_at(self, idx: Tensor, prefetch: bool = False) -> Tensor:
        """Rows idx [n] (long, < rows) -> [n, *row], indexed in a map of the file: one copy, where
        `take` costs a read call per run (several times the time for a generated token's events:
        docs/benchmark-log.md). For readers: the pages it touches stay mapped, counted in the
        resident memory as the page cache's (shared, clean: the kernel takes them back as it needs).

        prefetch: first tell the kernel of the rows' runs (WILLNEED), so that pages not cached come
        from the disk together instead of one fault at a time (most of a cold `emllm ask`'s wait
        for its first token, before: docs/benchmark-log.md, the store at scale). For a chunk's
        gathers; a generated token's skip it (at 256k the calls cost a quarter more time a token)."""
        if self._mt is None or self._mt.shape[0] < self.rows:
            self._mt = self._tensor(self._mapped(self.rows))
            if self._mm is not None and hasattr(mmap, "MADV_NORMAL"):
                self._mm.madvise(mmap.MADV_NORMAL)
        if prefetch and idx.numel():  # (a question's or a chunk's whole selection: see the docstring)
            _, starts, stops = self._runs(np.unique(idx.cpu().numpy()))
            self._willneed_runs(starts, stops)
        return self._mt.index_select(0, idx)

    def _runs(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Increasing rows [n] -> (first, starts, stops): the runs that read them, rows less than
        `READ_GAP` bytes apart sharing one; first[i] is the index in rows of run i's first row."""
        cut = np.flatnonzero(np.diff(rows) > 1 + READ_GAP // self.row_bytes) + 1
        first = np.concatenate(([0], cut))  # (np.r_ costs more a call)
        return first, rows[first], rows[np.concatenate((cut - 1, [rows.size - 1]))] + 1

    def _willneed_runs(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """POSIX_FADV_WILLNEED for row ranges [starts[i], stops[i]) (a hint: skipped where the OS has none)."""
        if not hasattr(os, "posix_fadvise"):
            return
        fd = self._reader_fd()
        for a, b in zip((starts * self.row_bytes).tolist(), (stops * self.row_bytes).tolist()):  # one call per run
            os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)

    def read_block(self, start: int, stop: int) -> Tensor:
        """Rows start..stop-1 [n, *row], read (pread) into a buffer that the next call, of any
        file with rows of this shape, reuses (one per shape: fresh memory costs page faults).

        For scans: the rows are copied from the page cache, never mapped, so scanning a whole file
        at every step adds nothing to the resident memory of the process but the buffer.
        """
        n = stop - start
        key = (self.dtype, self.row)
        buf = _BLOCKS.get(key)
        if buf is None or buf.shape[0] < n:
            buf = _BLOCKS[key] = torch.empty((n, *self.row), dtype=self.dtype)
        return self._pread(buf[:n], start, stop)

    def read_copy(self, start: int, stop: int) -> Tensor:
        """Rows start..stop-1 [n, *row] in a new tensor, read (pread): nothing stays mapped."""
        return self._pread(torch.empty((stop - start, *self.row), dtype=self.dtype), start, stop)

    def _reader_fd(self) -> int:
        if self._fd is None and self._rfd is None:
            try:
                self._rfd = self.folder.open(self.name)
            except UnsafePath as e:
                raise StoreError(f"{e}: the store is refused") from None
        return self._fd if self._fd is not None else self._rfd  # type: ignore[return-value]

    def _pread(self, out: Tensor, start: int, stop: int) -> Tensor:
        fd = self._reader_fd()
        raw = memoryview(out.view(torch.uint8).numpy().reshape(-1))
        pos, end = start * self.row_bytes, stop * self.row_bytes
        while pos < end:
            got = os.preadv(fd, [raw[pos - start * self.row_bytes :]], pos)
            if got == 0:
                raise StoreError(f"{self.name} is truncated: the store is damaged; re-ingest the document")
            pos += got
        return out

    def read(self, start: int = 0, stop: int | None = None) -> Tensor:
        stop = self.rows if stop is None else stop
        if stop <= start:
            return torch.zeros((0, *self.row), dtype=self.dtype)
        m = self._mapped(stop)
        if self._map is not None:  # the map reads no further than a fault: ask for the range at once
            self._willneed_runs(np.array([start]), np.array([stop]))
        return self._tensor(m[start:stop])

    def close(self) -> None:
        self._map = self._mt = None
        self._mm = None  # closed when the last array over it goes
        for fd in (self._fd, self._rfd):
            if fd is not None:
                os.close(fd)
        self._fd = self._rfd = None
