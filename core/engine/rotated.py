"""The local window's keys kept rotated across steps of one token.

A chunk's step rotates its whole window at positions 0..L-1 (spec §1): once per chunk, cheap. A
generated token would do the same to a thousand keys in every layer to attend with one query
(and, where attention widens them to float32, the values too: math/attention.py):
the rotation alone was a good share of the attention function's time (docs/benchmark-log.md). Here each key is rotated once (and widened, if asked), at its row's index in
this buffer, and each query at its own row's index: every query-key pair is as far apart as in
the window's rotation, so the scores are the same in exact arithmetic (rotated at other angles,
their last bits differ). Rows leave at the front by moving an offset; when the back runs out, the
window is rotated anew from row 0.

The first token after a chunk is rotated as the chunk path would (the window at 0..L-1): a
document's last chunk of one token computes as before. Later tokens' bits depend on where the
buffer was last rebuilt, which a stream resumed from a store does not know: store writers rotate
the whole window every step instead (LayerWindow.forward); readers and engines in RAM keep it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from emllm.math.rope import rotate


class RotatedWindow:
    """keys/values [H_kv, n, D] (keys before RoPE, the model's dtype) -> rows of `dtype` (the keys'
    if None), key i rotated at position i; room for `slack` more tokens (cos and the signed sin,
    `rope.signed_sin`, must cover n + slack positions)."""

    def __init__(self, keys: Tensor, values: Tensor, cos: Tensor, ssin: Tensor, slack: int,
                 dtype: torch.dtype | None = None) -> None:
        h, n, d = keys.shape
        dtype = keys.dtype if dtype is None else dtype
        self.k = torch.empty(h, n + slack, d, dtype=dtype, device=keys.device)
        self.v = torch.empty_like(self.k)
        # rotated in the keys' dtype, then widened: rounded as the chunk's rotation is
        self.k[:, :n] = rotate(keys, cos[:n].to(keys.device), ssin[:n].to(keys.device))
        self.v[:, :n] = values
        self.a, self.b = 0, n

    @property
    def rows(self) -> int:
        return self.b - self.a

    def full(self) -> bool:
        return self.b == self.k.shape[1]

    def push(self, key: Tensor, value: Tensor, cos: Tensor, ssin: Tensor) -> int:
        """Append one token: key [H_kv, 1, D] before RoPE, value [H_kv, 1, D]. Returns the
        position its query is rotated at (its row's)."""
        p = self.b
        self.k[:, p : p + 1] = rotate(key, cos[p : p + 1].to(key.device), ssin[p : p + 1].to(key.device))
        self.v[:, p : p + 1] = value
        self.b += 1
        return p

    def view(self) -> tuple[Tensor, Tensor]:
        """keys, values [H_kv, rows, D] (views, valid until the next push)."""
        return self.k[:, self.a : self.b], self.v[:, self.a : self.b]

    def drop_front(self, n: int) -> None:
        self.a = min(self.b, self.a + n)
