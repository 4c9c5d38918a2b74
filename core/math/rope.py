"""Rotary position embedding at positions of our choosing, with the model's own rotary parameters.

The patched model runs with position ids 0, so its attention modules hand us keys and queries
multiplied by the rope type's `attention_scaling` (cos(0) * s) but not rotated. Rotating those with
unscaled cos/sin gives exactly what the model computes (R(s k) = s R(k)), also for partial rotary
dims (Phi-3) where the pass-through part is never scaled.

cos/sin come from the model's rotary module itself, so every rope type it supports (llama3
scaling, LongRoPE with its short/long factors, YaRN, dynamic NTK) is honoured as the model would
for a sequence of the window's length.

Low precision (bf16/fp16)
-------------------------
The module computes ``cos(theta t) * s`` in float32 and casts to the model dtype. At position 0
that is ``s_d = dtype(float32(s))`` (cos 0 = 1, sin 0 = 0), so what reaches us is
``q0 = dtype(q * s_d)``, while the model would use ``dtype(q * dtype(cos * s)) + ...``.
For ``q0 * c`` to equal ``q * cos * s`` we need ``c = cos * s / s_d``: we divide by the *rounded*
scale s_d (read from the module at position 0 in the model dtype), not by s (that would leave a systematic factor s_d / s, up to 2^-9 in bf16 for
LongRoPE/YaRN), and we divide the float32 values before the one cast to the model dtype, so the
table is rounded once, like the model's, instead of dividing already-rounded values.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

_MAX_CACHED = 8  # tables kept for length-dependent rope types (lengths seen: a handful per stream)


class Rotary:
    """cos/sin tables of one model's rotary embedding, without its attention scaling.

    Tables are cached: the engine asks for one every step. For most rope types position t's angle
    does not depend on the table's length, so one table per (device, dtype), grown to the longest
    length asked, is sliced. LongRoPE (short/long factors) and dynamic NTK pick their frequencies
    from the length itself, so for those each length has its own table (a small LRU).
    """

    def __init__(self, rotary_emb: nn.Module, layer_type: str | None = None) -> None:
        """layer_type: the kind of layer whose table this is, for a module that keeps one per kind
        (Gemma 3: local and global bases) and takes it as its third argument; None: it keeps one."""
        self.module = rotary_emb
        self.layer_type = layer_type
        rt = getattr(rotary_emb, "rope_type", "default")
        rt = str(rt.get(layer_type, "default") if isinstance(rt, dict) else rt)
        self.length_dependent = rt == "longrope" or "dynamic" in rt  # as transformers' dynamic_rope_update
        self._cache: OrderedDict[tuple, tuple[Tensor, Tensor, Tensor]] = OrderedDict()  # cos, sin, signed sin

    @torch.no_grad()
    def _compute(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        pos = torch.arange(length, device=device)[None]  # [1, length]
        probe = torch.empty(0, device=device, dtype=torch.float32)  # float32 out: no rounding yet
        # s_d: the factor the model's attention applies at position 0 (module doc), read from the
        # module itself in the model dtype rather than re-derived, then divided out in float32
        zero = torch.zeros(1, 1, dtype=torch.long, device=device)
        s_d = self._call(torch.empty(0, device=device, dtype=dtype), zero)[0][0, 0, :1].float()  # [1]
        cos, sin = self._call(probe, pos)  # [1, length, rotary_dim] float32, scaled by s
        sin = (sin[0] / s_d).to(dtype)
        return (cos[0] / s_d).to(dtype), sin, signed_sin(sin)

    def _call(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        return self.module(x, pos) if self.layer_type is None else self.module(x, pos, self.layer_type)

    def table(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin: [length, rotary_dim] for positions 0..length-1 (read-only: may be cached views)."""
        cos, sin, _ = self._tables(length, device, dtype)
        return cos, sin

    def signed_table(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and `signed_sin(sin)` of `table`, as `rotate` takes them (cached alike)."""
        cos, _, ssin = self._tables(length, device, dtype)
        return cos, ssin

    def _tables(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        device = torch.device(device)
        if self.length_dependent:
            key = (length, device, dtype)
            hit = self._cache.get(key)
            if hit is None:
                hit = self._cache[key] = self._compute(length, device, dtype)
                while len(self._cache) > _MAX_CACHED:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return hit
        key = (device, dtype)
        hit = self._cache.get(key)
        if hit is None or hit[0].shape[0] < length:
            hit = self._cache[key] = self._compute(length, device, dtype)
        return tuple(t[:length] for t in hit)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def signed_sin(sin: Tensor) -> Tensor:
    """sin [..., rotary_dim] with its first half negated: rotate_half(x) * sin is then x with its
    halves swapped times signed_sin(sin), to the bit (a product by -s is the negated product by s)."""
    h = sin.shape[-1] // 2
    return torch.cat((-sin[..., :h], sin[..., h:]), -1)


def rotate(x: Tensor, cos: Tensor, ssin: Tensor) -> Tensor:
    """Rotate x [..., n, head_dim] by cos and the signed sin ssin [n, rotary_dim] (`signed_sin`;
    rotary_dim <= head_dim): x * cos + rotate_half(x) * sin to the bit, each product rounded and
    then the sum (a sum with a negated term is the difference), in four kernels where the halves
    rotated apart take five: a step rotates its queries and keys in every layer, and on a GPU a
    layer's step is paced by its kernel launches."""
    rd = cos.shape[-1]
    h = rd // 2
    if rd == x.shape[-1]:
        out = x * cos
        return out.add_(torch.cat((x[..., h:], x[..., :h]), -1) * ssin)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat((x_rot * cos + torch.cat((x_rot[..., h:], x_rot[..., :h]), -1) * ssin, x_pass), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., n, head_dim] by cos/sin [n, rotary_dim] (rotary_dim <= head_dim): `rotate`
    with the sign made here (a table used often: `Rotary.signed_table`, made once)."""
    return rotate(x, cos, signed_sin(sin))
