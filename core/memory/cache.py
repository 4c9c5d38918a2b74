"""An in-RAM cache of recently read events' keys and values, for one layer of a store.

Retrieval picks mostly the same events from one step to the next (every generated token
retrieves, and neighbouring chunks ask about neighbouring text), while reading an event from the
store's map costs page faults and a scattered copy each time (a good share of a decode step:
docs/benchmark-log.md). The cache keeps the rows of the last events read in a ring of
`cap` token rows: a hit is one contiguous copy, a miss is read from the store and written at the
ring's head, evicting whatever events it overwrites (first in, first out; an event read again
after its eviction is written again). Its size is fixed: RAM stays bounded however large the store.

Invariant: owner[r] == e exactly when event e is cached and ring row r holds one of its tokens;
where[e] is the ring offset of its first token (or -1), size[e] its length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from emllm.memory.buffers import token_index


class EventCache:
    """Ring of `cap` token rows [cap, *row] for keys and for values, indexed by event id."""

    def __init__(self, cap: int, row: tuple[int, ...], dtype: torch.dtype) -> None:
        if cap < 1:
            raise ValueError(f"cache capacity must be >= 1 token, got {cap}")
        self.cap = cap
        self.k = torch.empty((cap, *row), dtype=dtype)
        self.v = torch.empty((cap, *row), dtype=dtype)
        self.owner = torch.full((cap,), -1, dtype=torch.long)
        self.where = torch.full((256,), -1, dtype=torch.long)
        self.size = torch.zeros(256, dtype=torch.long)
        self.head = 0
        self.hit_tokens = 0
        self.miss_tokens = 0

    def _room(self, n_events: int) -> None:
        if n_events > self.where.numel():
            grow = max(n_events, 2 * self.where.numel()) - self.where.numel()
            self.where = torch.cat((self.where, torch.full((grow,), -1, dtype=torch.long)))
            self.size = torch.cat((self.size, torch.zeros(grow, dtype=torch.long)))

    def lookup(self, ids: Tensor) -> Tensor:
        """Ring offsets of events ids [n] (long), -1 where not cached."""
        if ids.numel() == 0:
            return ids.clone()
        self._room(int(ids.max()) + 1)
        return self.where[ids]

    def read(self, offsets: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Rows of cached events (offsets from `lookup`, all >= 0), concatenated: [sum, *row] each."""
        idx = token_index(offsets, lengths)
        self.hit_tokens += idx.numel()
        return self.k[idx], self.v[idx]

    def insert(self, ids: Tensor, lengths: Tensor, k: Tensor, v: Tensor) -> None:
        """Cache events ids [m] (distinct, not cached now) whose rows k/v [sum(lengths), *row] were just read.

        Events are written in order as one run from the head (or from row 0 when the run would
        pass the end); those beyond `cap` tokens in all are left out.
        """
        self.miss_tokens += int(lengths.sum())
        fit = torch.cumsum(lengths, 0) <= self.cap
        if not bool(fit.all()):
            n_fit = int(fit.sum())
            ids, lengths = ids[:n_fit], lengths[:n_fit]
            k, v = k[: int(lengths.sum())], v[: int(lengths.sum())]
        if ids.numel() == 0:
            return
        self._room(int(ids.max()) + 1)
        excl = torch.cumsum(lengths, 0) - lengths
        total = int(lengths.sum())
        # One contiguous run: from the head, or from the ring's start when it would pass the end
        # (the rows left at the end stay valid until the next turn overwrites them).
        offsets = excl + (self.head if self.head + total <= self.cap else 0)
        rows = token_index(offsets, lengths)
        old = torch.unique(self.owner[rows])
        old = old[old >= 0]
        old = old[self.where[old] >= 0]  # (only cached events own rows; a guard, not a case)
        if old.numel():  # evict whole events that lose any row
            self.owner[token_index(self.where[old], self.size[old])] = -1
            self.where[old] = -1
        self.k[rows], self.v[rows] = k, v
        self.owner[rows] = torch.repeat_interleave(ids, lengths, output_size=rows.numel())
        self.where[ids], self.size[ids] = offsets, lengths
        self.head = int(offsets[-1] + lengths[-1]) % self.cap


__all__ = ["EventCache"]
