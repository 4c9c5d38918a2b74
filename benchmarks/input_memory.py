"""Peak RSS of reading a document into a store, against the document's size: streamed (a piece at
a time, as `emllm ingest` reads) and, for comparison, whole (the text and its ids in RAM at once).

    python -m benchmarks.input_memory --sizes 256m,2g [--whole 256m]

Each measurement is its own process (ru_maxrss is a process's peak): it loads SmolLM2's tokenizer
and a tiny model of its vocabulary, creates a store, and queues the file as its job
(`add_documents`: read, tokenize, write the job file, commit). The model's reading of the job is
not part of it (at ~100 tok/s a 2 GB file would take months); `run_job` reads the job a chunk at
a time, so it adds nothing that grows with the file either.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import machine
from emllm.evals.corpus import prose

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
import torch
from transformers import AutoTokenizer, LlamaConfig, AutoModelForCausalLM
from emllm.app import ingest as ing
from emllm.app import stream
from emllm import models
from emllm.config import load_profile
from emllm.app.textinput import TextSource

path, store, whole = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1"
tok = AutoTokenizer.from_pretrained(models.resolve("smollm2").path)
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256)
model = AutoModelForCausalLM.from_config(cfg).eval()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
with stream.create_store(store, "tiny", model, tok, load_profile("smollm2")) as st:
    doc = Path(path).read_text() if whole else TextSource.open(path)
    n = ing.add_documents(st, tok, [("doc", doc)])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"tokens": n, "seconds": time.perf_counter() - t0, "rss_before_mib": base / 1024, "peak_rss_mib": peak / 1024}))
"""


def _size(text: str) -> int:
    t = text.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult != 1 else t) * mult)


def _make(path: Path, size: int) -> None:
    unit = prose().encode()  # real prose (Python's own docs), repeated
    with open(path, "wb") as f:
        left = size
        while left > 0:
            f.write(unit[:left])
            left -= len(unit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256m,2g", help="document sizes read streamed")
    ap.add_argument("--whole", default="256m", help="sizes also read whole, for comparison ('' for none)")
    a = ap.parse_args()
    print(f"# {machine()}, python {platform.python_version()}", flush=True)
    print("| size | read | tokens | seconds | peak RSS (MiB) | RSS before reading (MiB) |")
    print("|---|---|---:|---:|---:|---:|")
    runs = [(s, False) for s in a.sizes.split(",") if s] + [(s, True) for s in a.whole.split(",") if s]
    for size, whole in runs:
        with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
            doc = Path(d) / "doc.txt"
            _make(doc, _size(size))
            r = subprocess.run([sys.executable, "-c", CHILD, str(doc), str(Path(d) / "store"), "1" if whole else "0"],
                               capture_output=True, text=True)
            if r.returncode:
                print(f"| {size} | {'whole' if whole else 'streamed'} | failed: {r.stderr.strip().splitlines()[-1]} |||||")
                continue
            x = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"| {size} | {'whole' if whole else 'streamed'} | {x['tokens']:,} | {x['seconds']:.0f} | "
                  f"{x['peak_rss_mib']:.0f} | {x['rss_before_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
