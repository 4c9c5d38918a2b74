"""A sliding-window layer of a model that mixes them with global layers (Gemma 2 and 3).

Such a layer never attended further than its window in the plain model, so it gets no memory:
it keeps the keys and values of the window's last `size - 1` tokens (before RoPE) and attends as
the plain model does, each query to itself and the `size - 1` tokens before it. Its keys are
rotated at their rows' indices in the window with the layer's own rotary table (Gemma 3's local
base): the same distances as the plain model's absolute positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from emllm.math.attention import attend_band
from emllm.memory.buffers import SlidingRows
from emllm.math.rope import rotate


@dataclass
class SlidingLayer:
    layer_idx: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    size: int  # the model's sliding window: a query sees itself and size - 1 tokens before it
    n_seen: int = 0  # tokens of the stream this layer has processed

    def __post_init__(self) -> None:
        empty = torch.zeros(self.n_kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        # sliding buffers, as a memory layer's window: a step writes its rows, the oldest leave by an offset
        self._k, self._v = SlidingRows(empty), SlidingRows(empty)

    @property
    def keys(self) -> Tensor:
        """[H_kv, <= size - 1, D] the window's keys before RoPE (a view: valid until the next step)."""
        return self._k.view()

    @property
    def values(self) -> Tensor:
        return self._v.view()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scaling: float, st, softcap: float | None = None) -> Tensor:
        """q [H_q, c, D], k/v [H_kv, c, D], pre-RoPE; st: the step's StepInfo (its sliding_rope).
        Returns [H_q, c, D]."""
        c = q.shape[1]
        keys, values = self._k.append(k), self._v.append(v)  # [H_kv, L, D]
        length = keys.shape[1]
        cos, ssin = (t[:length].to(q.device) for t in st.sliding_rope)
        out = attend_band(rotate(q, cos[length - c :], ssin[length - c :]), rotate(keys, cos, ssin),
                          values, self.size, scaling, softcap)
        keep = min(length, self.size - 1)
        self._k.drop_front(length - keep)
        self._v.drop_front(length - keep)
        self.n_seen += c
        return out

    def state(self) -> dict[str, Tensor]:
        """What continues this layer's stream: its window's keys and values, and its token count
        (named apart from a memory layer's window, which a store keeps in its layer files)."""
        own = lambda t: t.clone(memory_format=torch.contiguous_format)  # noqa: E731 (views a step overwrites)
        return {"window_k": own(self.keys), "window_v": own(self.values), "n_seen": torch.tensor(self.n_seen)}

    def load_state(self, state: dict[str, Tensor]) -> None:
        """Continue from `state` (read from a store: shapes checked first, ValueError)."""
        k, v = state.get("window_k"), state.get("window_v")
        h, d = self.n_kv_heads, self.head_dim
        if k is None or v is None or k.ndim != 3 or k.shape[0] != h or k.shape[2] != d or v.shape != k.shape:
            raise ValueError(f"layer {self.layer_idx}: sliding window keys/values of the wrong shape")
        n_seen = int(state.get("n_seen", -1))
        if n_seen < 0 or k.shape[1] != min(n_seen, self.size - 1):
            raise ValueError(f"layer {self.layer_idx}: a sliding window of {k.shape[1]} tokens after {n_seen}")
        if not bool(torch.isfinite(k).all()) or not bool(torch.isfinite(v).all()):
            raise ValueError(f"layer {self.layer_idx}: sliding window keys or values are not finite")
        self._k, self._v = SlidingRows(k.to(self.device, self.dtype)), SlidingRows(v.to(self.device, self.dtype))
        self.n_seen = n_seen
