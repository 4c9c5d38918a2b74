"""Retrieval cost per chunk: exact scan against the faiss HNSW path of `emllm.memory.index.EventIndex`.

    python benchmarks/retrieval_cost.py [--sizes 1000 10000 100000] [--layers 30] [--big-layers 4]

One engine step retrieves once per layer per chunk: per chunk, for each of the 30 layers, one
`select(query, lengths, budget=1024)` over that layer's events. This times that, for a number of
events per layer, on SmolLM2's shapes (9 query heads x 64 dims per event, events of ~30 tokens
with min 8, budget 1024 tokens), with keys generated like the model's (`model_like` in
tests/test_search.py), each layer its own data and query.

- exact: `select_events(event_scores(reprs, q))` on the float32 copy (EventIndex's exact path)
- faiss: EventIndex's faiss path (HNSW graph from the best anchors, candidates re-scored exactly)
- add: inserting one chunk's events into every layer's graph (512 tokens / ~32 per event = 16
  events per layer); the exact path's add is a copy into a buffer (not shown: microseconds)
- build: inserting all events of one layer at once (what a graph costs if built in one go)

Sizes too big for all 30 layers in memory or time are run on --big-layers layers and the
per-chunk times scaled by 30 / big-layers (the output says so). Threads: 2 (torch and faiss).
Times are medians over the timed chunks (the machine's cores may be shared with other work).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import faiss
import torch

from emllm.memory.selection import event_scores, select_events
from emllm.memory.index import DEFAULT_EF_CONSTRUCTION, DEFAULT_EF_SEARCH, DEFAULT_ENTRIES, DEFAULT_M, EventIndex
from tests.helpers import model_like

H_Q, D = 9, 64
BUDGET = 1024
CHUNK_EVENTS = 16  # 512-token chunk / ~32 tokens per event


def run_size(n: int, layers: int, reps: int, ef_search: int) -> dict:
    indexes, data = [], []
    build = 0.0
    for layer in range(layers):
        reprs, queries, lengths = model_like(n + CHUNK_EVENTS * 3, reps + 1, seed=1000 * layer + n % 997)
        index = EventIndex(H_Q, D, threshold=1, ef_search=ef_search)
        t = time.perf_counter()
        index.add(reprs[:n])
        build += time.perf_counter() - t
        indexes.append(index)
        data.append((reprs, queries, lengths))
    # Per-chunk retrieval: every layer once, exact then faiss, same queries.
    t_exact, t_faiss, same, found, wanted = [], [], 0, 0, 0
    for r in range(reps + 1):  # the first round warms up
        t = time.perf_counter()
        for index, (_, queries, lengths) in zip(indexes, data):
            select_events(event_scores(index.vectors(), queries[r]), lengths[:n], BUDGET)
        t_exact.append(time.perf_counter() - t)
        t = time.perf_counter()
        for index, (_, queries, lengths) in zip(indexes, data):
            index.select(queries[r], lengths[:n], BUDGET)
        t_faiss.append(time.perf_counter() - t)
        if r > 0:
            for index, (_, queries, lengths) in zip(indexes, data):
                a = index.select(queries[r], lengths[:n], BUDGET)
                b = select_events(event_scores(index.vectors(), queries[r]), lengths[:n], BUDGET)
                same += torch.equal(a.ids, b.ids)
                found += int(torch.isin(b.ids, a.ids).sum())
                wanted += b.ids.numel()
    # The exact path once more on one torch thread: no parallel region to wait for (on shared cores
    # a 2-thread region can wait milliseconds for its second thread).
    torch.set_num_threads(1)
    t_exact1 = []
    for r in range(1, reps + 1):
        t = time.perf_counter()
        for index, (_, queries, lengths) in zip(indexes, data):
            select_events(event_scores(index.vectors(), queries[r]), lengths[:n], BUDGET)
        t_exact1.append(time.perf_counter() - t)
    torch.set_num_threads(2)
    # Adding one chunk's events to every layer's graph (three chunks, median).
    t_add = []
    for c in range(3):
        t = time.perf_counter()
        for index, (reprs, _, _) in zip(indexes, data):
            index.add(reprs[n + c * CHUNK_EVENTS : n + (c + 1) * CHUNK_EVENTS])
        t_add.append(time.perf_counter() - t)
    return {
        "exact": statistics.median(t_exact[1:]) / layers,  # per layer; medians: the cores are shared
        "faiss": statistics.median(t_faiss[1:]) / layers,
        "exact1": statistics.median(t_exact1) / layers,
        "add": statistics.median(t_add) / layers,
        "build": build / layers,
        "same": same / (reps * layers),
        "recall": found / wanted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--big-layers", type=int, default=4, help="layers actually run for sizes >= --big")
    ap.add_argument("--big", type=int, default=50000)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--big-reps", type=int, default=5)
    ap.add_argument("--ef-search", type=int, default=DEFAULT_EF_SEARCH)
    args = ap.parse_args()
    torch.set_num_threads(2)
    faiss.omp_set_num_threads(2)
    print(f"# Retrieval cost per chunk ({args.layers} layers x 1 select, budget {BUDGET} tokens, "
          f"{H_Q}x{D} per event, torch/faiss threads 2)")
    print(f"# HNSW M={DEFAULT_M} efConstruction={DEFAULT_EF_CONSTRUCTION} efSearch=max({args.ef_search}, 2k), "
          f"k = {BUDGET} // 8 + 1 + 32 = {BUDGET // 8 + 33}, {DEFAULT_ENTRIES} anchor entry points\n")
    rows = []
    for n in args.sizes:
        big = n >= args.big
        layers = args.big_layers if big else args.layers
        t = time.perf_counter()
        r = run_size(n, layers, args.big_reps if big else args.reps, args.ef_search)
        r.update(n=n, layers=layers, wall=time.perf_counter() - t)
        rows.append(r)
    L = args.layers
    print("| events/layer | layers run | exact ms/chunk | exact, 1 thread | faiss ms/chunk | exact/faiss "
          "| add ms/chunk (faiss) | faiss + add | build s/layer | identical | sel. recall |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        scale = "" if r["layers"] == L else f" (x{L}/{r['layers']})"
        ex, fa, ad = r["exact"] * L * 1e3, r["faiss"] * L * 1e3, r["add"] * L * 1e3
        ex1 = r["exact1"] * L * 1e3
        print(f"| {r['n']:,} | {r['layers']}{scale} | {ex:.1f} | {ex1:.1f} | {fa:.1f} | {ex / fa:.2f} | {ad:.1f} "
              f"| {fa + ad:.1f} | {r['build']:.2f} | {r['same']:.0%} | {r['recall']:.3f} |")
    per_event = ", ".join(f"{r['build'] / r['n'] * 1e3:.3f} ms/event at {r['n']:,}" for r in rows)
    print(f"\nadd: {CHUNK_EVENTS} events per layer per chunk into the graph; build: all events of one layer "
          f"at once ({per_event}).")
    print("identical: share of the timed selections equal to the exact path's; sel. recall: share of the "
          "exact selections' events that the faiss path also selected.")

    # Crossovers, log-linear interpolation between measured sizes (times grow ~linearly for exact).
    def crossover(key_f, exact="exact"):
        for a, b in zip(rows, rows[1:]):
            da, db = a[exact] - key_f(a), b[exact] - key_f(b)
            if da < 0 <= db:
                w = -da / (db - da)
                return math.exp(math.log(a["n"]) + w * (math.log(b["n"]) - math.log(a["n"])))
            if da >= 0 and a is rows[0]:
                return a["n"]  # (at or below the smallest size measured)
        return None

    for exact in ("exact", "exact1"):
        for label, f in (("search only", lambda r: r["faiss"]), ("search + add", lambda r: r["faiss"] + r["add"])):
            c = crossover(f, exact)
            print(f"crossover against {'exact, 1 thread' if exact == 'exact1' else 'exact'} ({label}): "
                  + (f"~{c:,.0f} events per layer" if c else "not within the measured sizes"))
    print(f"total wall time: {sum(r['wall'] for r in rows):.0f} s")


if __name__ == "__main__":
    main()
