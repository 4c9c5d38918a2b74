"""Ingest speed: emllm against a vanilla HF forward over a window of the same size, side by side.

    python benchmarks/ingest_speed.py --tokens 32k

The vanilla run streams the same tokens chunk by chunk (same chunk size) through the unpatched
model (sdpa) with a KV cache cut to the last W = n_init + n_mem + n_local tokens after every
chunk: the cost of attending to a window as large as emllm's, without any memory management.
Both runs use the same model object and thread count, one after the other in one process.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from transformers import DynamicCache

from benchmarks.corpus import tokens as corpus_tokens
from core import models
from core.engine import Engine
from core.passkey import parse_length


@torch.no_grad()
def vanilla_window(model, ids: torch.Tensor, chunk: int, window: int) -> list[float]:
    model.set_attn_implementation("sdpa")
    cache = DynamicCache()
    times = []
    for off in range(0, ids.numel(), chunk):
        x = ids[off : off + chunk][None]
        past = cache.get_seq_length()
        pos = torch.arange(past, past + x.shape[1])[None]
        t = time.perf_counter()
        model(input_ids=x, past_key_values=cache, position_ids=pos, use_cache=True)
        for layer in cache.layers:  # slide: keep the last `window` tokens
            layer.keys, layer.values = layer.keys[:, :, -window:], layer.values[:, :, -window:]
        times.append(time.perf_counter() - t)
    return times


def emllm_run(model, profile, ids: torch.Tensor) -> tuple[list[float], int]:
    eng = Engine(model, profile)
    times = []
    for off in range(0, ids.numel(), profile.chunk_size):
        t = time.perf_counter()
        eng.step(ids[off : off + profile.chunk_size])
        times.append(time.perf_counter() - t)
    return times, eng.n_events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", default="32k")
    ap.add_argument("--text", default="prose", choices=["prose", "code", "haystack"])
    a = ap.parse_args()
    src = models.resolve(a.model)
    model, tok = models.load(src)
    prof = src.profile
    n = parse_length(a.tokens)
    ids = torch.tensor(corpus_tokens(tok, a.text, n))
    w = prof.n_init + prof.n_mem + prof.n_local
    em, events = emllm_run(model, prof, ids)
    va = vanilla_window(model, ids, prof.chunk_size, w)
    # Steady state: once the window is full (both runs attend to about W tokens per chunk).
    skip = -(-w // prof.chunk_size) + 1
    res = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "model": a.model, "tokens": n, "text": a.text, "window": w, "chunk": prof.chunk_size, "events": events,
        "emllm_tok_s": round(n / sum(em), 1), "vanilla_tok_s": round(n / sum(va), 1),
        "ratio_total": round(sum(em) / sum(va), 3),
        "ratio_steady": round(sum(em[skip:]) / sum(va[skip:]), 3),
        "emllm_chunk_s_steady": round(sum(em[skip:]) / len(em[skip:]), 3),
        "vanilla_chunk_s_steady": round(sum(va[skip:]) / len(va[skip:]), 3),
    }
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
