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
    def forward(self, q: Tensor, k: Tensor, v: Tensor, scaling: float, step: Any,
                softcap: float | None = None) -> Tensor: ...


class Hooks(Protocol):
    """What the model's forward carries to this function (keyword `emllm`): per layer its hook,
    and what the layers of this forward share (passed to each hook)."""

    layers: Sequence[LayerHook]
    step: Any


def attend(
    q_local: Tensor,  # [H_q, c, D] queries rotated at their window positions (the model's dtype: the output's)
    k_local: Tensor,  # [H_kv, L, D] window keys (last c are the chunk's), rotated at 0..L-1 (or all shifted alike)
    v_local: Tensor,  # [H_kv, L, D] (the model's dtype or float32)
    q_mem: Tensor | None,  # [H_q, c, D] queries rotated at the memory position
    k_mem: Tensor | None,  # [H_kv, M, D] memory keys, un-rotated
    v_mem: Tensor | Sequence[Tensor] | None,  # [H_kv, M, D], or its parts [H_kv, M_i, D] in order
    scaling: float,
    with_mass: bool = True,
    mem_valid: Tensor | None = None,  # [V <= M] bool: which of the memory's last V rows count (a selection padded to its budget); None: all
    softcap: float | None = None,  # scores s become softcap * tanh(s / softcap) (Gemma 2); None: as they are
    out_dtype: torch.dtype | None = None,  # the output's; None: the queries' (widened queries: the model's given)
) -> tuple[Tensor, Tensor | None]:
    """Returns (output [H_q, c, D], attention mass each window key received [H_q, L], float32;
    None unless `with_mass`).

    Query i of the chunk sees window keys 0..L-c+i (causal) and all memory keys: one exact
    softmax. On the CPU, a step without the mass, and a chunk of many queries with it, runs
    torch's fused flash kernel only, in the inputs' dtype (`_attend_fused`: nothing of size
    [H_q, c, L] written out); other few-query steps with the mass write the window's
    probabilities out in float32 and take the memory's part from the kernel with its
    log-sum-exp (`_attend`); elsewhere (CUDA), and for a selection padded to its budget, one
    softmax over memory and window written out in float32 (`_attend_joint`). The output is in the
    queries' dtype.
    """
    c = q_local.shape[1]
    cpu = q_local.device.type == "cpu"
    if attends_jointly(q_local.device, mem_valid):  # (a device's step: its padding masked)
        # (the memory's values given in parts join the window's in one concatenation there)
        return _attend_joint(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling, with_mass, mem_valid, softcap,
                             out_dtype)
    q_local, q_mem = (q_local, q_mem) if out_dtype is None else (q_local.to(out_dtype), _to(q_mem, out_dtype))
    if isinstance(v_mem, (tuple, list)):
        v_mem = torch.cat(v_mem, 1)
    if softcap is not None:  # (capped scores: no kernel caps them)
        memory = lambda q, k, v, scale: _memory_materialised(q, k, v, scale, softcap)  # noqa: E731
        return _attend(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling, memory, with_mass, softcap)
    if cpu and _FLASH_CPU is not None:
        f32 = k_local.dtype == torch.float32
        if c >= FUSED_FROM[f32] or (not with_mass and (c == 1 or not f32)):
            dt = q_local.dtype
            if any(t is not None and t.dtype != dt for t in (k_local, v_local, q_mem, k_mem, v_mem)):
                dt = torch.float32  # (the kernel takes one dtype: mixed inputs meet in float32)
            w = lambda t: None if t is None else t.to(dt)  # noqa: E731 (a tensor of that dtype as it is)
            out, mass = _attend_fused(w(q_local), w(k_local), w(v_local), w(q_mem), w(k_mem), w(v_mem), scaling,
                                      with_mass)
            return out.to(q_local.dtype), mass
        return _attend(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling, _memory_flash, with_mass)
    return _attend(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling, _memory_materialised, with_mass)


def attends_jointly(device: torch.device, mem_valid: Tensor | None) -> bool:
    """Whether `attend` takes `_attend_joint` here: on a device (not the CPU), or for a selection
    padded to its budget. It widens the queries to float32 (a caller may hand them so, with the
    output's dtype)."""
    return mem_valid is not None or device.type != "cpu"


def _to(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.to(dtype)


def _attend_joint(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling, with_mass=True, valid=None, softcap=None,
                  out_dtype=None):
    """`attend` as one softmax over the memory's scores and the window's side by side, written out
    in float32 (queries, keys and values widened first): where a layer's step is paced by the
    kernels it launches (a GPU), about half of `_attend`'s, which merges two softmaxes by their
    log-sum-exps. valid [V <= M] bool: which of the memory's last V rows count (a selection padded
    to its budget). v_mem: a tensor or its parts, concatenated with the window's values at once."""
    h_q, c, d = q_local.shape
    h_kv, length, _ = k_local.shape
    g = h_q // h_kv
    m = 0 if k_mem is None else k_mem.shape[1]
    s = torch.empty(h_kv, g * c, m + length, dtype=torch.float32, device=q_local.device)  # [H_kv, g*c, M + L]
    if m:
        torch.bmm(q_mem.reshape(h_kv, g * c, d).float(), k_mem.float().transpose(1, 2), out=s[..., :m])
    torch.bmm(q_local.reshape(h_kv, g * c, d).float(), k_local.float().transpose(1, 2), out=s[..., m:])
    _capped(s.mul_(scaling), softcap)
    if valid is not None and valid.numel():  # (in place, without a negated mask made first)
        padded = s[..., m - valid.numel() : m]
        torch.where(valid, padded, _minus_inf(s.device), out=padded)
    if c > 1:  # causal: query i sees the chunk's keys 0..i (and every memory key; each query sees itself)
        s.view(h_kv, g, c, m + length)[..., m + length - c :].masked_fill_(_upper(c, s.device), float("-inf"))
    p = torch.softmax(s, -1)
    parts = tuple(v_mem) if isinstance(v_mem, (tuple, list)) else (v_mem,)
    values = torch.cat((*parts, v_local), 1) if m else v_local  # [H_kv, M + L, D]
    out = torch.bmm(p, values.float()).to(out_dtype or q_local.dtype).view(h_q, c, d)
    if not with_mass:
        return out, None
    # attention each window key received, summed over the chunk's queries
    return out, p[..., m:].view(h_kv, g, c, length).sum(2).reshape(h_q, length)


_UPPER: dict[tuple[int, torch.device], Tensor] = {}
_MINUS_INF: dict[torch.device, Tensor] = {}


def _minus_inf(device: torch.device) -> Tensor:
    """A float32 -inf scalar tensor on `device`, made once (`torch.where` with `out` takes no number)."""
    if device not in _MINUS_INF:
        _MINUS_INF[device] = torch.tensor(float("-inf"), device=device)
    return _MINUS_INF[device]


def _upper(c: int, device: torch.device) -> Tensor:
    """[c, c] bool, True above the diagonal (the keys a chunk's query does not see yet), made once
    per size and device (every layer of every step asks)."""
    key = (c, device)
    if key not in _UPPER:
        if len(_UPPER) > 16:
            _UPPER.clear()
        _UPPER[key] = torch.ones(c, c, dtype=torch.bool, device=device).triu_(1)
    return _UPPER[key]


# Steps with the mass take `_attend_fused` from this many queries (fewer: `_attend`), [bf16/f16,
# f32]; steps without it take the kernel at any size in bfloat16 (in float32: one query, or from
# these sizes). The crossovers measured on the project's CPU: docs/benchmark-log.md ("torch's
# kernel gains from bfloat16"). The kernel's bfloat16 accumulates in float32, as the plain
# model's sdpa does; each part's output is rounded to bfloat16 before the parts are merged.
FUSED_FROM = (64, 256)


# torch's CPU flash-attention kernel; unlike the public sdpa it also returns the log-sum-exp,
# which is what lets separately rotated parts share one softmax. Absent: the materialised path.
# With the mass and few queries (`_attend`) only the memory goes through it: the window's
# probabilities are needed for the mass anyway, and exponentiating them once for both beats the
# kernel plus a second pass for the mass (docs/benchmark-log.md, ingest speed).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _memory_flash(q: Tensor, k: Tensor, v: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """The memory's own softmax attention: q [H_kv, g, c, D], k/v [H_kv, M, D] ->
    (output [H_kv, g*c, D] float32, log-sum-exp [H_kv, g*c])."""
    h_kv, g, c, d = q.shape
    o, lse = _FLASH_CPU(q, k[:, None].expand(-1, g, -1, -1), v[:, None].expand(-1, g, -1, -1), is_causal=False, scale=scaling)
    return o.float().reshape(h_kv, g * c, d), lse.reshape(h_kv, g * c)


def _capped(s: Tensor, softcap: float | None) -> Tensor:
    """Scores s (float32, in place) capped as Gemma 2 caps them: softcap * tanh(s / softcap)."""
    return s if softcap is None else s.div_(softcap).tanh_().mul_(softcap)


def _memory_materialised(q: Tensor, k: Tensor, v: Tensor, scaling: float,
                         softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """As `_memory_flash`, with the probabilities written out."""
    h_kv, g, c, d = q.shape
    s = torch.matmul(q.reshape(h_kv, g * c, d), k.transpose(1, 2)).float()  # [H_kv, g*c, M]
    _capped(s.mul_(scaling), softcap)
    lse = torch.logsumexp(s, -1)
    s.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(s.to(v.dtype), v).float(), lse


def _attend(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling, memory, with_mass=True, softcap=None):
    """`attend` with the window's probabilities written out (exponentiated once, they serve the
    output and the mass), the memory's part computed by `memory` (`_memory_flash` or
    `_memory_materialised`) and merged by log-sum-exp.

    The window's scores and probabilities stay in float32 whatever the model's dtype: the mass
    decides which tokens represent an event, and bf16 rounding of it was measured far further
    from the exact value (docs/benchmark-log.md).
    """
    h_q, c, d = q_local.shape
    h_kv, length, _ = k_local.shape
    g = h_q // h_kv
    # GQA without repeating keys: the g query heads of one KV head share its key matrix.
    s = torch.bmm(q_local.reshape(h_kv, g * c, d).float(), k_local.float().transpose(1, 2))  # [H_kv, g*c, L]
    _capped(s.mul_(scaling), softcap)
    if c > 1:
        s.view(h_kv, g, c, length)[..., length - c :].masked_fill_(_upper(c, s.device), float("-inf"))
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
    if not with_mass:
        return out.to(q_local.dtype).view(h_q, c, d), None
    # Attention each window key received, summed over the chunk's queries: [H_kv, g, 1, L].
    mass = torch.matmul(inv_z.view(h_kv, g, 1, c), s.view(h_kv, g, c, length)).reshape(h_q, length)
    return out.to(q_local.dtype).view(h_q, c, d), mass


def _attend_fused(q_local, k_local, v_local, q_mem, k_mem, v_mem, scaling, with_mass=True):
    """`_attend` from torch's fused CPU kernel alone: nothing of size [H_q, c, L] is written out.

    The output: three softmaxes merged by their log-sum-exps (the window's keys before the chunk,
    the chunk's own keys under a causal mask, the memory). The mass each window key k received,
    sum over queries q of exp(s(q, k) - lse(q)), is the same kernel run the other way round:
    keys as queries, the chunk's queries as keys, -lse(q) as an additive mask; its log-sum-exp is
    the log of the mass, summed in float32 inside the kernel (relative error ~1e-5 against float64,
    tests/test_reference.py). For the chunk's own keys the causal mask turns around too (key j
    sees queries i >= j): both orders are flipped so that it is the kernel's causal mask."""
    h_q, c, d = q_local.shape
    h_kv, length, _ = k_local.shape
    g = h_q // h_kv
    # window keys before the chunk: every query of the chunk sees them (one query sees them all)
    old = length if c == 1 else length - c
    q = q_local.view(h_kv, g, c, d)
    kx, vx = k_local[:, None].expand(-1, g, -1, -1), v_local[:, None].expand(-1, g, -1, -1)  # GQA, no copy
    parts = []  # (output [H_kv, g, c, D], log-sum-exp [H_kv, g, c])
    if old:
        parts.append(_FLASH_CPU(q, kx[:, :, :old], vx[:, :, :old], is_causal=False, scale=scaling)[:2])
    if old < length:
        parts.append(_FLASH_CPU(q, kx[:, :, old:], vx[:, :, old:], is_causal=True, scale=scaling)[:2])
    if k_mem is not None and k_mem.shape[1]:
        km, vm = k_mem[:, None].expand(-1, g, -1, -1), v_mem[:, None].expand(-1, g, -1, -1)
        parts.append(_FLASH_CPU(q_mem.view(h_kv, g, c, d), km, vm, is_causal=False, scale=scaling)[:2])
    out, lse = _merge(parts)
    if not with_mass:
        return out.to(k_local.dtype).view(h_q, c, d), None
    neg = (-lse).unsqueeze(2)  # -log-sum-exp [H_kv, g, 1, c]: broadcast over the keys' rows
    mass = []
    if old:
        mass.append(_FLASH_CPU(kx[:, :, :old], q, q, is_causal=False, attn_mask=neg, scale=scaling)[1])
    if old < length:
        flipped = _FLASH_CPU(kx[:, :, old:].flip(2), q.flip(2), q.flip(2), is_causal=True, attn_mask=neg.flip(3), scale=scaling)[1]
        mass.append(flipped.flip(2))
    mass = torch.cat(mass, 2).exp_()  # [H_kv, g, L]
    return out.to(k_local.dtype).view(h_q, c, d), mass.reshape(h_q, length)


def _merge(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Softmaxes over disjoint keys, as (output [..., D], log-sum-exp [...]) each, merged into
    one: (output float32, log-sum-exp). The same operations, bit for bit, as
    `logsumexp(stack(lses))` and a sum of weighted outputs, without the stack and the temporaries
    (for a generated token those small operations were a noticeable share of the attention's time)."""
    m = parts[0][1]
    for _, l in parts[1:]:
        m = torch.maximum(m, l)
    z = None
    for _, l in parts:
        e = (l - m).exp_()
        z = e if z is None else z.add_(e)
    lse = z.log_().add_(m)
    out = None
    for o, l in parts:
        t = o.float()  # (the kernel's own tensor when already float32: free to scale in place)
        t.mul_((l - lse).exp_().unsqueeze(-1))
        out = t if out is None else out.add_(t)
    return out, lse


def attend_band(q: Tensor, k: Tensor, v: Tensor, size: int, scaling: float,
                softcap: float | None = None) -> Tensor:
    """A sliding-window layer's attention, as the plain model's: q [H_q, c, D] the last c rows of
    the window k/v [H_kv, L, D] (all rotated alike), each query seeing itself and the size - 1
    keys before it. Returns [H_q, c, D] in q's dtype."""
    h_q, c, d = q.shape
    h_kv, length, _ = k.shape
    rows = torch.arange(length - c, length, device=q.device)[:, None]
    cols = torch.arange(length, device=q.device)[None]
    seen = (cols <= rows) & (cols > rows - size)  # [c, L]
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=seen, scale=scaling, enable_gqa=h_q != h_kv)[0]
    g = h_q // h_kv
    s = torch.matmul(q.reshape(h_kv, g * c, d).float(), k.float().transpose(1, 2))  # [H_kv, g*c, L]
    s = _capped(s.mul_(scaling), softcap).view(h_kv, g, c, length).masked_fill_(~seen, float("-inf"))
    p = torch.softmax(s, -1).view(h_kv, g * c, length)
    return torch.bmm(p, v.float()).view(h_q, c, d).to(q.dtype)


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
    softcap = kwargs.get("softcap")  # (Gemma 2's attention logit soft-capping)
    out = layer.forward(query[0], key[0], value[0], float(scaling), hooks.step,
                        None if softcap is None else float(softcap))  # [H_q, c, D]
    return out.transpose(0, 1).unsqueeze(0), None  # [1, c, H_q, D], as transformers expects


def register() -> None:
    AttentionInterface.register(NAME, emllm_attention)


__all__ = ["attend", "attends_jointly", "attend_band", "emllm_attention", "register", "NAME", "apply_rotary"]
