"""Segmentation quality (paper Table 2) and the cost of refinement, on offline texts.

    python -m benchmarks.segmentation --tokens 8k --texts prose,code,haystack --cost

For each text: one streaming pass of the engine gives surprise and keys; every method's
boundaries are scored (modularity, conductance, intra/inter similarity, averaged over
chunk-sized stretches) as the difference to random segmentation with the same number of events.
With --cost, engines with S and with SM ingest the first text in lockstep (one chunk each in
turn), and the mean per-chunk times are compared. --cost-tokens sets that run's length.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from emllm.evals.corpus import tokens as corpus_tokens
from emllm.app import document
from emllm import models
from emllm.engine.stream import Engine
from emllm.evals.passkey import parse_length


def lockstep_cost(model, prof, ids) -> tuple[float, float]:
    """Mean per-chunk time of S and SM engines advancing in turn over the same chunks (so load on
    the machine hits both alike), once events form."""
    engines = {m: Engine(model, prof.replace(segmentation=m)) for m in ("S", "SM")}
    times: dict[str, list[float]] = {m: [] for m in engines}
    for off in range(0, ids.numel(), prof.chunk_size):
        for m, e in engines.items():
            t = time.perf_counter()
            e.step(ids[off : off + prof.chunk_size])
            times[m].append(time.perf_counter() - t)
    skip = -(-prof.n_local // prof.chunk_size)
    return tuple(sum(times[m][skip:]) / len(times[m][skip:]) for m in ("S", "SM"))  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8k")
    ap.add_argument("--texts", default="prose,code,haystack")
    ap.add_argument("--cost", action="store_true")
    ap.add_argument("--cost-tokens", default=None, help="length of the cost run (default: --tokens)")
    a = ap.parse_args()
    src = models.resolve("smollm2")
    model, tok = models.load(src)
    prof = src.profile.replace(segmentation="S")
    n = parse_length(a.tokens)
    out = {"date": time.strftime("%Y-%m-%d"), "tokens": n, "texts": {}}
    for kind in a.texts.split(","):
        ids = torch.tensor(corpus_tokens(tok, kind, n))
        an = document.analyse(Engine(model, prof), ids)
        rows = {}
        for m in ("S", "SM", "SC", "F", "FM", "FC"):
            st = document.boundaries(an, m, prof.min_block, prof.max_block, prof.chunk_size)
            rnd = document.random_like(n, st.numel(), prof.min_block, seed=0)
            got, ref = document.metrics(an, st, prof.chunk_size), document.metrics(an, rnd, prof.chunk_size)
            rows[m] = {"events": st.numel(), **document.difference(got, ref)}
        out["texts"][kind] = rows
        print(f"\n{kind} ({n} tokens)\n| method | events | modularity ×10³ | conductance | intra/inter |\n|---|---|---|---|---|")
        for m, r in rows.items():
            print(f"| {m} | {r['events']} | {1e3 * r['modularity']:+.3f} | {r['conductance']:+.4f} | {r['intra_inter']:+.4f} |")
        if a.cost and kind == a.texts.split(",")[0]:
            cids = torch.tensor(corpus_tokens(tok, kind, parse_length(a.cost_tokens))) if a.cost_tokens else ids
            s, sm = lockstep_cost(model, prof, cids)
            out["cost"] = {"text": kind, "tokens": cids.numel(), "S_chunk_s": round(s, 3), "SM_chunk_s": round(sm, 3), "ratio": round(sm / s, 3)}
            print(f"\nper-chunk time: S {s:.3f} s, SM {sm:.3f} s, ratio {sm / s:.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
