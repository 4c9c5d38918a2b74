"""Ingest speed: emllm (in RAM, and writing a store) against a vanilla HF forward over a window of
the same size, measured side by side: the runs advance in lockstep, one chunk each in turn, so
load on the machine hits all of them alike.

    python -m benchmarks.ingest_speed --tokens 32k [--store] [--dtypes float32,bfloat16] [--variant m=representative:mean]

The vanilla run streams the same tokens chunk by chunk (same chunk size) through the unpatched
model (sdpa) with a KV cache cut to the last W = n_init + n_mem + n_local tokens after every
chunk: the cost of attending to a window as large as emllm's, without any memory management.
The store run is `emllm ingest`'s loop (commits every 4 chunks, fsync included) into a
temporary folder. All runs of one dtype share one model object; every run shares the thread
count. With several --dtypes, the model is loaded once per dtype and all runs of all dtypes
advance in lockstep (each run's name gets its dtype: emllm-bfloat16, vanilla-float32, ...).
--variant adds, per dtype, emllm in RAM with those profile keys changed (run emllm-NAME), in the
same lockstep.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from emllm.evals.corpus import tokens as corpus_tokens
from emllm.app import ingest as ing
from emllm.app import stream
from emllm import models
from emllm.engine.stream import Engine
from emllm.evals.passkey import parse_length

from benchmarks import cache_kwargs, machine
from benchmarks.quality import parse_variant


def plain_cache(model) -> DynamicCache:
    """The plain model's KV cache: of a model that mixes sliding-window and global layers, its
    sliding layers keep their window only (as transformers' generate does)."""
    from emllm.engine.stream import sliding_layers

    return DynamicCache(config=model.config) if any(sliding_layers(model.config)) else DynamicCache()


class Vanilla:
    """The plain model over a sliding window of `window` tokens (a KV cache cut after each step),
    attention by transformers' sdpa."""

    def __init__(self, model, window: int) -> None:
        self.model, self.window, self.cache = model, window, plain_cache(model)

    @torch.no_grad()
    def step(self, x: torch.Tensor) -> None:
        self.model.set_attn_implementation("sdpa")
        past = self.cache.get_seq_length()
        dev = models.input_device(self.model)
        pos = torch.arange(past, past + x.numel(), device=dev)[None]
        # the last token's logits, as a plain prefill (generate) computes
        self.model(input_ids=x.to(dev)[None], **cache_kwargs(self.model, self.cache), position_ids=pos, use_cache=True,
                   logits_to_keep=1)
        for layer in self.cache.layers:  # slide: keep the last `window` tokens
            layer.keys, layer.values = layer.keys[:, :, -self.window :], layer.values[:, :, -self.window :]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="smollm2")
    ap.add_argument("--tokens", default="32k")
    ap.add_argument("--text", default="prose", choices=["prose", "code", "haystack"])
    ap.add_argument("--store", action="store_true", help="also time the store-backed ingest")
    ap.add_argument("--dtypes", default="float32", help="compute dtypes, comma-separated (float32, bfloat16)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY:VALUE[,KEY:VALUE]",
                    help="also emllm in RAM with these profile keys changed (repeatable)")
    a = ap.parse_args()
    src = models.resolve(a.model)
    dtypes = a.dtypes.split(",")
    loaded = {dt: models.load(src, dtype=dt) for dt in dtypes}
    tok = loaded[dtypes[0]][1]
    prof = src.profile
    n = parse_length(a.tokens)
    ids = torch.tensor(corpus_tokens(tok, a.text, n))
    w = prof.n_init + prof.n_mem + prof.n_local
    cs = prof.chunk_size
    n = ids.numel() - ids.numel() % cs  # whole chunks only, as a store processes them
    ids = ids[:n]
    skip = -(-w // cs) + 1  # steady state: the window is full, all runs attend to about W tokens
    if n // cs <= skip:
        ap.error(f"--tokens {a.tokens}: the steady state begins after {skip * cs:,} tokens (the window, "
                 f"{w:,}, and a chunk); ask for more")

    runs: dict = {}
    engines: dict = {}
    stores: dict = {}
    tmp = tempfile.TemporaryDirectory(dir=Path.cwd()) if a.store else None
    for dt in dtypes:
        model = loaded[dt][0]
        sfx = "" if len(dtypes) == 1 else f"-{dt}"
        ram = engines[dt] = Engine(model, prof)
        runs[f"emllm{sfx}"] = ram.step
        runs[f"vanilla{sfx}"] = Vanilla(model, w).step
        for v in a.variant:
            name, vprof = parse_variant(v, prof)
            runs[f"emllm-{name}{sfx}"] = Engine(model, vprof).step
        if a.store:
            st = stores[dt] = stream.create_store(Path(tmp.name) / f"s-{dt}", a.model, model, tok, prof)
            store_eng = stream.open_engine(st, model)
            st.set_job(ids.to(torch.int32), [{"name": "bench", "start": 0, "tokens": n}])

            def store_step(x, st=st, eng=store_eng, k={"chunks": 0}):
                eng.step(x)
                k["chunks"] += 1
                if k["chunks"] % 4 == 0:
                    ing._commit(st, eng, k["chunks"] * cs, complete=False)

            runs[f"store{sfx}"] = store_step
    times: dict[str, list[float]] = {m: [] for m in runs}
    for off in range(0, n, cs):
        x = ids[off : off + cs]
        for m, f in runs.items():
            t = time.perf_counter()
            f(x)
            times[m].append(time.perf_counter() - t)
    res = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine(torch.get_num_threads()),
        "model": a.model, "tokens": n, "text": a.text, "window": w, "chunk": cs,
        "events": engines[dtypes[0]].n_events,
    }
    for m, t in times.items():
        res[f"{m}_tok_s"] = round(n / sum(t), 1)
        res[f"{m}_chunk_s_steady"] = round(sum(t[skip:]) / len(t[skip:]), 3)
    steady = lambda m: sum(times[m][skip:])  # noqa: E731
    for dt in dtypes:
        sfx = "" if len(dtypes) == 1 else f"-{dt}"
        res[f"ratio_emllm_vs_vanilla_total{sfx}"] = round(sum(times[f"emllm{sfx}"]) / sum(times[f"vanilla{sfx}"]), 3)
        res[f"ratio_emllm_vs_vanilla_steady{sfx}"] = round(steady(f"emllm{sfx}") / steady(f"vanilla{sfx}"), 3)
        for v in a.variant:
            name = v.partition("=")[0]
            res[f"ratio_emllm-{name}_vs_vanilla_total{sfx}"] = round(sum(times[f"emllm-{name}{sfx}"]) / sum(times[f"vanilla{sfx}"]), 3)
            res[f"ratio_emllm-{name}_vs_vanilla_steady{sfx}"] = round(steady(f"emllm-{name}{sfx}") / steady(f"vanilla{sfx}"), 3)
        if a.store:
            res[f"ratio_store_vs_ram_total{sfx}"] = round(sum(times[f"store{sfx}"]) / sum(times[f"emllm{sfx}"]), 3)
            res[f"store_bytes_per_token{sfx}"] = round(sum(stores[dt].bytes_on_disk().values()) / n, 1)
            stores[dt].close()
    if len(dtypes) == 2:  # the gain of the second dtype over the first, for emllm and for the window
        for m in ("emllm", "vanilla", *(f"emllm-{v.partition('=')[0]}" for v in a.variant)):
            res[f"gain_{m}_{dtypes[1]}_vs_{dtypes[0]}_steady"] = round(steady(f"{m}-{dtypes[0]}") / steady(f"{m}-{dtypes[1]}"), 3)
    if tmp is not None:
        tmp.cleanup()
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
