"""The store at scale: peak RSS of `emllm ingest`, time to the first answer token of `emllm ask`,
and bytes on disk per token, for stores of several sizes. Each command runs as its own process
(the real executable), so RSS is that process's own peak.

    python -m benchmarks.store_scale --tokens 32k,128k [--keep DIR]

Peak RSS is ru_maxrss of the child (resident pages, including pages of mapped files it touched).
Time to first token is measured inside `ask` (`seconds_to_first_token`: from the command's start,
model load included), twice per store: the second run finds the files in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from emllm.evals.corpus import code, prose
from emllm.evals.passkey import parse_length

EMLLM = str(Path(sys.executable).parent / "emllm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="32k,128k")
    ap.add_argument("--keep", default=None, help="folder for the stores (default: a temporary one, removed)")
    ap.add_argument("--ask-only", action="store_true", help="only time `ask` on the stores already in --keep")
    a = ap.parse_args()
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(dir=Path.cwd()))
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "EMLLM_HOME": str(root), "HF_HUB_OFFLINE": "1"}
    from emllm.home import models_dir

    env["EMLLM_MODELS"] = str(models_dir())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models_dir() / "smollm2")
    base = tok(prose() + "\n\n" + code(), add_special_tokens=False)["input_ids"]
    rows = []
    for n_text in a.tokens.split(","):
        n = parse_length(n_text)
        ids = (base * (n // len(base) + 1))[:n]
        if a.ask_only:
            m = json.loads((root / "stores" / f"s{n}" / "manifest.json").read_text())
            size = sum(p.stat().st_size for p in (root / "stores" / f"s{n}").rglob("*") if p.is_file())
            ingest = {"tokens": m["rows"]["tokens"], "events": m["rows"]["events"], "seconds": None,
                      "tokens_per_second": None, "bytes": size}
            rss_ingest = 0
        else:
            doc = root / f"doc-{n}.txt"
            doc.write_text(tok.decode(ids))
            ingest, wall, _ = _measured(["ingest", str(doc), "--store", f"s{n}", "--json"], env)
            rss_ingest = _last_rss
        asks = []
        for _ in range(2):
            ans, _, _ = _measured(["ask", "What is this document about?", "--store", f"s{n}", "-n", "1", "--json"], env)
            asks.append(ans["seconds_to_first_token"])
        rows.append({
            "tokens": ingest["tokens"], "events": ingest["events"], "ingest_s": ingest["seconds"],
            "ingest_tok_s": ingest["tokens_per_second"], "ingest_peak_rss_mib": round(rss_ingest / 2**20, 1),
            "ask_first_token_s_cold": asks[0], "ask_first_token_s_warm": asks[1],
            "ask_peak_rss_mib": round(_last_rss / 2**20, 1),
            "bytes": ingest["bytes"], "bytes_per_token": round(ingest["bytes"] / ingest["tokens"], 1),
        })
        print(json.dumps(rows[-1]), flush=True)
    g = json.loads((root / "stores" / f"s{parse_length(a.tokens.split(',')[0])}" / "manifest.json").read_text())["geometry"]
    raw = g["layers"] * 2 * g["kv_heads"] * g["head_dim"] * {"float32": 4}.get(g["dtype"], 2)
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
                      "raw_kv_bytes_per_token": raw, "rows": rows}, indent=1))
    if not a.keep:
        shutil.rmtree(root)


_last_rss = 0


def _measured(args: list[str], env: dict) -> tuple[dict, float, int]:
    """Run one command and record its peak RSS (wait4 on the child itself)."""
    global _last_rss
    t = time.perf_counter()
    p = subprocess.Popen([EMLLM, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"emllm {' '.join(args)} failed: {err.decode()[-500:]}")
    _last_rss = ru.ru_maxrss * 1024  # KiB on Linux
    return json.loads(out), time.perf_counter() - t, _last_rss


if __name__ == "__main__":
    main()
