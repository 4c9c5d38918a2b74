"""How much a store format changes what attention sees: the relative error of keys, values and
attention scores after a round trip through each integer format, on the model's own pre-RoPE keys
and values over real prose, beside two ways of quantising keys that the row formats do not use:

- per token (the store's `int8`/`int4` up to version 5, and its values: groups of 32 channels of
  one token, each with its own minimum and step),
- per token after a fixed per-channel centre and scale fitted on the first 512 tokens (the store's
  keys from version 6: `emllm.memory.quant.fit_equaliser`),
- per token after a Hadamard rotation of each head (QuaRot's way of spreading outlier channels
  over all channels; stateless, so it would fit the row formats),
- per channel over blocks of 32 tokens (KIVI/KVQuant's way for keys: a channel's scale is shared
  by 32 consecutive tokens, which a store appending one token at a time must hold back until the
  block fills).

    python -m benchmarks.quant_error [--tokens 1024] [--out docs/results/quant-error.json]

Scores: the last 64 queries against every key (all heads), ||s' - s|| / ||s||, averaged over layers.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch import Tensor

from emllm import models
from emllm.evals.corpus import tokens as corpus_tokens
from emllm.memory.quant import decode_keys, encode_keys, fit_equaliser, kv_format


def hadamard(n: int) -> Tensor:
    """The orthonormal Hadamard matrix of size n (a power of two) [n, n]."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


def per_token(x: Tensor, name: str) -> Tensor:
    """x [n, H, D] through the store's row format `name` and back."""
    fmt = kv_format(name, x.shape[-1])
    return fmt.decode(fmt.encode(x), torch.float32)


def rotated(x: Tensor, name: str) -> Tensor:
    h = hadamard(x.shape[-1])
    return per_token(x @ h, name) @ h.T


def equalised(x: Tensor, name: str, first: int = 512) -> Tensor:
    """Per token after the store's key equaliser (version 6): each channel's centre and scale fitted
    on the first `first` tokens (a store fits them on its first chunk), then fixed."""
    fmt = kv_format(name, x.shape[-1])
    eq = fit_equaliser(x[:first])
    return decode_keys(fmt, encode_keys(fmt, x, eq), eq, torch.float32)


def per_channel(x: Tensor, name: str, block: int = 32) -> Tensor:
    """x [n, H, D] quantised per channel over blocks of `block` tokens (min and step in float16,
    as the row formats keep theirs); a last partial block is left out of x and of the result."""
    bits = {"int8": 8, "int4": 4}[name]
    n = x.shape[0] // block * block
    y = x[:n].reshape(n // block, block, *x.shape[1:])
    lo = y.amin(1, keepdim=True).half().float()
    step = ((y.amax(1, keepdim=True) - lo) / (2**bits - 1)).half().float()
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    q = ((y - lo) * inv).round_().clamp_(0, 2**bits - 1)
    return (q * step + lo).reshape(n, *x.shape[1:])


def rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", default=None, help="JSON file to write the table to")
    a = ap.parse_args()
    src = models.resolve(a.model)
    model, tok = models.load(src)
    cfg = model.config
    h_q, h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h_q
    ids = torch.tensor([corpus_tokens(tok, "prose", a.tokens)])
    seen: dict[tuple[int, str], Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for part in ("q", "k", "v"):
            proj = getattr(layer.self_attn, f"{part}_proj", None)
            if proj is None:
                raise SystemExit(f"{a.model}: no {part}_proj in its attention (fused projections are not read here)")
            hooks.append(proj.register_forward_hook(lambda m, args, out, key=(i, part): seen.__setitem__(key, out.detach())))
    with torch.no_grad():
        model(ids)
    for hk in hooks:
        hk.remove()
    ways = {"per token (the store's up to version 5)": per_token, "per token, Hadamard-rotated": rotated,
            "per token, equalised per channel (the store's keys from version 6)": equalised,
            "per channel over 32 tokens": per_channel}
    rows = []
    for name in ("int8", "int4"):
        for way, f in ways.items():
            ek, ev, es = [], [], []
            for i in range(cfg.num_hidden_layers):
                q = seen[(i, "q")][0].float().reshape(-1, h_q, d)
                k = seen[(i, "k")][0].float().reshape(-1, h_kv, d)
                v = seen[(i, "v")][0].float().reshape(-1, h_kv, d)
                kq, vq = f(k, name), (per_token if f is equalised else f)(v, name)  # the store equalises keys only
                k, v = k[: kq.shape[0]], v[: vq.shape[0]]
                g = h_q // h_kv
                s = torch.einsum("nhd,mhd->hnm", q[-64:], k.repeat_interleave(g, 1))
                sq = torch.einsum("nhd,mhd->hnm", q[-64:], kq.repeat_interleave(g, 1))
                ek.append(rel(kq, k)), ev.append(rel(vq, v)), es.append(rel(sq, s))
            n = len(ek)
            rows.append({"format": name, "keys": way, "key_error": round(sum(ek) / n, 4),
                         "score_error": round(sum(es) / n, 4), "value_error": round(sum(ev) / n, 4)})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| format | quantised | key error | score error | value error |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['keys']} | {r['key_error']:.4f} | {r['score_error']:.4f} | {r['value_error']:.4f} |")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d"), "model": a.model, "tokens": a.tokens, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
