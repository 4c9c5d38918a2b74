"""A layer's events resident on a device: their keys and values, sizes and representative keys,
copied there so that a step scores, selects and gathers without reading back to the host (the
device step, `engine.window.DEVICE_STEP`). A store's events keep such a copy beside their files
while it fits the device's budget (`store.events.StoredEvents.on_device`).

An integer store's rows stay encoded there (`Codec`: int4 about a third of bfloat16's bytes, int8
a little over half, so three times or twice the events fit the budget), decoded as a step gathers them; the
rows of the tokens read but not yet closed into events wait beside them (`push_tail`), already
encoded, until their events close.

Past the budget, `CachedEvents`: the representative keys and sizes stay on the device (scoring and
selection there, as before), and the rows of the events selected lately in a ring of fixed size
(InfLLM keeps such a cache): a step reads its selection back (one wait a layer, to know what to
copy) and copies from the host only the events the ring does not hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from emllm.config import device_memory_setting
from emllm.memory.buffers import GrowBuffer, padded_index, padded_rows
from emllm.memory.cache import EventCache, runs
from emllm.memory.selection import scores_in_blocks, token_scores

# Share of a GPU's free memory, when a store is first stepped on it, that resident events of all
# its layers may take (the rest: the model's activations, the window, other stores).
DEVICE_SHARE = 0.5

_BUDGETS: dict[torch.device, float] = {}


def device_budget(device: torch.device) -> float:
    """Bytes resident events may take on `device`, all layers together: $EMLLM_DEVICE_MEMORY's GB
    where set, else a share of its free memory when first asked (CUDA); on the host no limit
    (its RAM holds them anyway)."""
    if device not in _BUDGETS:
        gb = device_memory_setting() if device.type != "cpu" else None
        if gb is not None:
            _BUDGETS[device] = gb * 2**30
        else:
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

    def bytes_after(self, tokens: int, events: int) -> int:
        """The bytes it would take with `tokens` more token rows and `events` more events."""
        return self.bytes_for(self.keys.n + tokens, self.lengths.n + events)

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


class CachedEvents(ResidentEvents):
    """A layer's events on a device past the budget for all their rows: representative keys [E,
    dim] and lengths [E] there (`scores`, `token_scores` as `ResidentEvents`), rows in an
    `memory.cache.EventCache` of `ring_tokens` rows on the device; `read(ids [m] long) -> keys, values [sum, *row]` (host; the
    encoded rows with a codec) gives the rows of events the ring does not hold.

    `gather_masked` returns what `ResidentEvents.gather_masked` returns for the same events (the
    same rows in the same order, the padding zeros), at the cost of reading the selection back."""

    def __init__(self, kv_heads: int, head_dim: int, dim: int, kv_dtype: torch.dtype, r_dtype: torch.dtype,
                 device: torch.device, codec: Codec | None, ring_tokens: int,
                 read: Callable[[Tensor], tuple[Tensor, Tensor]]) -> None:
        self.device, self.dim, self.codec, self.read = device, dim, codec, read
        row, dt = ((kv_heads, head_dim), kv_dtype) if codec is None else (codec.row, torch.uint8)
        self.ring = EventCache(ring_tokens, row, dt, device)
        self.lengths = GrowBuffer((0,), 0, torch.long, device)
        self.host_lengths = GrowBuffer((0,), 0, torch.long, torch.device("cpu"))
        self.reprs = GrowBuffer((0, dim), 0, r_dtype, device)
        self._event_bytes = dim * r_dtype.itemsize + 8
        self._ring_bytes = ring_tokens * self.row_bytes
        self._stage: tuple[Tensor, Tensor] | None = None  # pinned host rows of the misses (CUDA)

    @classmethod
    def from_resident(cls, dev: ResidentEvents, kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                      host_lengths: Tensor, ring_tokens: int, read: Callable[[Tensor], tuple[Tensor, Tensor]]
                      ) -> "CachedEvents":
        """A full copy that outgrew its budget, its rows dropped (its representative keys kept)."""
        out = cls(kv_heads, head_dim, dev.dim, kv_dtype, dev.reprs.buf.dtype, dev.device, dev.codec, ring_tokens, read)
        out.lengths, out.reprs = dev.lengths, dev.reprs
        out.host_lengths.append(host_lengths)
        return out

    @property
    def row_bytes(self) -> int:
        """A token's key and value in the ring."""
        return 2 * self.ring.k[0].nbytes

    def resize_ring(self, ring_tokens: int) -> None:
        """A new, empty ring of `ring_tokens` rows (the keys grew: the ring gives them room)."""
        self.ring = EventCache(ring_tokens, tuple(self.ring.k.shape[1:]), self.ring.k.dtype, self.device)
        self._ring_bytes = ring_tokens * self.row_bytes

    def bytes_for(self, tokens: int, events: int) -> int:
        return self._ring_bytes + events * self._event_bytes

    def bytes_after(self, tokens: int, events: int) -> int:
        return self.bytes_for(0, self.lengths.n + events)

    @property
    def nbytes(self) -> int:
        return self.bytes_for(0, self.lengths.n)

    def append(self, keys: Tensor, values: Tensor, lengths: Tensor, reprs: Tensor) -> None:
        """lengths [e] (host), reprs [e, dim]; the rows stay where the store keeps them."""
        self.host_lengths.append(lengths)
        self.lengths.append(lengths.to(self.device, non_blocking=True))
        self.reprs.append(reprs.to(self.device, non_blocking=True))

    def push_tail(self, keys: Tensor, values: Tensor) -> None:
        """(rows are read from the store as they are needed)"""

    def truncate(self, events: int, tokens: int, tail: int = 0) -> None:
        self.lengths.n = self.reprs.n = self.host_lengths.n = events
        self.ring.forget_from(events)

    def gather_masked(self, mask: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
        # The one read back of a layer's step: which events to copy. It also waits for the
        # stream, so the staging rows the last copy read from are free to write again.
        ids = mask.nonzero().flatten().cpu().numpy()
        lengths = self.host_lengths.view().numpy()[ids]
        total = int(lengths.sum())
        if total > size:
            raise ValueError(f"a selection of {total} tokens does not fit in {size}")
        ring = self.ring
        out_k = torch.zeros((size, *ring.k.shape[1:]), dtype=ring.k.dtype, device=self.device)
        out_v = torch.zeros_like(out_k)
        at = ring.offsets(ids)
        hit = at >= 0
        first = np.cumsum(lengths) - lengths  # each event's first row in the result
        if hit.any():  # copied out before the misses' rows may overwrite them (the stream's order)
            idx = torch.from_numpy(np.stack((runs(first[hit], lengths[hit]), runs(at[hit], lengths[hit]))))
            idx = idx.to(self.device, non_blocking=True)
            out_k[idx[0]], out_v[idx[0]] = ring.k[idx[1]], ring.v[idx[1]]
            ring.hit_tokens += idx.shape[1]
        miss = ~hit
        if miss.any():
            k, v = self._to_device(*self.read(torch.from_numpy(ids[miss])))
            dst = torch.from_numpy(runs(first[miss], lengths[miss])).to(self.device, non_blocking=True)
            out_k[dst], out_v[dst] = k, v
            rows = ring.place(ids[miss], lengths[miss])
            if rows.size:
                r = torch.from_numpy(rows).to(self.device, non_blocking=True)
                ring.k[r], ring.v[r] = k[: rows.size], v[: rows.size]
            ring.miss_tokens += k.shape[0]
        valid = torch.arange(size, device=self.device) < total
        if self.codec is not None:
            return self.codec.decode_k(out_k).transpose(0, 1), self.codec.decode_v(out_v).transpose(0, 1), valid
        return out_k.transpose(0, 1), out_v.transpose(0, 1), valid

    def _to_device(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Host rows [n, *row] on the device; on CUDA through pinned rows, copied asynchronously."""
        if self.device.type != "cuda":
            return k.to(self.device), v.to(self.device)
        n = k.shape[0]
        if self._stage is None or self._stage[0].shape[0] < n:
            cap = max(n, 1024)
            self._stage = (torch.empty((cap, *k.shape[1:]), dtype=k.dtype, pin_memory=True),
                           torch.empty((cap, *v.shape[1:]), dtype=v.dtype, pin_memory=True))
        sk, sv = self._stage[0][:n], self._stage[1][:n]
        sk.copy_(k)
        sv.copy_(v)
        return sk.to(self.device, non_blocking=True), sv.to(self.device, non_blocking=True)

