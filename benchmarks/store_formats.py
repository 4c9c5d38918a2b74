"""Bytes per token on disk and bytes written per token, per store format, on one text.

    python -m benchmarks.store_formats --tokens 32k [--runs float32:float32,bfloat16:bfloat16,bfloat16:int8,bfloat16:int4]

Each run is DTYPE:FORMAT: the compute dtype and the store format. The same tokens are ingested
into a new store per run, the way `emllm ingest` does (commits every 4 chunks), in this process,
whose write counters (/proc/self/io: `wchar`, bytes handed to write(); `write_bytes`, bytes the
kernel sent to the disk) are read around it. Ratios are against the first run (today's store:
float32 computed, float32 kept).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from emllm.evals.corpus import tokens as corpus_tokens
from emllm import models
from emllm.app import ingest as ing
from emllm.app import stream
from emllm.evals.passkey import parse_length


def io_counters() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="smollm2")
    ap.add_argument("--tokens", default="32k")
    ap.add_argument("--runs", default="float32:float32,bfloat16:bfloat16,bfloat16:int8,bfloat16:int4")
    ap.add_argument("--dir", default=None, help="where the stores are made (default: a temporary folder here)")
    a = ap.parse_args()
    src = models.resolve(a.model)
    runs = [tuple(r.split(":")) for r in a.runs.split(",")]
    loaded: dict = {}
    n = parse_length(a.tokens)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
                 "model": a.model, "runs": []}
    with tempfile.TemporaryDirectory(dir=a.dir or Path.cwd()) as tmp:
        for dtype, fmt in runs:
            if dtype not in loaded:
                loaded[dtype] = models.load(src, dtype=dtype)
            model, tok = loaded[dtype]
            ids = corpus_tokens(tok, "prose", n)
            path = Path(tmp) / f"{dtype}-{fmt}"
            before, t0 = io_counters(), time.perf_counter()
            with stream.create_store(path, src.name, model, tok, src.profile, kv_format=fmt) as st:
                engine = stream.open_engine(st, model)
                ing.add_tokens(st, ids, {"name": "bench", "kind": "document"})
                ing.run_job(st, engine, 4)
                parts = st.bytes_on_disk()
                tokens = st.tokens.rows + len(stream.pending_tokens(st))
            after, secs = io_counters(), time.perf_counter() - t0
            total = sum(parts.values())
            res["runs"].append({
                "dtype": dtype, "format": fmt, "tokens": tokens, "seconds": round(secs, 1),
                "bytes_per_token": round(total / tokens, 1),
                "parts_per_token": {k: round(v / tokens, 1) for k, v in parts.items() if v},
                "written_per_token": round((after["wchar"] - before["wchar"]) / tokens, 1),
                "disk_written_per_token": round((after["write_bytes"] - before["write_bytes"]) / tokens, 1),
            })
            print(json.dumps(res["runs"][-1]), flush=True)
    ref = res["runs"][0]["bytes_per_token"]
    for r in res["runs"]:
        r["ratio_vs_first"] = round(r["bytes_per_token"] / ref, 3)
        r["written_vs_kept"] = round(r["written_per_token"] / r["bytes_per_token"], 3)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
