"""Rotary position embedding at positions of our choosing, with the model's own rotary parameters.

The patched model runs with position ids 0, so its attention modules hand us keys and queries
multiplied by the rope type's `attention_scaling` (cos(0) * s) but not rotated. Rotating those with
unscaled cos/sin gives exactly what the model computes (R(s k) = s R(k)), also for partial rotary
dims (Phi-3) where the pass-through part is never scaled.

cos/sin come from the model's rotary module itself, so every rope type it supports (llama3
scaling, LongRoPE with its short/long factors, YaRN, dynamic NTK) is honoured as the model would
for a sequence of the window's length.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Rotary:
    """cos/sin tables of one model's rotary embedding, without its attention scaling."""

    def __init__(self, rotary_emb: nn.Module) -> None:
        self.module = rotary_emb
        self.scaling = float(getattr(rotary_emb, "attention_scaling", 1.0) or 1.0)

    @torch.no_grad()
    def table(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin: [length, rotary_dim] for positions 0..length-1."""
        pos = torch.arange(length, device=device)[None]  # [1, length]
        probe = torch.empty(0, device=device, dtype=dtype)
        cos, sin = self.module(probe, pos)  # [1, length, rotary_dim], scaled by attention_scaling
        # Divide in float32 then cast: the model's tables are built the same way.
        cos, sin = cos[0], sin[0]
        if self.scaling != 1.0:
            cos, sin = cos / self.scaling, sin / self.scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., n, head_dim] by cos/sin [n, rotary_dim] (rotary_dim <= head_dim)."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
