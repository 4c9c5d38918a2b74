"""Time to the first answer token of `emllm ask`, for stores of different sizes, side by side.

    python -m benchmarks.first_token --stores /var/tmp/m32/store,/var/tmp/m1/store --runs 3 [--cold]

Each run asks every store once, in turn (the real executable, one process per ask), and reads
`seconds_to_first_token` from its JSON (from opening the store to the first token: model load,
mapping, reading the question with retrieval in every layer). `--cold` empties the page cache
before every ask (`sync; echo 1 > /proc/sys/vm/drop_caches`, root only), so each ask reads what it
needs from the disk: the honest case for a store larger than RAM. Without it, the first run
warms the cache and the later ones show what an ask costs when its pages are cached.
Prints the medians and their ratio to the first store's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import git_commit

EMLLM = str(Path(sys.executable).parent / "emllm")


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def ask(store: str, question: str) -> dict:
    t = time.perf_counter()
    p = subprocess.Popen([EMLLM, "ask", question, "--store", store, "-n", "1", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"emllm ask --store {store} failed: {err.decode()[-500:]}")
    doc = json.loads(out)
    return {"first_token_s": doc["seconds_to_first_token"], "process_s": round(time.perf_counter() - t, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", required=True, help="comma-separated store paths; ratios are to the first")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every ask (root)")
    ap.add_argument("--question", default="What is the pass key?")
    ap.add_argument("--out", default=None, help="append the result as one JSON line")
    a = ap.parse_args()
    stores = a.stores.split(",")
    times: dict[str, list[float]] = {s: [] for s in stores}
    for run in range(a.runs):
        for s in stores:
            if a.cold:
                drop_caches()
            r = ask(s, a.question)
            times[s].append(r["first_token_s"])
            print(json.dumps({"run": run, "store": s, **r}), flush=True)
    rows = []
    base = statistics.median(times[stores[0]])
    for s in stores:
        m = json.loads((Path(s) / "manifest.json").read_text())
        med = statistics.median(times[s])
        rows.append({"store": s, "tokens": m["rows"]["tokens"], "events": m["rows"]["events"],
                     "sketch": bool(m.get("sketch")), "first_token_s": times[s], "median_s": med,
                     "ratio": round(med / base, 3)})
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": git_commit(), "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
              "cold": a.cold, "question": a.question, "rows": rows}
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
