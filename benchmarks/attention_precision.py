"""What a chunk's attention path costs in precision, end to end on the real model.

    python -m benchmarks.attention_precision [--tokens 1536] [--long 6144]

1. Exact mode (the whole text fits the local window, so emllm is the plain model): logits of the
   plain model in float32 are the truth; against them, the plain model in bfloat16 (eager and
   sdpa attention) and emllm in bfloat16 on each CPU path for a chunk (bfloat16 products, torch's
   flash kernel).
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


class Errors:
    """Running comparison of logits against the truth's, chunk by chunk (a 16k-token run's
    logits are 3 GB a copy: none is kept)."""

    def __init__(self) -> None:
        self.n, self.abs_sum, self.abs_max, self.kl_sum, self.flips = 0, 0.0, 0.0, 0.0, 0

    def add(self, got: torch.Tensor, truth: torch.Tensor) -> None:  # [n, V] float32 each
        for i in range(0, got.shape[0], 256):
            g, t = got[i : i + 256], truth[i : i + 256]
            err = (g - t).abs()
            kl = torch.nn.functional.kl_div(g.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none").sum(-1)
            self.n += g.shape[0]
            self.abs_sum += err.sum().item() / g.shape[1]
            self.abs_max = max(self.abs_max, err.max().item())
            self.kl_sum += kl.sum().item()
            self.flips += int((g.argmax(-1) != t.argmax(-1)).sum())

    def row(self) -> dict:
        return {"mean_abs": round(self.abs_sum / self.n, 4), "max_abs": round(self.abs_max, 3),
                "mean_kl": round(self.kl_sum / self.n, 5), "top1_differs": round(self.flips / self.n, 4), "tokens": self.n}


def compare(got: torch.Tensor, truth: torch.Tensor) -> dict:
    e = Errors()
    e.add(got, truth)
    return e.row()


PRODUCTS_FROM = attention.PRODUCTS_FROM  # (as imported: the products' own threshold)


def set_path(path: str) -> None:
    """Chunks take `path` from now on: "products" (bfloat16 products) or "flash" (the kernel)."""
    attention.PRODUCTS_FROM = PRODUCTS_FROM if path == "products" else 1 << 30
    attention.PRODUCTS_ON_CPU = True  # measured where asked, whether this CPU computes bfloat16 natively or not


def emllm_logits(model, profile, ids: torch.Tensor, chunk: int, path: str = "products") -> torch.Tensor:
    set_path(path)
    eng = Engine(model, profile)
    with torch.no_grad():
        out = [eng.step(ids[i : i + chunk]) for i in range(0, ids.numel(), chunk)]
    set_path("products")
    return torch.cat(out).float()


def with_memory(m32, m16, prof, ids: torch.Tensor, chunk: int) -> dict[str, Errors]:
    """emllm in float32 (the truth) and in bfloat16 on each path, in lockstep, chunk by chunk."""
    truth = Engine(m32, prof)
    engines = {path: Engine(m16, prof) for path in ("products", "flash")}
    errors = {path: Errors() for path in engines}
    with torch.no_grad():
        for i in range(0, ids.numel(), chunk):
            x = ids[i : i + chunk]
            t = truth.step(x).float()
            for path, eng in engines.items():
                set_path(path)
                errors[path].add(eng.step(x).float(), t)
    set_path("products")
    return errors


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
        rows.append(("exact", f"emllm bf16, {path}", compare(emllm_logits(m16, exact, ids, a.chunk, path), truth)))
    del truth

    prof = src.profile.replace(chunk_size=a.chunk)
    for path, e in with_memory(m32, m16, prof, ids_all[: a.long], a.chunk).items():
        rows.append(("memory", f"emllm bf16, {path}", e.row()))

    print(f"| {a.text} | logits | mean abs error | largest | KL(truth, these), mean | top-1 differs |")
    print("|---|---|---:|---:|---:|---:|")
    for mode, name, r in rows:
        print(f"| {mode} | {name} | {r['mean_abs']} | {r['max_abs']} | {r['mean_kl']} | {r['top1_differs']:.2%} |")
    if a.out:
        a.out.write_text(json.dumps([{"mode": m, "logits": n, **r} for m, n, r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
