"""What a chunk's attention path costs in precision, end to end on the real model.

    python -m benchmarks.attention_precision [--tokens 1536] [--long 6144]

1. Exact mode (the whole text fits the local window, so emllm is the plain model): logits of the
   plain model in float32 are the truth; against them, the plain model in bfloat16 (eager and
   sdpa attention) and emllm in bfloat16 on each CPU path for a chunk (bfloat16 products, torch's
   flash kernel). Mean and largest |logit error|, and the share of tokens whose top-1 differs.
2. With memory (a longer text, the profile's window): emllm in float32 is the truth; emllm in
   bfloat16 on each path against it.

Each row: mean and largest |logit error|, the mean KL divergence from the truth's next-token
distribution, and the share of tokens whose top-1 differs from the truth's.

One process, the same tokens for every row; prints a table and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from emllm import models
from emllm.engine.stream import Engine
from emllm.evals import corpus
from emllm.math import attention


def plain_logits(model, ids: torch.Tensor, impl: str) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def emllm_logits(model, profile, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    eng = Engine(model, profile)
    out = [eng.step(ids[i : i + chunk]) for i in range(0, ids.numel(), chunk)]
    return torch.cat(out).float()


def compare(got: torch.Tensor, truth: torch.Tensor) -> dict:
    err = (got - truth).abs()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), truth.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return {
        "mean_kl": round(kl.mean().item(), 5),
        "mean_abs": round(err.mean().item(), 4),
        "max_abs": round(err.max().item(), 3),
        "top1_differs": round((got.argmax(-1) != truth.argmax(-1)).float().mean().item(), 4),
    }


def on_path(path: str, fn):
    """Run fn with chunks taking `path`: "products" (bfloat16 products) or "flash" (the kernel)."""
    keep = attention.PRODUCTS_FROM
    attention.PRODUCTS_FROM = keep if path == "products" else 1 << 30
    try:
        return fn()
    finally:
        attention.PRODUCTS_FROM = keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1536, help="exact mode: tokens (all in the window)")
    ap.add_argument("--long", type=int, default=6144, help="with memory: tokens")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--text", default="prose", choices=["prose", "code", "chat"])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.manual_seed(0)
    src = models.resolve("smollm2")
    m32, tok = models.load(src, dtype="float32")
    m16, _ = models.load(src, dtype="bfloat16")
    ids_all = torch.tensor(corpus.tokens(tok, a.text, max(a.tokens, a.long)))
    rows = []

    ids = ids_all[: a.tokens]
    exact = src.profile.replace(n_local=a.tokens + a.chunk, chunk_size=a.chunk)
    truth = plain_logits(m32, ids, "sdpa")
    rows.append(("exact", "plain bf16, eager", compare(plain_logits(m16, ids, "eager"), truth)))
    rows.append(("exact", "plain bf16, sdpa", compare(plain_logits(m16, ids, "sdpa"), truth)))
    rows.append(("exact", "emllm float32", compare(emllm_logits(m32, exact, ids, a.chunk), truth)))
    for path in ("products", "flash"):
        got = on_path(path, lambda: emllm_logits(m16, exact, ids, a.chunk))
        rows.append(("exact", f"emllm bf16, {path}", compare(got, truth)))

    ids = ids_all[: a.long]
    prof = src.profile.replace(chunk_size=a.chunk)
    truth = emllm_logits(m32, prof, ids, a.chunk)
    for path in ("products", "flash"):
        got = on_path(path, lambda: emllm_logits(m16, prof, ids, a.chunk))
        rows.append(("memory", f"emllm bf16, {path}", compare(got, truth)))

    print(f"| {a.text} | logits | mean abs error | largest | KL(truth, these), mean | top-1 differs |")
    print("|---|---|---:|---:|---:|---:|")
    for mode, name, r in rows:
        print(f"| {mode} | {name} | {r['mean_abs']} | {r['max_abs']} | {r['mean_kl']} | {r['top1_differs']:.2%} |")
    if a.out:
        a.out.write_text(json.dumps([{"mode": m, "logits": n, **r} for m, n, r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
