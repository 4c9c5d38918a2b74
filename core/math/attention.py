"""EM-LLM attention: one softmax over memory (initial tokens, retrieved events, remainder) and
the local window, registered with transformers' `AttentionInterface` under the name "emllm".

The model runs with position ids 0, so the attention modules pass keys and queries before RoPE;
`attend` rotates them itself (spec §1): local keys at 0..len-1 of the window, the chunk's queries
at the window's end, memory keys left at position 0 with the query rotated at `n_local - 1`.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
from torch import Tensor
from transformers import AttentionInterface

from emllm.math.rope import apply_rotary

NAME = "emllm"


class LayerHook(Protocol):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, scaling: float, step: Any) -> Tensor: ...


class Hooks(Protocol):
    """What the model's forward carries to this function (keyword `emllm`): per layer its hook,
    and what the layers of this forward share (passed to each hook)."""

    layers: Sequence[LayerHook]
    step: Any


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

    Query i of the chunk sees window keys 0..L-c+i (causal) and all memory keys: one exact
    softmax. The window's probabilities are written out (the mass needs them: exponentiated once,
    they serve the output and the mass); the memory's part comes with its log-sum-exp, from
    torch's fused flash kernel on the CPU, written out elsewhere (or without that kernel), and the
    two are merged by log-sum-exp.
    """
    memory = _memory_flash if q_local.device.type == "cpu" and _FLASH_CPU is not None else _memory_materialised
    return _attend(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling, memory)


# torch's CPU flash-attention kernel; unlike the public sdpa it also returns the log-sum-exp,
# which is what lets separately rotated parts share one softmax. Absent: the materialised path.
# Only the memory goes through it: the window's probabilities are needed for the mass anyway,
# and exponentiating them once for both beats the kernel plus a second pass for the mass
# (docs/benchmark-log.md, ingest speed).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _memory_flash(q: Tensor, k: Tensor, v: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """The memory's own softmax attention: q [H_kv, g, c, D], k/v [H_kv, M, D] ->
    (output [H_kv, g*c, D] float32, log-sum-exp [H_kv, g*c])."""
    h_kv, g, c, d = q.shape
    o, lse = _FLASH_CPU(q, k[:, None].expand(-1, g, -1, -1), v[:, None].expand(-1, g, -1, -1), is_causal=False, scale=scaling)
    return o.float().reshape(h_kv, g * c, d), lse.reshape(h_kv, g * c)


def _memory_materialised(q: Tensor, k: Tensor, v: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """As `_memory_flash`, with the probabilities written out."""
    h_kv, g, c, d = q.shape
    s = torch.matmul(q.reshape(h_kv, g * c, d), k.transpose(1, 2)).float()  # [H_kv, g*c, M]
    s.mul_(scaling)
    lse = torch.logsumexp(s, -1)
    s.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(s.to(v.dtype), v).float(), lse


def _attend(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling, memory):
    """`attend`, with the memory's part computed by `memory` (`_memory_flash` or `_memory_materialised`).

    The window's scores and probabilities stay in float32 whatever the model's dtype: the mass
    decides which tokens represent an event, and bf16 rounding of it was measured ~100x further
    from the exact value.
    """
    h_q, c, d = q_local.shape
    h_kv, length, _ = k_local.shape
    g = h_q // h_kv
    # GQA without repeating keys: the g query heads of one KV head share its key matrix.
    s = torch.bmm(q_local.reshape(h_kv, g * c, d).float(), k_local.float().transpose(1, 2))  # [H_kv, g*c, L]
    s.mul_(scaling)
    causal = torch.ones(c, c, dtype=torch.bool, device=s.device).triu_(1)
    s.view(h_kv, g, c, length)[..., length - c :].masked_fill_(causal, float("-inf"))
    mx = s.amax(-1)  # [H_kv, g*c]; finite: each query sees itself
    mem = None
    if k_mem is not None and k_mem.shape[1]:
        o_m, lse_m = memory(q_mem.reshape(h_kv, g, c, d), k_mem, v_mem, scaling)
        mx = torch.maximum(mx, lse_m)
        mem = o_m, (lse_m - mx).exp_()  # memory's output, its weight
    s.sub_(mx.unsqueeze(-1)).exp_()
    z = s.sum(-1)  # [H_kv, g*c]
    out = torch.bmm(s, v_local.float())  # [H_kv, g*c, D]
    if mem is not None:
        z += mem[1]
        out += mem[0] * mem[1].unsqueeze(-1)
    inv_z = z.reciprocal_()
    out.mul_(inv_z.unsqueeze(-1))
    # Attention each window key received, summed over the chunk's queries: [H_kv, g, 1, L].
    mass = torch.matmul(inv_z.view(h_kv, g, 1, c), s.view(h_kv, g, c, length)).reshape(h_q, length)
    return out.to(v_local.dtype).view(h_q, c, d), mass


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
    layer: LayerHook = hooks.layers[module.layer_idx]
    out = layer.forward(query[0], key[0], value[0], float(scaling), hooks.step)  # [H_q, c, D]
    return out.transpose(0, 1).unsqueeze(0), None  # [1, c, H_q, D], as transformers expects


def register() -> None:
    AttentionInterface.register(NAME, emllm_attention)


__all__ = ["attend", "emllm_attention", "register", "NAME", "apply_rotary"]
