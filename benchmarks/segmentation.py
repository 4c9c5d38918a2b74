"""Segmentation quality (paper Table 2) and the cost of refinement, on offline texts.

    python -m benchmarks.segmentation --tokens 8k --texts prose,code,haystack --cost

For each text: one streaming pass of the engine gives surprise and keys; every method's
boundaries are scored (modularity, conductance, intra/inter similarity, averaged over
chunk-sized stretches) as the difference to random segmentation with the same number of events.
With --cost, the engine ingests the text with S and with SM, side by side, and the mean per-chunk
times are compared.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.corpus import tokens as corpus_tokens
from benchmarks.ingest_speed import emllm_run
from core import document, models
from core.engine import Engine
from core.passkey import parse_length


def per_chunk(model, prof, ids) -> float:
    t, _ = emllm_run(model, prof, ids)
    skip = -(-(prof.n_local) // prof.chunk_size)  # once events form
    return sum(t[skip:]) / len(t[skip:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8k")
    ap.add_argument("--texts", default="prose,code,haystack")
    ap.add_argument("--cost", action="store_true")
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
            rows[m] = {"events": st.numel(), **{k: got[k] - ref[k] for k in got}}
        out["texts"][kind] = rows
        print(f"\n{kind} ({n} tokens)\n| method | events | modularity ×10³ | conductance | intra/inter |\n|---|---|---|---|---|")
        for m, r in rows.items():
            print(f"| {m} | {r['events']} | {1e3 * r['modularity']:+.3f} | {r['conductance']:+.4f} | {r['intra_inter']:+.4f} |")
        if a.cost and kind == a.texts.split(",")[0]:
            s, sm = per_chunk(model, prof, ids), per_chunk(model, prof.replace(segmentation="SM"), ids)
            out["cost"] = {"text": kind, "S_chunk_s": round(s, 3), "SM_chunk_s": round(sm, 3), "ratio": round(sm / s, 3)}
            print(f"\nper-chunk time: S {s:.3f} s, SM {sm:.3f} s, ratio {sm / s:.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
