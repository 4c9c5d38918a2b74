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
    memory's part comes from torch's fused flash kernel and is merged by log-sum-exp with the
    window's materialised probabilities; elsewhere (or without that kernel) all probabilities are
    materialised. Both are one exact softmax.
    """
    if q_local.device.type == "cpu" and _FLASH_CPU is not None:
        return _attend_hybrid(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling)
    return _attend_materialised(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling)


# torch's CPU flash-attention kernel; unlike the public sdpa it also returns the log-sum-exp,
# which is what lets separately rotated parts share one softmax. Absent: the materialised path.
# Only the memory goes through it: the window's probabilities are needed for the mass anyway,
# and exponentiating them once for both beats the kernel plus a second pass for the mass
# (measured: 41-44 ms against 41-48 per layer and chunk on SmolLM2, 2 threads; 63-66 against
# 71-74 with 1 thread).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_hybrid(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling):
    """The window materialised, the memory through the flash kernel, merged by log-sum-exp.

    The window's probabilities are needed anyway for the mass: exponentiated once, they serve the
    output and the mass (running the kernel on the window too would exponentiate them twice).
    Scores and probabilities stay in float32 whatever the model's dtype, as inside the kernel: the
    mass decides which tokens represent an event, and bf16 rounding of it was measured ~100x
    further from the exact value.
    """
    h_q, c, d = q_local.shape
    h_kv, length, _ = k_local.shape
    g = h_q // h_kv
    s = torch.bmm(q_local.reshape(h_kv, g * c, d).float(), k_local.float().transpose(1, 2))  # [H_kv, g*c, L]
    s.mul_(scaling)
    causal = torch.ones(c, c, dtype=torch.bool, device=s.device).triu_(1)
    s.view(h_kv, g, c, length)[..., length - c :].masked_fill_(causal, float("-inf"))
    mx = s.amax(-1)  # [H_kv, g*c]; finite: each query sees itself
    mem = None
    if k_mem is not None and k_mem.shape[1]:
        o_m, lse_m = _FLASH_CPU(
            q_mem.reshape(h_kv, g, c, d), k_mem[:, None].expand(-1, g, -1, -1), v_mem[:, None].expand(-1, g, -1, -1),
            is_causal=False, scale=scaling,
        )
        lse_m = lse_m.reshape(h_kv, g * c)
        mx = torch.maximum(mx, lse_m)
        mem = o_m.float().reshape(h_kv, g * c, d), (lse_m - mx).exp_()  # memory's output, its weight
    s.sub_(mx.unsqueeze(-1)).exp_()
    z = s.sum(-1)  # [H_kv, g*c]
    out = torch.bmm(s, v_local.float())  # [H_kv, g*c, D]
    if mem is not None:
        z += mem[1]
        out += mem[0] * mem[1].unsqueeze(-1)
    inv_z = z.reciprocal_()
    out.mul_(inv_z.unsqueeze(-1))
    mass = torch.matmul(inv_z.view(h_kv, g, 1, c), s.view(h_kv, g, c, length)).reshape(h_q, length)
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
