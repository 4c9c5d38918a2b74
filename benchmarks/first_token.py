"""Time to the first answer token of `emllm ask`, for stores of different sizes, side by side.

    python -m benchmarks.first_token --stores /var/tmp/m32/store,/var/tmp/m1/store --runs 3 [--cold]

Each run asks every store once, in turn (the real executable, one process per ask), and reads
`seconds_to_first_token` from its JSON (from opening the store to the first token: model load,
mapping, reading the question with retrieval in every layer). `--cold` empties the page cache
before every ask (`sync; echo 1 > /proc/sys/vm/drop_caches`, root only), so each ask reads what it
needs from the disk: the honest case for a store larger than RAM. Without it, the first run
warms the cache and the later ones show what an ask costs when its pages are cached.
Prints the medians and their ratio to the first store's.

    python -m benchmarks.first_token --stores S1,S2 --runs 4 --cold --then-cached --revs c7c6306,.

`--revs` compares versions of the code side by side: each revision (a commit, or "." for the
working tree) is frozen into a temporary folder (`benchmarks.frozen_code`) and the asks alternate
between them, store by store, run by run (this VM's speed drifts: only alternated runs compare).
`--then-cached` asks once more right after each ask, its pages now cached. `--readings
reread,own` alternates `ask`'s default (the memory's passages read again, one
more forward over ~2k tokens before the first token) with emllm's own reading (`--no-reread`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import frozen_code, git_commit, machine

EMLLM = str(Path(sys.executable).parent / "emllm")


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


READINGS = {"reread": [], "own": ["--no-reread"]}  # `ask`'s default, and emllm's own reading


def ask(store: str, question: str, code: Path | None = None, reading: str = "reread") -> dict:
    """One `emllm ask` process: the installed executable, or the frozen code under `code`."""
    t = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [EMLLM]
    if code is not None:
        env["PYTHONPATH"] = str(code)
        cmd = [sys.executable, "-c", "import sys; from emllm_cli.main import cli; sys.argv[0] = 'emllm'; sys.exit(cli())"]
    p = subprocess.Popen([*cmd, "ask", question, "--store", store, "-n", "1", "--json", *READINGS[reading]],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=code)
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
    ap.add_argument("--revs", default=None, help="comma-separated git revisions (\".\": the working tree) to alternate")
    ap.add_argument("--then-cached", action="store_true", help="after each ask, ask again with its pages cached")
    ap.add_argument("--readings", default="reread",
                    help="comma-separated, alternated: reread (`ask`'s default), own (`--no-reread`); ratios are to the first")
    a = ap.parse_args()
    readings = a.readings.split(",")
    if not set(readings) <= set(READINGS):
        ap.error(f"--readings: of {', '.join(READINGS)}")
    stores = a.stores.split(",")
    tmp = tempfile.TemporaryDirectory(prefix="emllm-first-token-")
    revs = a.revs.split(",") if a.revs else [None]
    codes = {r: (frozen_code(r, Path(tmp.name) / f"code{i}") if r else None) for i, r in enumerate(revs)}
    kinds = ["cold" if a.cold else "first", *(["cached"] if a.then_cached else [])]
    times: dict[tuple, list[float]] = {(s, r, g, k): [] for s in stores for r in revs for g in readings for k in kinds}
    for run in range(a.runs):
        for s in stores:
            for r in revs:
                for g in readings:
                    if a.cold:
                        drop_caches()
                    for k in kinds:
                        res = ask(s, a.question, codes[r], g)
                        times[(s, r, g, k)].append(res["first_token_s"])
                        print(json.dumps({"run": run, "store": s, "rev": r, "reading": g, "kind": k, **res}), flush=True)
    rows = []
    base = {k: statistics.median(times[(stores[0], revs[0], readings[0], k)]) for k in kinds}
    for (s, r, g, k), ts in times.items():
        m = json.loads((Path(s) / "manifest.json").read_text())
        med = statistics.median(ts)
        rows.append({"store": s, "rev": r, "reading": g, "kind": k, "tokens": m["rows"]["tokens"], "events": m["rows"]["events"],
                     "sketch": bool(m.get("sketch")), "first_token_s": ts, "median_s": med,
                     "ratio": round(med / base[k], 3)})
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": git_commit(), "machine": f"{machine()}, {os.cpu_count()} cpus",
              "cold": a.cold, "question": a.question, "revs": revs, "rows": rows}
    print(json.dumps(result, indent=1))
    for row in rows:
        print(f"{row['store']}  {row['rev'] or 'installed'}  {row['reading']}  {row['kind']}: median {row['median_s']:.2f} s ({row['ratio']}x)")
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    tmp.cleanup()


if __name__ == "__main__":
    main()
