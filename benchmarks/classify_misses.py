"""What a multi-key answer said: the asked key's number, another key's, a near copy, or none.

    python -m benchmarks.classify_misses docs/results/quality-cells-8k-lse.jsonl [more.jsonl ...]

A multi-key prompt hides four numbers under four keys and asks for one. A miss whose retrieval
held the needle (quality.py's `needle_layers`) is a misread; this tells which kind: the model
answered **another key's number** (it bound the asked key to the wrong needle), a **near copy** of
the asked or another number (at most two digits differ: a copy that slipped), some other number,
or **no number** at all. The prompts are rebuilt from each answer's sample and depth (quality.py's
seeding), so only the results files are needed. Prints one line per answer, then the counts per
task, haystack and method.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re

from emllm import models
from emllm.evals.ruler import build_prompt

TASK = "niah_multikey"


def _near(a: str, b: str) -> bool:
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) <= 2


def classify(answer: str, asked: str, others: list[str]) -> str:
    nums = re.findall(r"\d{5,}", answer)
    if not nums:
        return "no number"
    n = nums[0]
    if n == asked:
        return "right"
    if n in others:
        return "another key's"
    if _near(n, asked):
        return "near the asked"
    if any(_near(n, o) for o in others):
        return "near another"
    return "other number"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="quality.py JSON lines")
    ap.add_argument("--model", default="smollm2")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.resolve(a.model).path)
    counts: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for path in a.results:
        grid: dict = {}
        for line in open(path):
            r = json.loads(line)
            if "grid" in r:
                grid = r["grid"]
                continue
            if not r.get("task", "").startswith(TASK) or r["method"] == "oracle":
                continue
            hay = grid.get("haystack")
            rng = random.Random(f"{grid.get('seed', 0)}/{TASK}/{r['length']}/{r['sample']}")
            p = build_prompt(TASK, tok, r["length"], r["depth"], rng, hay)
            values = p.meta["values"]
            c = classify(r["answer"], values[0][0], [v[0] for v in values[1:]])
            counts[(r["task"], r["method"])][c] += 1
            print(f"{r['task']:22s} {r['method']:14s} sample {r['sample']:2d}  {c:15s} {r['answer'][:24]!r}  asked {values[0][0]}")
    print()
    for (task, method), c in sorted(counts.items()):
        print(f"{task:22s} {method:14s} " + ", ".join(f"{k} {v}" for k, v in c.most_common()))


if __name__ == "__main__":
    main()
