"""EM-LLM attention: one softmax over memory (initial tokens, retrieved events, remainder) and
the local window, registered with transformers' `AttentionInterface` under the name "emllm".

The model runs with position ids 0, so the attention modules pass keys and queries before RoPE;
`attend` rotates them itself (spec §1): local keys at 0..len-1 of the window, the chunk's queries
at the window's end, memory keys left at position 0 with the query rotated at `n_local - 1`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor
from transformers import AttentionInterface

from .rope import apply_rotary

NAME = "emllm"


class LayerHook(Protocol):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, scaling: float) -> Tensor: ...


def attend(
    q_local: Tensor,  # [H_q, c, D] queries rotated at their window positions
    k_local: Tensor,  # [H_kv, L, D] window keys (last c are the chunk's), rotated at 0..L-1
    v_local: Tensor,  # [H_kv, L, D]
    q_mem: Tensor | None,  # [H_q, c, D] queries rotated at the memory position
    k_mem: Tensor | None,  # [H_kv, M, D] memory keys, un-rotated
    v_mem: Tensor | None,  # [H_kv, M, D]
    scaling: float,
) -> tuple[Tensor, Tensor]:
    """Returns (output [H_q, c, D], attention mass each window key received [H_q, L], float32).

    Query i of the chunk sees window keys 0..L-c+i (causal) and all memory keys.
    """
    h_q, c, d = q_local.shape
    h_kv, length, _ = k_local.shape
    g = h_q // h_kv
    # GQA without repeating keys: the g query heads of one KV head share its key matrix.
    # The softmax is one over both parts, merged exactly with a shared max and normaliser
    # instead of concatenating the logits (which would copy them once more).
    loc = torch.matmul(q_local.reshape(h_kv, g * c, d), k_local.transpose(1, 2)).float()  # [H_kv, g*c, L]
    loc.mul_(scaling)
    causal = torch.ones(c, c, dtype=torch.bool, device=loc.device).triu_(1)
    loc.view(h_kv, g, c, length)[..., length - c :].masked_fill_(causal, float("-inf"))
    mx = loc.amax(-1, keepdim=True)  # [H_kv, g*c, 1]; finite: each query sees itself
    mem = None
    if k_mem is not None and k_mem.shape[1]:
        mem = torch.matmul(q_mem.reshape(h_kv, g * c, d), k_mem.transpose(1, 2)).float()  # [H_kv, g*c, M]
        mem.mul_(scaling)
        mx = torch.maximum(mx, mem.amax(-1, keepdim=True))
    loc.sub_(mx).exp_()
    z = loc.sum(-1, keepdim=True)
    out = torch.matmul(loc.to(v_local.dtype), v_local).float()
    if mem is not None:
        mem.sub_(mx).exp_()
        z += mem.sum(-1, keepdim=True)
        out += torch.matmul(mem.to(v_mem.dtype), v_mem).float()
    inv_z = z.reciprocal_()  # [H_kv, g*c, 1]
    out.mul_(inv_z)
    # Attention each window key received, summed over the chunk's queries: [H_kv, g, 1, L].
    mass = torch.matmul(inv_z.view(h_kv, g, 1, c), loc.view(h_kv, g, c, length)).reshape(h_q, length)
    out = out.to(v_local.dtype)
    return out.view(h_q, c, d), mass


def emllm_attention(
    module: torch.nn.Module,
    query: Tensor,  # [1, H_q, c, D]
    key: Tensor,  # [1, H_kv, c, D]
    value: Tensor,  # [1, H_kv, c, D]
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    hooks = kwargs.get("emllm")
    if hooks is None:
        raise RuntimeError(
            "the emllm attention runs only through emllm's Engine (it needs the per-layer memory); "
            "call model.set_attn_implementation('sdpa') for a plain forward"
        )
    if query.shape[0] != 1:
        raise ValueError("emllm processes one stream at a time (batch size 1)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer: LayerHook = hooks[module.layer_idx]
    out = layer.forward(query[0], key[0], value[0], float(scaling))  # [H_q, c, D]
    return out.transpose(0, 1).unsqueeze(0), None  # [1, c, H_q, D], as transformers expects


def register() -> None:
    AttentionInterface.register(NAME, emllm_attention)


__all__ = ["attend", "emllm_attention", "register", "NAME", "apply_rotary"]
