"""Probe: is a miss the memory's selection, or the way the model reads it?

emllm's layers attend to the events each selects, all at one distance (spec §1). This takes the
events the question's step selected and hands them to the plain model as one ordinary context:
per RULER-style prompt, emllm (today's profile, in RAM) reads the document and the question; every
layer's selection is recorded; events are ranked by how many layers selected them (ties: the
earlier event) and taken while they fit in n_mem tokens; the plain model (sdpa) then reads

    the first n_init tokens + those events' tokens in stream order + the last n_local tokens + the question

(about emllm's attention span, n_init + n_mem + n_local) at positions 0.. and answers greedily.
Where this answers what emllm missed, the memory held what was needed and the fixed-distance
reading lost it; where both miss while the retrieval baseline at the same span answers
(`quality.py --methods rag --rag-budget 2176`), the selection itself falls short.

    python -m benchmarks.probe_reread niah_multikey --samples 0:2,2:3,5:10 --out results.jsonl
    python -m benchmarks.probe_reread niah_multikey --haystack code --samples 0:2,2:3,5:10 --out ...

--samples lists quality.py's (--first-sample, --samples) runs whose prompts to ask: a prompt's
depth depends on its run (quality.py spreads a run's depths evenly). Results: docs/benchmarks.md,
recall (why the multi-key misses).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from dataclasses import replace

import torch

from benchmarks import git_commit
from emllm import models
from emllm.engine.stream import Engine
from emllm.evals.passkey import run_baseline
from emllm.evals.recall import RecallProbe
from emllm.evals.ruler import HAYSTACKS, TASKS, build_prompt, read_prompt


def reread_context(eng: Engine, probe: RecallProbe, document: list[int], question: list[int]) -> tuple[list[int], list[int]]:
    """(context ids, events chosen) from the question step's selections (module docstring)."""
    pr = eng.profile
    votes = Counter(e for sel, _, _ in probe.last.values() for e in sel.ids.tolist())
    lengths = eng.windows[0].events.event_lengths().tolist()
    starts = [pr.n_init + s for s in torch.cumsum(torch.tensor([0] + lengths[:-1]), 0).tolist()]
    chosen, used = [], 0
    for e in sorted(votes, key=lambda e: (-votes[e], e)):
        if used + lengths[e] <= pr.n_mem:
            chosen.append(e)
            used += lengths[e]
    chosen.sort()
    tail_at = len(document) - pr.n_local  # events inside the tail are read there, once
    mid = [t for e in chosen if starts[e] + lengths[e] <= tail_at for t in document[starts[e] : starts[e] + lengths[e]]]
    return document[: pr.n_init] + mid + document[tail_at:] + question, chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", choices=sorted(TASKS))
    ap.add_argument("--haystack", choices=sorted(HAYSTACKS))
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--samples", default="0:5", help="FIRST:COUNT[,FIRST:COUNT]: quality.py's runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="JSON lines, appended")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    src = models.resolve("smollm2")
    model, tok = models.load(src)
    prof = src.profile.replace(segmentation="S")
    name = a.task if a.haystack is None else f"{a.task} ({a.haystack})"
    commit = git_commit()
    for run in a.samples.split(","):
        first, count = (int(x) for x in run.split(":"))
        for i in range(first, first + count):
            depth = round((i - first + 0.5) / count, 4)  # as quality.py places them
            p = build_prompt(a.task, tok, a.length, depth, random.Random(f"{a.seed}/{a.task}/{a.length}/{i}"), a.haystack)
            t0 = time.perf_counter()
            eng = Engine(model, prof)
            probe = read_prompt(eng, p)
            ids, chosen = reread_context(eng, probe, p.document, p.question)
            # the plain model on the context (it fits: no truncation), the question after it
            answer = run_baseline(model, tok, replace(p, document=ids[: len(ids) - len(p.question)]), p.max_new_tokens)
            r = {"task": name, "length": a.length, "sample": i, "depth": depth, "method": "reread",
                 "answers": p.answers, "answer": answer.strip(), "score": p.score(answer), "context": len(ids),
                 "events": len(chosen), "seconds": round(time.perf_counter() - t0, 1), "commit": commit}
            print(json.dumps(r), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
