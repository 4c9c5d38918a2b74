"""One layer's episodic memory: the seam between the engine and where events live (`EventStorage`),
and its implementation in RAM (`EventMemory`; the store's is `emllm.store.events.StoredEvents`).

An event storage is an append-only set of events, each a run of tokens with pre-RoPE keys and
values, plus representative keys that retrieval scores.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from emllm.memory.buffers import GrowBuffer, padded_rows, token_index
from emllm.memory.index import EventIndex
from emllm.memory.selection import Selection, event_scores, token_scores


@runtime_checkable
class EventStorage(Protocol):
    """What the engine asks of one layer's events (`engine.window.LayerWindow.events`)."""

    random_access: bool  # gathering any events is cheap: a step gathers its whole selection
    writer: bool  # a store writer's: the stream must compute as if resumed from what it keeps
    repr_heads: int  # heads of the representative keys (query heads, or KV heads for mean keys)

    def __len__(self) -> int: ...

    @property
    def n_tokens(self) -> int: ...

    def mark(self) -> tuple[int, ...]:
        """Where the storage stands, for `truncate` (an engine's snapshot)."""

    def truncate(self, mark: tuple[int, ...]) -> None:
        """Forget every event after `mark` (a snapshot restored)."""

    def add_tokens(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Tokens the engine reads ([H_kv, c, D] each), returned as they are kept (a store may
        round them through its format)."""

    def append(self, keys: Tensor, values: Tensor, lengths: Tensor, reprs: Tensor) -> None:
        """Add events: keys/values [H_kv, sum(lengths), D], lengths [e], reprs [e, H_r, D]."""

    def repr_keys(self) -> Tensor:
        """[E, H_r, D] float32 every event's representative key."""

    def select(self, query: Tensor, budget: int) -> Selection:
        """The events whose representative keys score best against `query` [H_r, D], up to
        `budget` tokens."""

    def token_scores(self, queries: Tensor) -> Tensor:
        """Every event's exact score for each query [T, H_r, D] -> [T, E] float32."""

    def event_lengths(self) -> Tensor:
        """[E] tokens of each event."""

    def gather(self, ids: Tensor, prefetch: bool = False) -> tuple[Tensor, Tensor]:
        """Keys and values of events `ids` (in that order), concatenated: [H_kv, n, D] each."""

    def on_device(self, device: torch.device) -> bool:
        """Whether a step on `device` can select and gather there (`gather_masked`, `scores` and
        `token_scores` on that device, nothing read back to the host): its rows are there."""

    def lengths_on(self, device: torch.device) -> Tensor:
        """[E] tokens of each event, on `device` (no copy where they are kept there)."""

    def flush(self) -> None:
        """The step is over: write what it left on the device (`Store.defer`)."""

    def gather_masked(self, mask: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
        """(`on_device` storages) the events `mask` [E] selects, padded to `size` rows:
        keys, values [H_kv, size, D] and valid [size] bool."""

    def scores(self, query: Tensor) -> Tensor:
        """(`on_device` storages) every event's exact score for query [H_r, D] -> [E] float32,
        on the query's device."""


class EventMemory:
    """Events of one layer, in RAM (an `EventStorage`).

    keys/values: [H_kv, T, D] for the T tokens of all events, in stream order.
    starts/lengths: [E] each event's offset into that token axis and its size.
    reprs: [E, H_r, D] representative keys, in the retrieval index (float32); H_r = repr_heads:
    the query heads, or the KV heads where each group of query heads would share one key (mean
    keys of a GQA model: a query is then summed over its group before scoring, the same score).
    """

    # gathering events is one index into tensors in memory: a step gathers its whole selection
    # rather than keep the last step's (LayerWindow._gather)
    random_access = True
    writer = False  # (a store writer's memory: the stream must compute as if resumed from it)

    def __init__(
        self, n_kv_heads: int, repr_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
        faiss_threshold: int | None = None,
    ):
        self.repr_heads = repr_heads
        self.keys = GrowBuffer((n_kv_heads, 0, head_dim), 1, dtype, device)
        self.values = GrowBuffer((n_kv_heads, 0, head_dim), 1, dtype, device)
        self.index = EventIndex(repr_heads, head_dim, device, threshold=faiss_threshold)  # reprs, float32
        self.starts = GrowBuffer((0,), 0, torch.long, device)
        self.lengths = GrowBuffer((0,), 0, torch.long, device)

    def __len__(self) -> int:
        return self.lengths.n

    def mark(self) -> tuple[int, int]:
        return self.lengths.n, self.keys.n

    def truncate(self, mark: tuple[int, int]) -> None:
        raise NotImplementedError("events in RAM are not truncated (their index cannot forget)")

    @property
    def n_tokens(self) -> int:
        return self.keys.n

    def add_tokens(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Tokens the engine reads ([H_kv, c, D] each): a memory that keeps every token (a store)
        returns them as it keeps them; this one keeps events only, given whole to `append`."""
        return keys, values

    def append(self, keys: Tensor, values: Tensor, lengths: Tensor, reprs: Tensor) -> None:
        """Add events: keys/values [H_kv, sum(lengths), D], lengths [e], reprs [e, H_r, D]."""
        offsets = torch.cumsum(lengths, 0) - lengths + self.keys.n
        self.keys.append(keys)
        self.values.append(values)
        self.starts.append(offsets)
        self.lengths.append(lengths)
        self.index.add(reprs)

    def repr_keys(self) -> Tensor:
        """[E, H_r, D] float32."""
        return self.index.vectors()

    def select(self, query: Tensor, budget: int) -> Selection:
        """The similarity buffer for `query` [H_r, D]: exact, or faiss past the threshold."""
        return self.index.select(query, self.event_lengths(), budget)

    def token_scores(self, queries: Tensor) -> Tensor:
        """Every event's exact score for each query [T, H_r, D] -> [T, E] float32 (each row the
        bits `event_scores` gives)."""
        flat = self.index.vectors().reshape(len(self), -1)
        return token_scores(flat.shape[0], flat.shape[1], lambda a, b: flat[a:b], queries.to(flat.device))

    def event_lengths(self) -> Tensor:
        return self.lengths.view()

    def on_device(self, device: torch.device) -> bool:
        return True  # (it lives on the engine's device)

    def lengths_on(self, device: torch.device) -> Tensor:
        return self.lengths.view().to(device)

    def flush(self) -> None:
        pass  # (nothing is written anywhere)

    def gather(self, ids: Tensor, prefetch: bool = False) -> tuple[Tensor, Tensor]:
        """Keys and values of events `ids` (in that order), concatenated: [H_kv, n, D] each.
        (prefetch: a hint for a store's files; nothing to do in RAM.)"""
        idx = token_index(self.starts.view()[ids], self.lengths.view()[ids])
        return self.keys.view()[:, idx], self.values.view()[:, idx]

    def gather_masked(self, mask: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
        """Keys and values of the events `mask` [E] selects, padded to `size` rows
        (`buffers.padded_rows`: nothing read back to the host)."""
        return padded_rows(self.keys.view(), self.values.view(), self.lengths.view(), mask, size)

    def scores(self, query: Tensor) -> Tensor:
        """Every event's exact score for `query` [H_r, D] -> [E] float32, on the memory's device."""
        return event_scores(self.index.vectors(), query)
