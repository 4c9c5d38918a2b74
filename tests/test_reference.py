"""Past the local window, the fast path equals a naive attention that builds the context of
spec §1 explicitly, one query and one head at a time, with brute-force retrieval."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from emllm.engine.stream import Engine
from emllm.engine.window import LayerWindow
from tests.conftest import tiny_model, tiny_profile
from .helpers import brute_contiguity, brute_select


def rotate(x: torch.Tensor, pos: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE of one vector x [D] at position pos, written out from the inverse frequencies."""
    ang = pos * inv_freq.double()  # [D/2]
    c, s = torch.cos(ang), torch.sin(ang)
    x1, x2 = x[: x.numel() // 2].double(), x[x.numel() // 2 :].double()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s))


def naive_layer(snap: LayerWindow, q, k, v, scaling, n_local, budget, inv_freq, cont_budget=0):
    h_q, c, d = q.shape
    h_kv = k.shape[0]
    g = h_q // h_kv
    # Brute-force retrieval: score every event, sort (ties: lower id first), fill by tokens.
    qm = torch.stack([torch.stack([rotate(q[h, i], n_local - 1, inv_freq) for i in range(c)]).mean(0) for h in range(h_q)])
    reprs, lens = snap.events.repr_keys().double(), snap.events.event_lengths().tolist()
    per = h_q // reprs.shape[1]  # query heads per representative key (a group's share one: mean keys)
    scores = [sum(float(qm[h] @ reprs[e, h // per]) for h in range(h_q)) for e in range(len(lens))]
    chosen = brute_select(scores, lens, budget)
    if cont_budget:  # contiguity queue: neighbours join at the back, oldest leave first
        queue = brute_contiguity(snap.contiguity.tolist(), chosen, lens, 1, cont_budget)
        chosen = sorted(set(chosen) | set(queue))
    starts = [sum(lens[:e]) for e in range(len(lens))]
    ev_k = snap.events.keys.view()
    ev_v = snap.events.values.view()
    mem_idx = [t for e in chosen for t in range(starts[e], starts[e] + lens[e])]
    out = torch.zeros(h_q, c, d, dtype=torch.float64)
    lw = snap.local_k.shape[1]
    for h in range(h_q):
        kvh = h // g
        mem_k = torch.cat((snap.init_k[kvh], ev_k[kvh, mem_idx], snap.rem_k[kvh])).double()
        mem_v = torch.cat((snap.init_v[kvh], ev_v[kvh, mem_idx], snap.rem_v[kvh])).double()
        for i in range(c):
            loc_k = torch.cat((snap.local_k[kvh], k[kvh, : i + 1])).double()
            loc_v = torch.cat((snap.local_v[kvh], v[kvh, : i + 1])).double()
            loc_k = torch.stack([rotate(loc_k[j], j, inv_freq) for j in range(loc_k.shape[0])])
            ql = rotate(q[h, i], lw + i, inv_freq)
            qg = rotate(q[h, i], n_local - 1, inv_freq)
            logits = torch.cat((mem_k @ qg, loc_k @ ql)) * scaling
            p = torch.softmax(logits, 0)
            out[h, i] = p @ torch.cat((mem_v, loc_v))
    return out, chosen


@pytest.mark.parametrize("contiguity", [False, True])
@pytest.mark.parametrize("step", ["chunk", "decode", "decode-late"])
def test_fast_path_equals_naive_reference(step, contiguity, monkeypatch):
    model = tiny_model("llama3.1")
    prof = tiny_profile(contiguity=contiguity, n_mem=30)
    eng = Engine(model, prof)
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(11))
    if step == "decode-late":  # tokens one at a time before: the window kept rotated, rebuilt every 3
        monkeypatch.setattr("emllm.engine.stream.TOKEN_SLACK", 3)
        eng.feed(ids[:150])
        for t in range(150, 160):
            eng.step(ids[t : t + 1])
        rw = eng.windows[1]._rw
        assert rw is not None and rw.a > 0  # the last token's query is rotated past the window's length
    else:
        eng.feed(ids[:160])
    assert eng.n_events >= 5 and eng.windows[1].rem_k.shape[1] > 0  # memory is really in play

    seen = {}
    real_forward = LayerWindow.forward

    def spy(self, q, k, v, scaling, st, softcap=None):
        snap = copy.deepcopy(self)
        picked = {}
        st = dataclasses.replace(st, on_retrieval=lambda layer, sel, query: picked.setdefault("ids", sel.ids.tolist()))
        out = real_forward(self, q, k, v, scaling, st, softcap)
        seen[self.layer_idx] = (snap, q.clone(), k.clone(), v.clone(), scaling, out.clone(), picked["ids"])
        assert not contiguity or self.contiguity.numel() > 0  # the queue is really in play
        return out

    monkeypatch.setattr(LayerWindow, "forward", spy)
    eng.step(ids[160:168] if step == "chunk" else ids[160:161])
    inv_freq = model.model.rotary_emb.inv_freq
    for layer, (snap, q, k, v, scaling, out, ids_fast) in seen.items():
        cont = int(prof.n_mem * prof.contiguity_ratio) if contiguity else 0
        want, chosen = naive_layer(snap, q, k, v, scaling, prof.n_local, prof.n_mem - cont, inv_freq, cont)
        assert not contiguity or len(chosen) > len(ids_fast)
        if not contiguity:
            assert ids_fast == chosen
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "h_q,h_kv,c,length,m,mem_scale",
    [(4, 2, 8, 20, 13, 1), (3, 3, 1, 9, 5, 1), (6, 2, 5, 5, 0, 1), (4, 1, 1, 1, 0, 1), (9, 3, 16, 40, 1, 1),
     (8, 2, 1, 7, 6, 1), (6, 3, 4, 4, 3, 1), (4, 2, 6, 10, 9, 6)],  # GQA decode with memory, L == c, memory dominant
)
@pytest.mark.parametrize("path", ["flash", "materialised", "fused", "joint"])
def test_attend_paths_equal_one_softmax_written_out(h_q, h_kv, c, length, m, mem_scale, path):
    """Output and per-key attention mass on every path (the memory from the flash kernel or
    written out; everything from the fused kernel, the mass too; one softmax over both, a GPU's)
    against the softmax over the concatenated logits in float64 (chunk, decoding, no memory, no
    older window, MHA and GQA)."""
    from emllm.math import attention
    gen = torch.Generator().manual_seed(h_q * 100 + c * 10 + length + m)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    d, scaling = 8, 8**-0.5
    q, qm = r(h_q, c, d), r(h_q, c, d) * mem_scale
    k, v, km, vm = r(h_kv, length, d), r(h_kv, length, d), r(h_kv, m, d) * mem_scale, r(h_kv, m, d)
    memory = attention._memory_flash if path == "flash" else attention._memory_materialised
    if path != "materialised" and attention._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash kernel")
    args = (q, k, v, qm if m else None, km if m else None, vm if m else None, scaling)
    if path == "fused":
        out, mass = attention._attend_fused(*args)
    elif path == "joint":
        out, mass = attention._attend_joint(*args)
    else:
        out, mass = attention._attend(*args, memory)
    g = h_q // h_kv
    want_out = torch.zeros(h_q, c, d, dtype=torch.float64)
    want_mass = torch.zeros(h_q, length, dtype=torch.float64)
    for h in range(h_q):
        for i in range(c):
            seen = length - c + i + 1  # causal: window keys 0..L-c+i
            logits = torch.cat((km[h // g] @ qm[h, i], k[h // g, :seen] @ q[h, i])).double() * scaling
            p = torch.softmax(logits, 0)
            want_out[h, i] = p @ torch.cat((vm[h // g], v[h // g, :seen])).double()
            want_mass[h, :seen] += p[m:]
    torch.testing.assert_close(out.double(), want_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mass.double(), want_mass, atol=1e-6, rtol=1e-5)
    # without the mass (representative: mean): the same output, bit for bit, and no mass
    bare = {"fused": lambda: attention._attend_fused(*args, False),
            "joint": lambda: attention._attend_joint(*args, False)}.get(path, lambda: attention._attend(*args, memory, False))()
    assert bare[1] is None and torch.equal(bare[0], out)


@pytest.mark.parametrize("path", ["written-out", "fused"])
def test_attention_keeps_the_mass_in_float32_for_bf16_inputs(path):
    """bf16 queries/keys/values: the mass (which picks an event's representative tokens) is summed
    in float32 from float32 probabilities, so it is as exact as the bf16 inputs allow, on both
    paths: the window's probabilities written out in float32, and the fused kernel run both ways."""
    from emllm.math import attention
    if attention._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash kernel")
    gen = torch.Generator().manual_seed(3)
    h_q, h_kv, c, length, m, d = 8, 2, 16, 48, 20, 16
    r = lambda *s: (torch.randn(*s, generator=gen) * 2).to(torch.bfloat16)  # noqa: E731
    q, qm, k, v, km, vm = r(h_q, c, d), r(h_q, c, d), r(h_kv, length, d), r(h_kv, length, d), r(h_kv, m, d), r(h_kv, m, d)
    scaling = d**-0.5
    if path == "fused":
        out, mass = attention._attend_fused(q, k, v, qm, km, vm, scaling)
    else:
        out, mass = attention._attend(q, k, v, qm, km, vm, scaling, attention._memory_flash)
    g = h_q // h_kv
    want_mass = torch.zeros(h_q, length, dtype=torch.float64)
    want_out = torch.zeros(h_q, c, d, dtype=torch.float64)
    for h in range(h_q):
        for i in range(c):
            seen = length - c + i + 1
            logits = torch.cat((km[h // g].double() @ qm[h, i].double(), k[h // g, :seen].double() @ q[h, i].double())) * scaling
            p = torch.softmax(logits, 0)
            want_out[h, i] = p @ torch.cat((vm[h // g], v[h // g, :seen])).double()
            want_mass[h, :seen] += p[m:]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(mass.double(), want_mass, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n_parts", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merging_softmaxes_computes_the_log_sum_exp_formula_bit_for_bit(n_parts, dtype):
    """`_merge` (in place, no stack) gives the bits of the formula it replaced, so a chunk's output
    is what it was: logsumexp over the stacked parts, then each output weighted by exp(lse_i - lse)."""
    from emllm.math import attention
    gen = torch.Generator().manual_seed(n_parts)
    parts = [((torch.randn(3, 2, 5, 8, generator=gen) * 3).to(dtype), torch.randn(3, 2, 5, generator=gen) * 4)
             for _ in range(n_parts)]
    lse_want = torch.logsumexp(torch.stack([l for _, l in parts]), 0)
    out_want = sum(o.float() * (l - lse_want).exp().unsqueeze(-1) for o, l in parts)
    out, lse = attention._merge([(o.clone(), l.clone()) for o, l in parts])
    assert torch.equal(lse, lse_want) and torch.equal(out, out_want)


def test_a_generated_token_without_mass_runs_the_kernel_in_bf16():
    """One bf16 query, no mass: `attend` takes the fused kernel in bf16 for window and memory
    (float32 inside, as the plain model's sdpa), within bf16's rounding of the float64 softmax
    over memory and window together; a window kept in float32 meets the bf16 query in float32;
    with the mass it keeps the written-out path."""
    from emllm.math import attention
    if attention._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash kernel")
    gen = torch.Generator().manual_seed(5)
    h_q, h_kv, length, m, d = 6, 2, 40, 24, 16
    r = lambda *s: (torch.randn(*s, generator=gen) * 2).to(torch.bfloat16)  # noqa: E731
    q, qm, k, v, km, vm = r(h_q, 1, d), r(h_q, 1, d), r(h_kv, length, d), r(h_kv, length, d), r(h_kv, m, d), r(h_kv, m, d)
    scaling = d**-0.5
    out, mass = attention.attend(q, k, v, qm, km, vm, scaling, with_mass=False)
    assert mass is None and out.dtype == torch.bfloat16
    assert torch.equal(out, attention._attend_fused(q, k, v, qm, km, vm, scaling, False)[0])
    g = h_q // h_kv
    want = torch.zeros(h_q, 1, d, dtype=torch.float64)
    for h in range(h_q):
        logits = torch.cat((km[h // g].double() @ qm[h, 0].double(), k[h // g].double() @ q[h, 0].double())) * scaling
        want[h, 0] = torch.softmax(logits, 0) @ torch.cat((vm[h // g], v[h // g])).double()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=1e-2)
    wide = [t.float() for t in (q, k, v, qm, km, vm)]
    f32 = attention._attend_fused(*wide, scaling, False)[0]
    # bf16's rounding of the parts' outputs and of the sum: at most twice the float32 kernel's rounded once
    assert (out.double() - want).abs().mean() <= 2 * (f32.to(torch.bfloat16).double() - want).abs().mean()
    # a window kept in float32 (a device's rotated window): the kernel in float32, rounded once
    assert torch.equal(attention.attend(q, k.float(), v.float(), qm, km, vm, scaling, with_mass=False)[0],
                       f32.to(torch.bfloat16))
    with_mass = attention.attend(q, k, v, qm, km, vm, scaling, with_mass=True)
    assert torch.equal(with_mass[0], attention._attend(q, k, v, qm, km, vm, scaling, attention._memory_flash)[0])


@pytest.mark.parametrize(
    "h_q,h_kv,c,length,m",
    [(9, 3, 40, 100, 70), (4, 2, 16, 16, 0), (6, 2, 33, 60, 1), (8, 8, 17, 50, 30), (6, 3, 2, 9, 5)],  # GQA, no memory, L == c, MHA, 2 queries
)
@pytest.mark.parametrize("scaling", [0.25, 0.3])  # 1/sqrt(16), and one the queries' rounding must absorb
def test_bf16_chunk_without_mass_is_one_softmax_from_the_kernel_in_bf16(h_q, h_kv, c, length, m, scaling):
    """A bf16 chunk without the mass takes `_attend_fused` in bf16: within bf16's rounding of the
    float64 softmax over memory and causal window together, and closer than transformers' eager
    attention in bf16 (scores rounded as they are): the kernel's scores are float32."""
    from emllm.math import attention
    if attention._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash kernel")
    gen = torch.Generator().manual_seed(h_q + c + length + m)
    r = lambda *s: (torch.randn(*s, generator=gen) * 2).to(torch.bfloat16)  # noqa: E731
    d = 16
    # large scores (queries x3), where bfloat16 rounds them coarsely
    q, qm = r(h_q, c, d) * 3, r(h_q, c, d) * 3
    k, v, km, vm = r(h_kv, length, d), r(h_kv, length, d), r(h_kv, m, d), r(h_kv, m, d)
    mem = (qm, km, vm) if m else (None, None, None)
    out, mass = attention.attend(q, k, v, *mem, scaling, with_mass=False)
    assert mass is None and out.dtype == torch.bfloat16
    assert torch.equal(out, attention._attend_fused(q, k, v, *mem, scaling, False)[0])
    g = h_q // h_kv
    want = torch.zeros(h_q, c, d, dtype=torch.float64)
    eager = torch.zeros(h_q, c, d, dtype=torch.float64)  # transformers' eager attention in bf16
    for h in range(h_q):
        for i in range(c):
            seen = length - c + i + 1
            values = torch.cat((vm[h // g], v[h // g, :seen]))
            logits = torch.cat((km[h // g].double() @ qm[h, i].double(), k[h // g, :seen].double() @ q[h, i].double())) * scaling
            want[h, i] = torch.softmax(logits, 0) @ values.double()
            rounded = torch.cat((km[h // g] @ qm[h, i], k[h // g, :seen] @ q[h, i])) * scaling  # bf16 scores
            eager[h, i] = (torch.softmax(rounded, 0, dtype=torch.float32).to(torch.bfloat16) @ values).double()
    err, err_eager = (out.double() - want).abs(), (eager - want).abs()
    assert err.mean() <= 0.75 * err_eager.mean() and err.max() <= err_eager.max()
    torch.testing.assert_close(out.double(), want, atol=4e-2, rtol=2e-2)


def test_which_cpu_path_a_step_takes(monkeypatch):
    """Without the mass the kernel at any size in bf16 (in float32: one query, or a long chunk);
    with it, the kernel only for long chunks; `_attend` for the rest."""
    from emllm.math import attention
    if attention._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash kernel")
    calls = []
    real = attention._attend_fused
    monkeypatch.setattr(attention, "_attend_fused", lambda *a: calls.append(a[0].dtype) or real(*a))
    gen = torch.Generator().manual_seed(1)
    r = lambda dt, *s: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    bf, f32 = torch.bfloat16, torch.float32
    for dt, c, with_mass, taken in [(bf, 32, False, bf), (bf, 2, False, bf), (bf, 1, False, bf), (bf, 32, True, None),
                                    (bf, 64, True, bf), (f32, 32, False, None), (f32, 1, False, f32),
                                    (f32, 256, True, f32), (f32, 255, True, None)]:
        calls.clear()
        q, k, v = r(dt, 4, c, 8), r(dt, 2, c + 8, 8), r(dt, 2, c + 8, 8)
        out, mass = attention.attend(q, k, v, r(dt, 4, c, 8), r(dt, 2, 5, 8), r(dt, 2, 5, 8), 8**-0.5, with_mass)
        assert calls == ([] if taken is None else [taken]), (dt, c, with_mass)
        assert out.dtype == dt and (mass is not None) == with_mass
