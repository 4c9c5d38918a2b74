"""Perplexity of a long text as emllm reads it, beside the same engine without memory and the plain
model with every past token (where the text fits its context): what the episodic memory adds to
predicting the next token, the long-context measure of InfLLM's and StreamingLLM's papers.

    python -m benchmarks.perplexity -m smollm2 --tokens 8k,32k --texts prose,code --out docs/results/perplexity-smollm2.jsonl

emllm's per-token negative log-likelihoods are its surprise (what `emllm show` reports as a store's
perplexity): each chunk attends to the initial tokens, the events its layers retrieve and the local
window. "No memory" is the same engine with a memory budget of one token (no event fits: the
initial tokens and the window alone), so the two differ only by what is retrieved. "Full" is the
plain model over chunks of the same size with a KV cache of every past token (sdpa), only up to the
model's trained context. Each row gives the perplexity over all tokens and over those past the
first window (n_init + n_local + chunk), where memory can matter; emllm and no memory read the
first window alike. `--variant query_centering=1` adds a column read with the profile so changed.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import yaml

from benchmarks import cache_kwargs, machine
from benchmarks.ingest_speed import plain_cache
from emllm import models
from emllm.engine.stream import Engine
from emllm.evals import corpus
from emllm.evals.passkey import parse_length
from emllm.math.surprise import token_surprise


def perplexity(nll: torch.Tensor) -> float:
    """exp of the mean finite negative log-likelihood of `nll` [n]."""
    x = nll[torch.isfinite(nll)].double()
    return math.exp(float(x.mean()))


def engine_nll(model, profile, ids: torch.Tensor) -> torch.Tensor:
    """Each token's -log p under an engine in RAM reading `ids` [n] in chunks: [n], NaN first."""
    eng = Engine(model, profile)
    eng.feed(ids)
    return eng.surprise.view().clone()


@torch.no_grad()
def full_nll(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """The plain model's -log p of each token with every past token in its cache: [n], NaN first."""
    model.set_attn_implementation("sdpa")
    cache, out, last = plain_cache(model), [], None
    dev = models.input_device(model)
    for off in range(0, ids.numel(), chunk):
        x = ids[off: off + chunk]
        pos = torch.arange(off, off + x.numel(), device=dev)[None]
        logits = model(input_ids=x.to(dev)[None], **cache_kwargs(model, cache), position_ids=pos, use_cache=True).logits[0]
        out.append(token_surprise(logits, x.to(dev), last).cpu())
        last = logits[-1]
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="smollm2")
    ap.add_argument("--tokens", default="8k,32k", help="text lengths, comma-separated")
    ap.add_argument("--texts", default="prose,code", help=f"of {', '.join(corpus.TEXTS)}, comma-separated")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", help="append one JSON line a row to this file")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="also read each text with the profile so changed (a column named after it), e.g. "
                         "query_centering=1; repeatable")
    a = ap.parse_args()
    src = models.resolve(a.model)
    model, tok = models.load(src, dtype=a.dtype)
    prof = src.profile
    variants = {v: prof.replace(**{k: yaml.safe_load(x) for k, x in (kv.split("=", 1) for kv in v.split(","))})
                for v in a.variant}  # (checked before anything is read: a bad key fails here)
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    warm = prof.n_init + prof.n_local + prof.chunk_size  # tokens read alike with and without memory
    print(json.dumps({"meta": machine(), "model": a.model, "profile": prof.name, "dtype": a.dtype, "context": context}))
    for kind in a.texts.split(","):
        for length in [parse_length(x) for x in a.tokens.split(",")]:
            ids = torch.tensor(corpus.tokens(tok, kind, length))
            row = {"text": kind, "tokens": ids.numel(), "warm": warm}
            for name, fn in (("emllm", lambda: engine_nll(model, prof, ids)),
                             ("no_memory", lambda: engine_nll(model, prof.replace(n_mem=1), ids)),
                             ("full", lambda: full_nll(model, ids, prof.chunk_size) if ids.numel() <= context else None),
                             *((f"emllm {v}", lambda p=p: engine_nll(model, p, ids)) for v, p in variants.items())):
                t0 = time.perf_counter()
                nll = fn()
                if nll is None:
                    continue
                row[name] = round(perplexity(nll), 4)
                row[f"{name}_past_warm"] = round(perplexity(nll[warm:]), 4) if ids.numel() > warm else None
                row[f"{name}_s"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(row), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps({"model": a.model, "dtype": a.dtype, **row}) + "\n")


if __name__ == "__main__":
    main()
