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

    Query i of the chunk sees window keys 0..L-c+i (causal) and all memory keys. On the CPU the
    output comes from torch's fused flash kernel, part by part, merged by log-sum-exp; elsewhere
    (or without that kernel) from materialised probabilities. Both are one exact softmax.
    """
    if q_local.device.type == "cpu" and _FLASH_CPU is not None:
        return _attend_fused(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling)
    return _attend_materialised(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling)


# torch's CPU flash-attention kernel; unlike the public sdpa it also returns the log-sum-exp,
# which is what lets separately rotated parts share one softmax. Absent: the materialised path.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_fused(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling):
    h_q, c, d = q_local.shape
    h_kv, length, _ = k_local.shape
    g = h_q // h_kv

    def part(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
        # GQA: [H_kv, g, c, D] queries against keys expanded over g without a copy.
        o, lse = _FLASH_CPU(
            q.reshape(h_kv, g, c, d), k[:, None].expand(-1, g, -1, -1), v[:, None].expand(-1, g, -1, -1),
            is_causal=causal, scale=scaling,
        )
        return o.float(), lse  # [H_kv, g, c, D], [H_kv, g, c] float32

    # The chunk's own keys form a square c x c block, where the kernel's (top-left) causal mask
    # is the right one; the older window keys and the memory are seen by every query.
    parts = [part(q_local, k_local[:, length - c :], v_local[:, length - c :], True)]
    if length > c:
        parts.append(part(q_local, k_local[:, : length - c], v_local[:, : length - c], False))
    if k_mem is not None and k_mem.shape[1]:
        parts.append(part(q_mem, k_mem, v_mem, False))
    lse = parts[0][1]
    for _, p_lse in parts[1:]:
        lse = torch.logaddexp(lse, p_lse)
    out = parts[0][0] * (parts[0][1] - lse).exp_().unsqueeze(-1)
    for o, p_lse in parts[1:]:
        out += o * (p_lse - lse).exp_().unsqueeze(-1)
    # Mass: the probabilities of the window keys, exp(q.k * scaling - lse), summed over queries.
    # The kernel does not give them, so the window's scores are computed once more (no output
    # product, no softmax pass). -lse rides in the product as one more dimension of q against a
    # key component of 1 (a broadcast add would cost a pass, and baddbmm copies it at a crawl).
    qa = torch.cat((q_local.reshape(h_kv, g * c, d).float() * scaling, -lse.reshape(h_kv, g * c, 1)), -1)
    ka = torch.cat((k_local.float(), k_local.new_ones(h_kv, length, 1, dtype=torch.float32)), -1)
    scores = torch.bmm(qa, ka.transpose(1, 2))  # [H_kv, g*c, L]
    causal = torch.ones(c, c, dtype=torch.bool, device=scores.device).triu_(1)
    scores.view(h_kv, g, c, length)[..., length - c :].masked_fill_(causal, float("-inf"))
    scores.exp_()
    ones = torch.ones(h_kv, g, 1, c, dtype=scores.dtype, device=scores.device)
    mass = torch.matmul(ones, scores.view(h_kv, g, c, length)).reshape(h_q, length)
    return out.to(v_local.dtype).view(h_q, c, d), mass


def _attend_materialised(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling):
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
