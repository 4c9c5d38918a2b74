"""Passkey grid on the embedded SmolLM2: emllm against the plain model truncated to its context.

    python benchmarks/passkey_grid.py --lengths 16k,32k --trials 2 --out docs/results/passkey.jsonl
    python benchmarks/passkey_grid.py --lengths 128k --trials 1 --no-baseline --memory-dir /var/tmp --out docs/results/passkey-smollm2.jsonl
    python benchmarks/passkey_grid.py --variant contiguity --lengths 32k,64k --depths 0.5 --trials 1 --no-baseline --out docs/results/passkey-variants.jsonl

Writes one JSON line per trial as it finishes (a long run keeps what it measured), then prints
a table of accuracy per (method, length).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict
from dataclasses import asdict

import torch

from core import models
from core.engine import Engine
from core.passkey import parse_length, run_grid
from core.scratch import ScratchStores, TrunkStores


VARIANTS = {
    "profile": {},
    "similarity": {"contiguity": False},
    "contiguity": {"contiguity": True},
    "F": {"segmentation": "F", "contiguity": False},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", default="16k,32k")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-trial", type=int, default=0, help="extend an earlier grid with new trials")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="profile",
                    help="retrieval ablation (spec §4): similarity only, with the "
                         "contiguity buffer, or fixed blocks of max_block (InfLLM-like)")
    ap.add_argument("--memory-dir", default=None,
                    help="keep emllm's memory in a temporary store under this folder (bounded RAM; for 1M tokens)")
    ap.add_argument("--no-share", action="store_true",
                    help="with --memory-dir: every trial reads its whole haystack (the default reads the filler "
                         "before the needles once for the grid, same results; trial times then exclude it)")
    a = ap.parse_args()
    src = models.resolve(a.model)
    model, tok = models.load(src)
    profile = src.profile.replace(**VARIANTS[a.variant])
    lengths = [parse_length(x) for x in a.lengths.split(",")]
    depths = [float(x) for x in a.depths.split(",")]
    with open(a.out, "a") as f:
        f.write(json.dumps({"run": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.processor() or platform.machine(),
                            "threads": torch.get_num_threads(), "variant": a.variant, "profile": asdict(profile), "argv": sys.argv}) + "\n")

    def keep(r):
        with open(a.out, "a") as f:
            f.write(json.dumps(asdict(r)) + "\n")
        print(f"{a.variant:10} {r.method:8} {r.length:>7} depth {r.depth:.2f} trial {r.trial}: {'OK ' if r.correct else 'BAD'} "
              f"{r.answer!r} (key {r.key}, {r.seconds:.0f} s)", flush=True)

    if a.memory_dir:  # the filler before the needles read once for the grid, unless --no-share
        engines = (ScratchStores if a.no_share else TrunkStores)(model, tok, profile, a.memory_dir, src.name)
    else:
        engines = lambda: Engine(model, profile)  # noqa: E731
    try:
        res = run_grid(model, tok, engines, lengths, depths, a.trials, a.seed,
                       baseline=not a.no_baseline, on_result=keep, first_trial=a.first_trial)
    finally:
        if a.memory_dir:
            engines.close()
    acc = defaultdict(list)
    for r in res:
        acc[(r.method, r.length)].append(r.correct)
    for (m, n), v in sorted(acc.items()):
        print(f"{m:8} {n:>7}: {sum(v)}/{len(v)} = {100 * sum(v) / len(v):.0f}%")


if __name__ == "__main__":
    main()
