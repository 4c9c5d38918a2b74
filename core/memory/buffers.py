"""Growing tensors and index helpers shared by the memory, the engine and the store."""

from __future__ import annotations

import torch
from torch import Tensor


class GrowBuffer:
    """An append-only tensor along dim `dim`, capacity doubled as needed (amortised O(1) append)."""

    def __init__(self, shape: tuple[int, ...], dim: int, dtype: torch.dtype, device: torch.device, cap: int = 256):
        self.dim = dim
        cap_shape = list(shape)
        cap_shape[dim] = cap
        self.buf = torch.empty(cap_shape, dtype=dtype, device=device)
        self.n = 0

    def append(self, x: Tensor) -> None:
        m = x.shape[self.dim]
        if self.n + m > self.buf.shape[self.dim]:
            self.reserve(max(2 * self.buf.shape[self.dim], self.n + m))
        self.buf.narrow(self.dim, self.n, m).copy_(x)
        self.n += m

    def reserve(self, cap: int) -> None:
        """Room for `cap` rows in all, at once (a reader filling a known count: no doubling copies)."""
        if cap <= self.buf.shape[self.dim]:
            return
        shape = list(self.buf.shape)
        shape[self.dim] = cap
        grown = torch.empty(shape, dtype=self.buf.dtype, device=self.buf.device)
        grown.narrow(self.dim, 0, self.n).copy_(self.view())
        self.buf = grown

    def view(self) -> Tensor:
        return self.buf.narrow(self.dim, 0, self.n)


class SlidingRows:
    """Rows along dim 1 (a layer's local window: [H, n, ...]) that grow at the back and leave at
    the front, kept in one buffer with slack: appending writes only the new rows and dropping moves
    an offset, so a generated token does not copy the whole window twice per layer. The rows are
    moved to a new buffer's front only when the back runs out (once every `slack` rows or so)."""

    def __init__(self, rows: Tensor, slack: int = 256) -> None:
        self.slack = slack
        self.set(rows)

    def set(self, rows: Tensor) -> None:
        """Hold a copy of rows [H, n, ...]."""
        n = rows.shape[1]
        shape = list(rows.shape)
        shape[1] = n + self.slack
        self.buf = torch.empty(shape, dtype=rows.dtype, device=rows.device)
        self.buf[:, :n].copy_(rows)
        self.a, self.b = 0, n

    def view(self) -> Tensor:
        """[H, n, ...]: a view of the buffer, valid until the next `append` or `set`."""
        return self.buf[:, self.a : self.b]

    def append(self, x: Tensor) -> Tensor:
        """Append rows x [H, c, ...]; returns the view of all rows, x's last."""
        c = x.shape[1]
        if self.b + c > self.buf.shape[1]:
            n = self.b - self.a
            shape = list(self.buf.shape)
            shape[1] = n + c + max(self.slack, n // 4)
            grown = torch.empty(shape, dtype=self.buf.dtype, device=self.buf.device)
            grown[:, :n].copy_(self.view())
            self.buf, self.a, self.b = grown, 0, n
        self.buf[:, self.b : self.b + c].copy_(x)
        self.b += c
        return self.view()

    def drop_front(self, n: int) -> None:
        self.a = min(self.b, self.a + n)


def token_index(starts: Tensor, lengths: Tensor) -> Tensor:
    """Concatenation of arange(s, s + l) for each (s, l), without a Python loop."""
    total = lengths.sum()
    base = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths, output_size=int(total))
    return base + torch.arange(int(total), device=starts.device)


def padded_rows(keys: Tensor, values: Tensor, lengths: Tensor, mask: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The rows of the events `mask` [E] (bool) selects, in stream order, padded to `size`:
    keys/values [H, T, D] every event's rows, consecutive, lengths [E] -> ([H, size, D],
    [H, size, D], valid [size] bool, the selected rows first). The shapes are fixed by `size`, not
    by the selection, so nothing is read back to the host (a step on a GPU does not wait). The
    selection must fit in `size` (one within that budget does)."""
    t = keys.shape[1]
    if t == 0:
        none = keys.new_zeros(keys.shape[0], size, keys.shape[2])
        return none, values.new_zeros(none.shape), torch.zeros(size, dtype=torch.bool, device=mask.device)
    rows, valid = padded_index(mask, lengths, t, size)
    return keys[:, rows], values[:, rows], valid


def padded_index(mask: Tensor, lengths: Tensor, t: int, size: int) -> tuple[Tensor, Tensor]:
    """`padded_rows`' rows: of t token rows, those of the events `mask` [E] selects (lengths [E],
    consecutive), in order, padded to `size` -> (rows [size] long, valid [size] bool); the padding
    points at a real row (masked by valid). t > 0."""
    take = torch.repeat_interleave(mask, lengths, output_size=t)  # [T] the tokens selected
    rows = torch.nonzero_static(take, size=size, fill_value=t)[:, 0]  # [size]: theirs in order, then t
    valid = rows < t
    return rows.clamp_(max=t - 1), valid
