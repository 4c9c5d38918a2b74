"""The passkey's re-read in each layout (`app.reread.LAYOUTS`), from one read of each prompt.

For each length and depth: the prompt `emllm passkey` builds (seed 0, trial 0), read once by
emllm (today's profile, in RAM) with every layer's selection recorded at the question; emllm's
own answer, then the passages the votes chose read again by the plain model in each layout
(`context_from_votes(layout=...)`), and "hybrid": the lexical layout with the passages chosen by
the votes and the question's words (choice "votes+words"). One JSON line per prompt, appended to
--out.

    python -m benchmarks.passkey_layouts --lengths 16k,32k,64k --depths 0.25,0.5,0.75 --out F.jsonl

Results: docs/benchmarks.md, re-read answers (three layouts).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from benchmarks import git_commit
from emllm import models
from emllm.app.reread import LAYOUTS, SelectionRecorder, context_from_votes, read_again, reread_room
from emllm.engine.stream import Engine
from emllm.evals.passkey import _stop_ids, build_prompt, parse_length, score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="16k", help="comma-separated, e.g. 16k,64k")
    ap.add_argument("--depths", default="0.25,0.5,0.75")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=None, help="auto, float32, bfloat16 (default: the profile's)")
    ap.add_argument("--out", required=True, help="JSON lines, appended")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    src = models.resolve("smollm2")
    model, tok = models.load(src, dtype=a.dtype)
    prof = src.profile
    stops = set(_stop_ids(tok, model))
    commit = git_commit()
    for length in (parse_length(x) for x in a.lengths.split(",")):
        for depth in (float(x) for x in a.depths.split(",")):
            p = build_prompt(tok, length, depth, random.Random(f"0/{length}/{depth}/0"))  # as run_grid: seed 0, trial 0
            t0 = time.perf_counter()
            eng = Engine(model, prof)
            eng.feed(p.document)
            rec = SelectionRecorder(eng)
            eng.begin_question()
            eng.feed(p.question)
            rec.detach()
            row = {"length": length, "depth": depth, "key": p.key,
                   "emllm": tok.decode(eng.generate(10, stops), skip_special_tokens=True).strip(),
                   "read_seconds": round(time.perf_counter() - t0, 1)}
            room = reread_room(prof, len(p.document), len(p.question))
            ways = {**{lay: (lay, "votes") for lay in LAYOUTS}, "hybrid": ("lexical", "votes+words")}
            for name, (layout, choice) in ways.items():
                rr = context_from_votes(torch.tensor(p.document), rec.votes(), tok, prof.n_init, prof.n_local, room,
                                        len(eng.windows), layout=layout, question=p.question, choice=choice)
                reader = read_again(model, prof, rr.ids, p.question, 10)
                row[name] = tok.decode(reader.generate(10, stops), skip_special_tokens=True).strip()
            row["correct"] = {m: score(row[m], p.key) for m in ("emllm", *ways)}
            row.update(dtype=str(model.dtype).removeprefix("torch."), commit=commit)
            print(json.dumps(row), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
