"""How close the passkey's answer is to a miss: the first answer token's margin, per question scoring.

    python -m benchmarks.passkey_margin --lengths 8k,16k --depths 0.25,0.5,0.75 --dir /var/tmp/pk \
        --scorings mean,max,lse --out docs/results/passkey-margin.jsonl
    python -m benchmarks.passkey_margin --store /var/tmp/m1/store:1m:0.5 --scorings max,lse --out ...

The passkey's prompt ends "The pass key is", and SmolLM2 answers either " " followed by the key's
digits or " the" followed by more filler: its first token decides. For each store and each
question scoring (profile `question_scoring`) this asks the question as `emllm ask` does (the
store read-only, the stream continued from its last commit) and records, from the logits that
predict the first answer token (log-softmax, in the model's dtype as computed): the key's first
token (" " for SmolLM2), the best other token, their difference (the margin: > 0 answers the key),
the needle's recall (layers whose selection holds its event), and the greedy answer.

Stores are made as `benchmarks.million` makes them (the plain passkey prompt, no chat template,
the same seed and key), kept under `--dir` as passkey-LENGTH-DEPTH and reused when present; or
given whole with `--store PATH:LENGTH:DEPTH` (a store of `benchmarks.million`). Only the question
depends on the scoring, so one store serves every scoring.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from benchmarks import git_commit
from emllm import models
from emllm.app.ask import Session
from emllm.app.ingest import run_job
from emllm.app.stream import create_store, open_engine
from emllm.config import QUESTION_SCORINGS
from emllm.evals.passkey import build_prompt, parse_length, score
from emllm.evals.recall import RecallProbe, needle_recall
from emllm.store import Store


def make_store(path: Path, src, model, tok, prompt) -> None:
    """The prompt's document ingested into a new store at `path` (as `benchmarks.million`)."""
    with create_store(path, src.name, model, tok, src.profile, chat=False) as st:
        st.set_job(torch.tensor(prompt.document, dtype=torch.int32), [{
            "name": path.name, "sha256": "", "start": 0, "tokens": len(prompt.document), "chars": 0}])
        run_job(st, open_engine(st, model))


def margin(path: Path, n: int, depth: float, scoring: str, model, tok, prompt, answer_tokens: int,
           distinct: bool | None = None) -> dict:
    """One question on one store under one scoring (see the module docstring); distinct: the
    profile's distinct_events for the question (None: the store's)."""
    t = time.perf_counter()
    with Store.open(path) as st:
        session = Session(st, model, tok)
        eng = session.engine
        eng.profile = eng.profile.replace(question_scoring=scoring)  # (read at every step)
        if distinct is not None:
            eng.profile = eng.profile.replace(distinct_events=distinct)
        probe = RecallProbe(eng)
        lp = session.read_question_ids(prompt.question).float().log_softmax(-1)
        probe.detach()
        rec = needle_recall(eng, probe, prompt.needles)[0]
        want = tok(" " + prompt.key, add_special_tokens=False)["input_ids"][0]
        other = lp.clone()
        other[want] = float("-inf")
        best = int(other.argmax())
        answer = tok.decode(eng.generate(answer_tokens), skip_special_tokens=True)
    return {"tokens": n, "depth": depth, "scoring": scoring, "distinct_events": eng.profile.distinct_events, "key": prompt.key,
            "key_token": tok.decode([want]), "lp_key_token": round(float(lp[want]), 4),
            "best_other": tok.decode([best]), "lp_best_other": round(float(lp[best]), 4),
            "margin": round(float(lp[want] - lp[best]), 4), "answer": answer.strip(), "correct": score(answer, prompt.key),
            "needle_where": rec.where, "needle_layers": rec.layers, "of": rec.of,
            "seconds": round(time.perf_counter() - t, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", default="", help="comma-separated: 8k, 16k, ... (stores under --dir)")
    ap.add_argument("--depths", default="0.25,0.5,0.75")
    ap.add_argument("--dir", type=Path, help="where the stores of --lengths are kept (made when absent)")
    ap.add_argument("--store", action="append", default=[], metavar="PATH:LENGTH:DEPTH",
                    help="a store made by benchmarks.million (repeatable)")
    ap.add_argument("--scorings", default=",".join(QUESTION_SCORINGS))
    ap.add_argument("--distinct", default="", help="distinct_events values to ask with, comma-separated 0/1 "
                    "(default: the store's own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="JSON lines, appended")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    scorings = a.scorings.split(",")
    if unknown := [s for s in scorings if s not in QUESTION_SCORINGS]:
        ap.error(f"unknown scoring {unknown[0]!r}: one of {', '.join(QUESTION_SCORINGS)}")
    cases = [(Path(p), parse_length(n), float(d)) for p, n, d in (s.rsplit(":", 2) for s in a.store)]
    if a.lengths:
        if a.dir is None:
            ap.error("--lengths needs --dir")
        cases += [(a.dir / f"passkey-{parse_length(n)}-{float(d)}", parse_length(n), float(d))
                  for n in a.lengths.split(",") for d in a.depths.split(",")]
    src = models.resolve(a.model)
    model, tok = models.load(src)
    commit = git_commit()
    for path, n, depth in cases:
        prompt = build_prompt(tok, n, depth, random.Random(f"{a.seed}/{n}/{depth}/0"))
        if not path.exists():
            make_store(path, src, model, tok, prompt)
        for s, d in ((s, d) for s in scorings for d in ([x == "1" for x in a.distinct.split(",")] if a.distinct else [None])):
            row = {**margin(path, n, depth, s, model, tok, prompt, a.answer_tokens, d), "store": str(path), "commit": commit}
            print(json.dumps(row), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
