"""A writer's retrieval in a store larger than `repr_cache_mb`: what one chunk's selections cost.

    python -m benchmarks.select_past_cap --store /var/tmp/m1bf/store [--layers 30] [--repeat 5]

A writer selects from every event's representative key (never from the sketch: its selections
are part of what it writes). While they fit in the profile's `repr_cache_mb` the keys stay
resident and one matrix-vector product estimates every score (`memory.prune`). Past it, the code
before 2026-11-26 scanned every event of the layer from `layers/NN.r` at every chunk; now the
first events stay resident and only the ones past the cap are scanned (their exact scores join
the estimates: the same selection). This opens a store read-only and times, per layer, one
selection each way (the scan; resident up to the cap, the rest scanned; everything resident, as a
larger cap would), with the query a random event's own representative key and the profile's
budget; the three selections are checked equal. Medians over --repeat queries, summed over layers:
the retrieval cost of one chunk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from emllm.config import Profile
from emllm.store import Store, StoredEvents


def timed(ev: StoredEvents, q: torch.Tensor, budget: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    sel = ev.select(q, budget)
    return time.perf_counter() - t0, sel.ids.tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--layers", type=int, default=None, help="the first N layers (default: all)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    a = ap.parse_args()
    torch.manual_seed(0)
    with Store.open(Path(a.store)) as st:
        prof = st.manifest["profile"]
        budget = prof.get("n_mem", Profile.n_mem)
        layers = range(st.geometry.layers if a.layers is None else a.layers)
        totals = {"scan": 0.0, "resident up to the cap, the rest scanned": 0.0, "all resident": 0.0}
        rows = []
        for i in layers:
            ev = StoredEvents(st, i)
            ev.sketch = None  # as a writer selects
            cap, n = ev.resident_cap, len(ev)
            ways = {"scan": 0, "resident up to the cap, the rest scanned": min(cap, n), "all resident": n}
            qs = [ev._repr_block(e, e + 1).float().reshape(st.repr_heads, -1) for e in torch.randint(0, n, (a.repeat,)).tolist()]
            times: dict[str, float] = {}
            picked: dict[str, list] = {}
            for way, c in ways.items():
                ev.resident.n = ev.resident_norms.n = 0  # each way fills its own resident rows
                ev.resident_cap = c
                ev.select(qs[0], budget)  # fills the resident rows (once per store in a real run)
                ts = []
                for q in qs:
                    t, ids = timed(ev, q, budget)
                    ts.append(t)
                    picked.setdefault(way, []).append(ids)
                times[way] = statistics.median(ts)
                totals[way] += times[way]
            assert all(p == picked["scan"] for p in picked.values()), f"layer {i}: the selections differ"
            rows.append({"layer": i, "events": n, "cap": cap, **{k: round(v * 1e3, 3) for k, v in times.items()}})
            print(json.dumps(rows[-1]), flush=True)
            del ev
    print(f"\nper chunk ({len(rows)} layers, {rows[0]['events']:,} events a layer, resident cap {rows[0]['cap']:,}):")
    for way, t in totals.items():
        print(f"  {way}: {t:.3f} s ({t / totals['scan']:.2f}x the scan)")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d"), "store": a.store, "budget": budget,
                       "per_chunk_s": {k: round(v, 4) for k, v in totals.items()}, "layers": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
