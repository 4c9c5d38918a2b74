"""A layer's events resident on a device: their keys and values, sizes and representative keys,
copied there so that a step scores, selects and gathers without reading back to the host (the
device step, `engine.window.DEVICE_STEP`). A store's events keep such a copy beside their files
while it fits the device's budget (`store.events.StoredEvents.on_device`)."""

from __future__ import annotations

import torch
from torch import Tensor

from emllm.memory.buffers import GrowBuffer, padded_rows
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


class ResidentEvents:
    """keys/values [H_kv, T, D] of every event's tokens in stream order, lengths [E], reprs
    [E, dim] (as scored: a float store's dtype, or float32), all on `device`."""

    def __init__(self, kv_heads: int, head_dim: int, dim: int, kv_dtype: torch.dtype, r_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.device, self.dim = device, dim
        self.keys = GrowBuffer((kv_heads, 0, head_dim), 1, kv_dtype, device)
        self.values = GrowBuffer((kv_heads, 0, head_dim), 1, kv_dtype, device)
        self.lengths = GrowBuffer((0,), 0, torch.long, device)
        self.reprs = GrowBuffer((0, dim), 0, r_dtype, device)
        self._token_bytes = 2 * kv_heads * head_dim * kv_dtype.itemsize
        self._event_bytes = dim * r_dtype.itemsize + 8

    def bytes_for(self, tokens: int, events: int) -> int:
        return tokens * self._token_bytes + events * self._event_bytes

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.keys.n, self.lengths.n)

    def append(self, keys: Tensor, values: Tensor, lengths: Tensor, reprs: Tensor) -> None:
        """keys/values [H_kv, n, D] (any device), lengths [e], reprs [e, dim] as scored."""
        self.keys.append(keys.to(self.device, non_blocking=True))
        self.values.append(values.to(self.device, non_blocking=True))
        self.lengths.append(lengths.to(self.device, non_blocking=True))
        self.reprs.append(reprs.to(self.device, non_blocking=True))

    def truncate(self, events: int, tokens: int) -> None:
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
        return padded_rows(self.keys.view(), self.values.view(), self.lengths.view(), mask, size)
