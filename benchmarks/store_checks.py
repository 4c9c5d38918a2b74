"""What a store's checks cost: digests at commit and at open, a full verify, finite keys at every gather.

    python -m benchmarks.store_checks [-m smollm2] [--doc docs/store-format.md] [--rounds 7]

One document is ingested into a new store as `emllm ingest` does; the time spent sealing digests
(emllm.store.digests: hashing what each commit adds, and every file's tail) is taken from inside
the same run, as a share of the ingest. Then: opening the store (tails checked), `emllm.verify_store`
(every byte), and the engine's check of each step's logits (what keys or values that are not
finite reach) against a token of emllm's own reading (the median of the rounds after the first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import emllm
import torch

from emllm.store import digests
from emllm.store.store import Store

QUESTION = "What does a crash in the middle of an ingest leave behind?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--doc", default="docs/store-format.md")
    ap.add_argument("--rounds", type=int, default=7, help="answers timed, the first untimed (at least 2)")
    ap.add_argument("--tokens", type=int, default=24, help="answer tokens per round")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds: at least 2 (the first answer warms up and is not counted)")

    spent = {"seal": 0.0, "commits": 0}
    seal = digests.Digests.seal

    def timed_seal(self, files):
        t = time.perf_counter()
        out = seal(self, files)
        spent["seal"] += time.perf_counter() - t
        spent["commits"] += 1
        return out

    digests.Digests.seal = timed_seal
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s"
        model = emllm.load(args.model)
        t = time.perf_counter()
        with emllm.create(path, model=model) as mem:
            mem.ingest(("doc", Path(args.doc).read_text()))
        ingest_s = time.perf_counter() - t
        t = time.perf_counter()
        with Store.open(path) as st:
            open_s, total = time.perf_counter() - t, st.total_bytes()
            tokens = st.manifest["rows"]["tokens"]
        t = time.perf_counter()
        report = emllm.verify_store(path)
        verify_s = time.perf_counter() - t
        assert not report["problems"], report

        with emllm.open(path, model=model) as mem:
            times = []
            for _ in range(args.rounds):
                t = time.perf_counter()
                answer = mem.answer(QUESTION, max_new_tokens=args.tokens, reread=False)
                n = len(list(answer))
                times.append((time.perf_counter() - t) / max(n, 1))
        # the engine's check of each step's logits (what keys and values that are not finite reach)
        logits = torch.randn(model.model.config.vocab_size)  # (float32, as the engine checks them)
        t = time.perf_counter()
        for _ in range(1000):
            bool(torch.isfinite(logits.sum()))
        check_s = (time.perf_counter() - t) / 1000
    token_s = statistics.median(times[1:])
    print(json.dumps({
        "model": args.model, "tokens": tokens, "ingest_s": round(ingest_s, 2), "seal_s": round(spent["seal"], 3),
        "commits": spent["commits"], "seal_share": round(spent["seal"] / ingest_s, 4),
        "open_s": round(open_s, 4), "verify_s": round(verify_s, 3), "verified_bytes": report["bytes"],
        "verify_gb_s": round(report["bytes"] / verify_s / 1e9, 2), "committed_bytes": total,
        "answer_s_token": round(token_s, 4), "logits_check_us": round(check_s * 1e6, 1),
        "logits_check_share": round(check_s / token_s, 5),
    }))


if __name__ == "__main__":
    main()
