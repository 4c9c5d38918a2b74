"""Passkey grid on the embedded SmolLM2: emllm against the plain model truncated to its context.

    python benchmarks/passkey_grid.py --lengths 16k,32k --trials 2 --out docs/results/passkey.jsonl
    python benchmarks/passkey_grid.py --lengths 128k --trials 1 --no-baseline --memory-dir /var/tmp/pk --out docs/results/passkey-smollm2.jsonl
    python benchmarks/passkey_grid.py --lengths 1m ... --memory-dir /var/tmp/pk --resume   # after a kill: carries on
    python benchmarks/passkey_grid.py --variant contiguity --lengths 32k,64k --depths 0.5 --trials 1 --no-baseline --out docs/results/passkey-variants.jsonl

Writes one JSON line per trial as it finishes (a long run keeps what it measured), then prints
a table of accuracy per (method, length). A grid longer than a session (1M tokens, five depths:
~3.5M tokens read, hours on a CPU) is resumable: with --memory-dir, the stores of the trial under
way and of the shared filler are committed as they go and kept if the process dies, and --resume
skips the cells --out already has (same model, variant, profile and seed) and continues them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, benchmarks/ is not a package on the path
from benchmarks import git_commit  # noqa: E402
from emllm import models
from emllm.evals import results_log
from emllm.engine.stream import Engine
from emllm.evals.passkey import parse_length, run_grid
from emllm.evals.scratch import ScratchStores, TrunkStores


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
    ap.add_argument("--resume", action="store_true",
                    help="skip the cells --out has answered already (same model, variant, profile, seed); with "
                         "--memory-dir, carry on the stores a killed run left there")
    ap.add_argument("--no-share", action="store_true",
                    help="with --memory-dir: every trial reads its whole haystack (the default reads the filler "
                         "before the needles once for the grid, same results; trial times then exclude it)")
    a = ap.parse_args()
    src = models.resolve(a.model)
    model, tok = models.load(src)
    profile = src.profile.replace(**VARIANTS[a.variant])
    lengths = [parse_length(x) for x in a.lengths.split(",")]
    depths = [float(x) for x in a.depths.split(",")]
    grid = {"model": src.name, "variant": a.variant, "profile": json.loads(json.dumps(asdict(profile))), "seed": a.seed}
    trials = range(a.first_trial, a.first_trial + a.trials)
    # only this command's cells: --out may hold other lengths or depths of the same grid
    skip = {(r["length"], r["depth"], r["trial"], r["method"]) for r in results_log.results_of(a.out, grid)
            if r["length"] in lengths and r["depth"] in depths and r["trial"] in trials} if a.resume else set()
    if skip:
        print(f"resuming: {len(skip)} of this command's cells answered already in {a.out}", flush=True)
    results_log.start_run(a.out, grid, machine=platform.processor() or platform.machine(),
                          threads=torch.get_num_threads(), git=git_commit(), argv=sys.argv)

    def keep(r):
        results_log.append(a.out, asdict(r))
        print(f"{a.variant:10} {r.method:8} {r.length:>7} depth {r.depth:.2f} trial {r.trial}: {'OK ' if r.correct else 'BAD'} "
              f"{r.answer!r} (key {r.key}, {r.seconds:.0f} s)", flush=True)

    if a.memory_dir and a.no_share:
        engines = ScratchStores(model, tok, profile, a.memory_dir, src.name)
    elif a.memory_dir:  # the filler before the needles read once for the grid; kept on disk if the run dies
        engines = TrunkStores(model, tok, profile, a.memory_dir, src.name, log=print, keep=True)
    else:
        engines = contextlib.nullcontext(lambda: Engine(model, profile))
    with engines as make:
        res = run_grid(model, tok, make, lengths, depths, a.trials, a.seed, baseline=not a.no_baseline,
                       on_result=keep, first_trial=a.first_trial, skip=skip)
    acc = defaultdict(list)
    for r in res:
        acc[(r.method, r.length)].append(r.correct)
    for (m, n), v in sorted(acc.items()):
        print(f"{m:8} {n:>7}: {sum(v)}/{len(v)} = {100 * sum(v) / len(v):.0f}%")


if __name__ == "__main__":
    main()
