"""A ring of recently read events' keys and values, for one layer: in RAM for a store's reads on
the host, or on a device for the device step past its budget (`memory.resident.CachedEvents`).

Retrieval picks mostly the same events from one step to the next (every generated token
retrieves, and neighbouring chunks ask about neighbouring text), while reading an event from the
store's map costs page faults and a scattered copy each time (a good share of a decode step:
docs/benchmark-log.md), and copying it to a device costs a transfer. The cache keeps the rows of
the last events read in a ring of `cap` token rows: a hit is a copy within the ring, a miss is
read from the store and written at the ring's head, evicting whatever events it overwrites (first
in, first out; an event read again after its eviction is written again). Its size is fixed: memory
stays bounded however large the store. The bookkeeping is numpy on the host: finding hits and
places reads no tensor back from a device.

Invariant: owner[r] == e exactly when event e is cached and ring row r holds one of its tokens;
where[e] is the ring offset of its first token (or -1), size[e] its length.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + l) for each (s, l)."""
    total = int(lengths.sum())
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total)


class EventCache:
    """Ring of `cap` token rows [cap, *row] for keys and for values on `device`, indexed by event id."""

    def __init__(self, cap: int, row: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device = torch.device("cpu")) -> None:
        if cap < 1:
            raise ValueError(f"cache capacity must be >= 1 token, got {cap}")
        self.cap = cap
        self.k = torch.empty((cap, *row), dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.owner = np.full(cap, -1, np.int64)
        self.where = np.full(256, -1, np.int64)
        self.size = np.zeros(256, np.int64)
        self.head = 0
        self.hit_tokens = 0
        self.miss_tokens = 0

    def _room(self, n_events: int) -> None:
        if n_events > self.where.size:
            grow = max(n_events, 2 * self.where.size) - self.where.size
            self.where = np.concatenate((self.where, np.full(grow, -1, np.int64)))
            self.size = np.concatenate((self.size, np.zeros(grow, np.int64)))

    def offsets(self, ids: np.ndarray) -> np.ndarray:
        """Ring offsets of events ids [n], -1 where not cached."""
        if ids.size:
            self._room(int(ids.max()) + 1)
        return self.where[ids]

    def lookup(self, ids: Tensor) -> Tensor:
        """`offsets` for host tensors: ids [n] long -> [n] long."""
        return torch.from_numpy(self.offsets(ids.numpy()))

    def read(self, offsets: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Rows of cached events (offsets from `lookup`, all >= 0), concatenated: [sum, *row] each."""
        idx = torch.from_numpy(runs(offsets.numpy(), lengths.numpy()))
        self.hit_tokens += idx.numel()
        return self.k[idx], self.v[idx]

    def place(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Ring rows [sum] claimed for events ids [m] (distinct, not cached now), their tokens in
        order, their former owners evicted. Events are placed in order as one run from the head (or
        from row 0 when the run would pass the end); those beyond `cap` tokens in all are left out
        (fewer rows)."""
        fit = int((np.cumsum(lengths) <= self.cap).sum())
        ids, lengths = ids[:fit], lengths[:fit]
        if not fit:
            return np.zeros(0, np.int64)
        self._room(int(ids.max()) + 1)
        total = int(lengths.sum())
        # One contiguous run: from the head, or from the ring's start when it would pass the end
        # (the rows left at the end stay valid until the next turn overwrites them).
        first = np.cumsum(lengths) - lengths + (self.head if self.head + total <= self.cap else 0)
        rows = runs(first, lengths)
        old = np.unique(self.owner[rows])
        old = old[old >= 0]
        if old.size:  # evict whole events that lose any row
            self.owner[runs(self.where[old], self.size[old])] = -1
            self.where[old] = -1
        self.owner[rows] = np.repeat(ids, lengths)
        self.where[ids], self.size[ids] = first, lengths
        self.head = int(first[-1] + lengths[-1]) % self.cap
        return rows

    def insert(self, ids: Tensor, lengths: Tensor, k: Tensor, v: Tensor) -> None:
        """Cache events ids [m] (distinct, not cached now) whose rows k/v [sum(lengths), *row] were
        just read (`place`, then the rows written)."""
        self.miss_tokens += int(lengths.sum())
        rows = self.place(ids.numpy(), lengths.numpy())
        if rows.size:
            r = torch.from_numpy(rows).to(self.k.device, non_blocking=True)
            self.k[r], self.v[r] = k[: rows.size], v[: rows.size]

    def forget_from(self, n_events: int) -> None:
        """Drop the events numbered n_events and after (a reader's, truncated: their numbers come back)."""
        self.owner[self.owner >= n_events] = -1
        self.where[n_events:] = -1


__all__ = ["EventCache", "runs"]
