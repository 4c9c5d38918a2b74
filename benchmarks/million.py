"""One long stream: the passkey at 1M tokens (or any length), with the memory in a store on disk.

    python -m benchmarks.million --tokens 1m --depth 0.5 --dir /var/tmp --out docs/results/million.jsonl

Reports what issue 8's scale item asks for: tokens/s at the start and at the end of the stream
(over the first and the last 5% of chunks), peak RSS (VmHWM of this process), the store's bytes on
disk, and whether the answer holds the key. Progress (tokens, tok/s, RSS) is printed every
`--every` chunks, so a run stopped early still tells how far it got and how fast.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from core import models
from core.passkey import build_prompt, parse_length, score
from core.scratch import ScratchStores


def vm(key: str) -> int:
    """VmHWM / VmRSS of this process, bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", default="1m")
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=".", help="folder for the temporary store (needs ~51 kB per token on SmolLM2)")
    ap.add_argument("--every", type=int, default=100, help="progress line every N chunks")
    ap.add_argument("--out", required=True, help="JSON lines, appended")
    a = ap.parse_args()
    src = models.resolve(a.model)
    model, tok = models.load(src)
    n = parse_length(a.tokens)
    prompt = build_prompt(tok, n, a.depth, random.Random(f"{a.seed}/{n}/{a.depth}/0"))
    cs = src.profile.chunk_size
    doc = torch.tensor(prompt.document)
    times: list[float] = []
    t_start = time.perf_counter()
    with ScratchStores(model, tok, src.profile, a.dir, src.name) as make:
        eng = make()
        for off in range(0, doc.numel(), cs):
            t = time.perf_counter()
            eng.step(doc[off : off + cs])
            times.append(time.perf_counter() - t)
            if len(times) % a.every == 0:
                recent = times[-a.every :]
                print(json.dumps({"tokens": off + cs, "tok_s_recent": round(cs * len(recent) / sum(recent), 1),
                                  "events": eng.n_events, "rss_mib": vm("VmRSS") >> 20, "hwm_mib": vm("VmHWM") >> 20,
                                  "elapsed_s": round(time.perf_counter() - t_start)}), flush=True)
        eng.feed(prompt.question)
        answer = tok.decode(eng.generate(10), skip_special_tokens=True)
        disk = sum(p.stat().st_size for p in Path(make._dir).rglob("*") if p.is_file())
    k = max(1, len(times) // 20)
    row = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "model": src.name, "tokens": len(prompt.document) + len(prompt.question), "depth": a.depth,
        "key": prompt.key, "answer": answer.strip(), "correct": score(answer, prompt.key),
        "tok_s_start": round(cs * k / sum(times[:k]), 1), "tok_s_end": round(cs * k / sum(times[-k:]), 1),
        "tok_s_total": round(doc.numel() / sum(times), 1), "peak_rss_mib": vm("VmHWM") >> 20,
        "disk_bytes": disk, "disk_bytes_per_token": round(disk / doc.numel(), 1),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
