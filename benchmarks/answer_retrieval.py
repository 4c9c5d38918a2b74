"""What an answer's tokens attend to (profile answer_retrieval), both ways from one read: "question"
(the events the question's last chunk retrieved, kept for the whole answer) and "token" (the
paper's: each token retrieves with its own query), scored and timed side by side.

    python -m benchmarks.answer_retrieval --model qwen2.5-coder-0.5b \\
        passkey:64k:0.5 niah_single_words:64k:0:2 niah_multivalue@code:16k:1:2 --out answers.jsonl

Each item is read once (document, then the question as its own chunk); the engine is copied after
the question and each copy answers one way, greedily: the same read, so the answers differ only by
what their tokens attend to. Items: `passkey:LENGTH:DEPTH` (the passkey test's prompt, the
profile's segmentation) or `TASK[@HAYSTACK]:LENGTH:SAMPLE:SAMPLES` (the prompt
`benchmarks/quality.py` builds for that sample of a grid of SAMPLES, seed 0, surprise alone "S",
as its emllm-S). One JSON line an item: the scores, the answers and each answer's seconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time

from benchmarks import git_commit


def _prompt(item: str, tok, profile):
    """(document, question, tokens to generate, stop ids, scorer, profile) of an item."""
    from emllm.evals import passkey, ruler

    kind, *rest = item.split(":")
    if len(rest) != (2 if kind == "passkey" else 3):
        raise ValueError("expected passkey:LENGTH:DEPTH or TASK[@HAYSTACK]:LENGTH:SAMPLE:SAMPLES")
    length, *rest = rest
    n = passkey.parse_length(length)
    if kind == "passkey":
        (depth,) = rest
        p = passkey.build_prompt(tok, n, float(depth), random.Random(f"0/{n}/{float(depth)}"))
        return p.document, p.question, 10, passkey._stop_ids, (lambda s: float(passkey.score(s, p.key))), profile
    task, _, haystack = kind.partition("@")
    i, samples = int(rest[0]), int(rest[1])
    depth = round((i + 0.5) / samples, 4)  # (as quality.py places sample i of a grid)
    p = ruler.build_prompt(task, tok, n, depth, random.Random(f"0/{task}/{n}/{i}"), haystack or None)
    return (p.document, p.question, p.max_new_tokens, ruler._stop_ids, (lambda s: ruler.score(s, p.answers)),
            profile.replace(segmentation="S"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("items", nargs="+", help="passkey:LENGTH:DEPTH or TASK[@HAYSTACK]:LENGTH:SAMPLE:SAMPLES")
    ap.add_argument("--model", "-m", default="qwen2.5-coder-0.5b")
    ap.add_argument("--out", help="JSON lines, appended (default: stdout only)")
    a = ap.parse_args()

    from emllm import models
    from emllm.engine.stream import Engine

    src = models.resolve(a.model, log=lambda s: print(s, file=sys.stderr))
    model, tok = models.load(src)
    for item in a.items:
        try:
            document, question, n_new, stop_ids, grade, prof = _prompt(item, tok, src.profile)
        except (ValueError, KeyError) as e:
            ap.error(f"{item!r}: {e}")
        t0 = time.perf_counter()
        eng = Engine(model, prof.replace(answer_retrieval="token"))
        eng.feed(document)
        eng.begin_question()
        eng.feed(question)
        read_s = time.perf_counter() - t0
        other = copy.deepcopy(eng, memo={id(model): model})  # (the weights shared)
        other.profile = other.profile.replace(answer_retrieval="question")
        stops = set(stop_ids(tok, model))
        row = {"item": item, "model": src.name, "git": git_commit(), "read_s": round(read_s, 1),
               "score": {}, "answer": {}, "seconds": {}}
        for way, e in (("token", eng), ("question", other)):
            t1 = time.perf_counter()
            text = tok.decode(e.generate(n_new, stop_ids=stops), skip_special_tokens=True)
            row["seconds"][way] = round(time.perf_counter() - t1, 2)
            row["score"][way], row["answer"][way] = grade(text), text[:200]
        del eng, other
        line = json.dumps(row)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
