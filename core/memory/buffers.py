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
        cap = self.buf.shape[self.dim]
        if self.n + m > cap:
            new_cap = max(2 * cap, self.n + m)
            shape = list(self.buf.shape)
            shape[self.dim] = new_cap
            grown = torch.empty(shape, dtype=self.buf.dtype, device=self.buf.device)
            grown.narrow(self.dim, 0, self.n).copy_(self.view())
            self.buf = grown
        self.buf.narrow(self.dim, self.n, m).copy_(x)
        self.n += m

    def view(self) -> Tensor:
        return self.buf.narrow(self.dim, 0, self.n)


def token_index(starts: Tensor, lengths: Tensor) -> Tensor:
    """Concatenation of arange(s, s + l) for each (s, l), without a Python loop."""
    total = lengths.sum()
    base = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths, output_size=int(total))
    return base + torch.arange(int(total), device=starts.device)
