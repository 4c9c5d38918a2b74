"""What question_scoring "max" and "lse" cost a question, per layer, side by side with "mean".

    python -m benchmarks.question_scoring_cost [--tokens 40] [--events 1000,9000,35000] [--runs 5]

One layer's retrieval for a question chunk of --tokens tokens, over random representative keys
of SmolLM2's shape with mean keys per KV head (3 x 64 floats, bfloat16 as a bfloat16 store keeps
them) and events of 28 tokens (prose's mean): "mean" scores every event once with the chunk's
mean query (`event_scores`, the exact scan) and selects; "max" scores every event for every
token (`token_scores`), z-scores and takes the best (`token_max`), and selects; "lse" the same
with a soft maximum of the z-scores (`token_lse`). Multiply by the
layers (30) for a question. Alternated, medians of --runs, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from emllm.memory.selection import event_scores, select_events, token_lse, token_max, token_scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--events", default="1000,9000,35000")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print("| events (~tokens) | mean, ms a layer | max, ms a layer | lse, ms a layer | max / mean | lse / max | lse, s a question (30 layers) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in a.events.split(",")):
        reprs = torch.randn(n, 3, 64, generator=g).to(torch.bfloat16)
        flat = reprs.reshape(n, -1)
        lengths = torch.full((n,), 28, dtype=torch.long)
        q = torch.randn(a.tokens, 3, 64, generator=g)
        times: dict[str, list[float]] = {"mean": [], "max": [], "lse": []}
        for _ in range(a.runs):
            t0 = time.perf_counter()
            select_events(event_scores(reprs, q.mean(0)), lengths, 1024)
            t1 = time.perf_counter()
            select_events(token_max(token_scores(n, flat.shape[1], lambda s, e: flat[s:e], q)), lengths, 1024)
            t2 = time.perf_counter()
            select_events(token_lse(token_scores(n, flat.shape[1], lambda s, e: flat[s:e], q)), lengths, 1024)
            t3 = time.perf_counter()
            times["mean"].append(t1 - t0)
            times["max"].append(t2 - t1)
            times["lse"].append(t3 - t2)
        m, x, e = (statistics.median(times[k]) for k in ("mean", "max", "lse"))
        print(f"| {n:,} (~{28 * n / 1000:,.0f}k) | {1e3 * m:.2f} | {1e3 * x:.1f} | {1e3 * e:.1f} | {x / m:.0f}x | {e / x:.2f}x | {30 * e:.2f} |")


if __name__ == "__main__":
    main()
