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
    ql = q_local.reshape(h_kv, g * c, d)
    logits = torch.matmul(ql, k_local.transpose(1, 2)).mul_(scaling).view(h_kv, g, c, length)
    causal = torch.ones(c, length, dtype=torch.bool, device=q_local.device).triu_(length - c + 1)
    logits.masked_fill_(causal, float("-inf"))
    m = 0 if k_mem is None else k_mem.shape[1]
    if m:
        qm = q_mem.reshape(h_kv, g * c, d)
        mem_logits = torch.matmul(qm, k_mem.transpose(1, 2)).mul_(scaling).view(h_kv, g, c, m)
        logits = torch.cat((mem_logits, logits), dim=-1)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # one softmax over all parts
    p = probs.to(v_local.dtype)
    out = torch.matmul(p[..., m:].reshape(h_kv, g * c, length), v_local)
    if m:
        out += torch.matmul(p[..., :m].reshape(h_kv, g * c, m), v_mem)
    mass = probs[..., m:].sum(2).reshape(h_q, length)  # summed over the chunk's queries
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
