"""A layer's events resident on a device: their keys and values, sizes and representative keys,
copied there so that a step scores, selects and gathers without reading back to the host (the
device step, `engine.window.DEVICE_STEP`). A store's events keep such a copy beside their files
while it fits the device's budget (`store.events.StoredEvents.on_device`).

An integer store's rows stay encoded there (`Codec`: int4 about a third of bfloat16's bytes, int8
a little over half, so three times or twice the events fit the budget), decoded as a step gathers them; the
rows of the tokens read but not yet closed into events wait beside them (`push_tail`), already
encoded, until their events close."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from emllm.memory.buffers import GrowBuffer, padded_index, padded_rows
from emllm.memory.selection import scores_in_blocks, token_scores

# Share of a GPU's free memory, when a store is first stepped on it, that resident events of all
# its layers may take (the rest: the model's activations, the window, other stores).
DEVICE_SHARE = 0.5

_BUDGETS: dict[torch.device, float] = {}


def device_budget(device: torch.device) -> float:
    """Bytes resident events may take on `device`, all layers of all stores together: a share of
    its free memory when first asked (CUDA); elsewhere no limit (the host's RAM holds them anyway)."""
    if device not in _BUDGETS:
        _BUDGETS[device] = torch.cuda.mem_get_info(device)[0] * DEVICE_SHARE if device.type == "cuda" else float("inf")
    return _BUDGETS[device]


@dataclass(frozen=True)
class Codec:
    """How encoded rows are kept and read: row [*shape] uint8 a token, and the decoders (rows
    [n, *row] -> [n, H_kv, D] in the compute dtype) of keys and values."""

    row: tuple[int, ...]
    decode_k: Callable[[Tensor], Tensor]
    decode_v: Callable[[Tensor], Tensor]

    @property
    def row_bytes(self) -> int:
        n = 1
        for s in self.row:
            n *= s
        return n


class ResidentEvents:
    """keys/values [H_kv, T, D] of every event's tokens in stream order (with a codec: their
    encoded rows [T, *row]), lengths [E], reprs [E, dim] (as scored: a float store's dtype, or
    float32), all on `device`."""

    def __init__(self, kv_heads: int, head_dim: int, dim: int, kv_dtype: torch.dtype, r_dtype: torch.dtype,
                 device: torch.device, codec: Codec | None = None) -> None:
        self.device, self.dim, self.codec = device, dim, codec
        if codec is None:
            self.keys = GrowBuffer((kv_heads, 0, head_dim), 1, kv_dtype, device)
            self.values = GrowBuffer((kv_heads, 0, head_dim), 1, kv_dtype, device)
            self._token_bytes = 2 * kv_heads * head_dim * kv_dtype.itemsize
        else:
            self.keys = GrowBuffer((0, *codec.row), 0, torch.uint8, device)
            self.values = GrowBuffer((0, *codec.row), 0, torch.uint8, device)
            self._token_bytes = 2 * codec.row_bytes
            # encoded rows [n, *row] of the tokens after the last event's, in stream order
            self.tail_k = self.tail_v = torch.zeros((0, *codec.row), dtype=torch.uint8, device=device)
        self.lengths = GrowBuffer((0,), 0, torch.long, device)
        self.reprs = GrowBuffer((0, dim), 0, r_dtype, device)
        self._event_bytes = dim * r_dtype.itemsize + 8

    def bytes_for(self, tokens: int, events: int) -> int:
        return tokens * self._token_bytes + events * self._event_bytes

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.keys.n, self.lengths.n)

    def append(self, keys: Tensor, values: Tensor, lengths: Tensor, reprs: Tensor) -> None:
        """keys/values [H_kv, n, D] (any device; with a codec: ignored, the tail's first n rows
        are the events'), lengths [e], reprs [e, dim] as scored."""
        if self.codec is None:
            self.keys.append(keys.to(self.device, non_blocking=True))
            self.values.append(values.to(self.device, non_blocking=True))
        else:
            n = keys.shape[1]
            self.keys.append(self.tail_k[:n])
            self.values.append(self.tail_v[:n])
            self.tail_k, self.tail_v = self.tail_k[n:], self.tail_v[n:]
        self.lengths.append(lengths.to(self.device, non_blocking=True))
        self.reprs.append(reprs.to(self.device, non_blocking=True))

    def push_tail(self, keys: Tensor, values: Tensor) -> None:
        """(a codec's) encoded rows [n, *row] of the tokens just read, in stream order."""
        self.tail_k = torch.cat((self.tail_k, keys.to(self.device, non_blocking=True)))
        self.tail_v = torch.cat((self.tail_v, values.to(self.device, non_blocking=True)))

    def truncate(self, events: int, tokens: int, tail: int = 0) -> None:
        """Back to `events` events over `tokens` token rows; with a codec, `tail` rows after them
        (the tokens read since, that the events forgotten had closed come back to the tail)."""
        if self.codec is not None:
            self.tail_k = torch.cat((self.keys.view()[tokens:], self.tail_k))[:tail]
            self.tail_v = torch.cat((self.values.view()[tokens:], self.tail_v))[:tail]
        self.lengths.n = self.reprs.n = events
        self.keys.n = self.values.n = tokens

    def scores(self, query: Tensor) -> Tensor:
        """query [H_r, D] -> [E] float32 exact scores (`selection.scores_in_blocks`' bits)."""
        rows = self.reprs.view()
        return scores_in_blocks(rows.shape[0], self.dim, lambda a, b: rows[a:b], query.to(self.device))

    def token_scores(self, queries: Tensor) -> Tensor:
        """queries [T, H_r, D] -> [T, E] float32."""
        rows = self.reprs.view()
        return token_scores(rows.shape[0], self.dim, lambda a, b: rows[a:b], queries.to(self.device))

    def gather_masked(self, mask: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
        if self.codec is None:
            return padded_rows(self.keys.view(), self.values.view(), self.lengths.view(), mask, size)
        if self.keys.n == 0:  # (zero rows decode to zeros)
            none = torch.zeros((size, *self.codec.row), dtype=torch.uint8, device=self.device)
            return (self.codec.decode_k(none).transpose(0, 1), self.codec.decode_v(none).transpose(0, 1),
                    torch.zeros(size, dtype=torch.bool, device=self.device))
        rows, valid = padded_index(mask, self.lengths.view(), self.keys.n, size)
        k = self.codec.decode_k(self.keys.view()[rows]).transpose(0, 1)  # [H_kv, size, D]
        v = self.codec.decode_v(self.values.view()[rows]).transpose(0, 1)
        return k, v, valid
