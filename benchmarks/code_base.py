"""Questions about a code base read from its folder (`emllm ingest FOLDER`), side by side in one
run: each asked as `emllm ask` answers (the re-read, whose passages are read after the lines
naming their files), as the re-read did before its words were blind to case and spaces
(`reread_tokens`: BM25 over the question's token ids and their pairs), before its words counted
the pairs (`reread_ids`: the token ids alone), before those lines (`reread_unnamed`: the same
store and passages, no lines), and as emllm reads itself (`--no-reread`), greedy.

    emllm ingest core --store core-code
    python -m benchmarks.code_base --store core-code --out docs/results/code-base-core.jsonl

The questions (`--questions`, a tab-separated file: question, then what a right answer names)
default to `benchmarks/code_base_questions.tsv`: which file of this project's `core/` defines a
name, and two of its constants. A file (`engine/stream.py`) is named by its path or its module
(`emllm.engine.stream`), whole parts only (`rotated.py` is not `rotated_window.py`); a value, as a
whole word. Prints one JSON line per question and a summary: right answers of each way, seconds
each.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import time
from pathlib import Path

import torch

import emllm
from emllm.app import reread as rr

QUESTIONS = Path(__file__).resolve().parent / "code_base_questions.tsv"
WAYS = ("reread", "reread_tokens", "reread_ids", "reread_unnamed", "own")


def right(answer: str, want: str) -> bool:
    """Whether `answer` names `want`: a file by its path or dotted module, whole parts, the file's
    name last (`manifest.json` is not `manifest.py`); else the value as a whole word
    (case-insensitive)."""
    text = answer.lower()
    if want.endswith(".py"):
        parts = want.lower().removesuffix(".py")
        text = re.sub(r"\.py\b", "", text).replace(".", "/")  # emllm.engine.stream -> emllm/engine/stream
        return re.search(rf"(?<!\w){re.escape(parts)}(?!\w|/\w)", text) is not None
    return re.search(rf"(?<!\w){re.escape(want.lower())}(?!\w)", text) is not None


@contextlib.contextmanager
def token_words():
    """The re-read with its words the question's token ids as they are (" class" is not "class")."""
    saved = rr.word_ids
    rr.word_ids = lambda tok, *seqs: [torch.as_tensor(s, dtype=torch.long).flatten() for s in seqs]
    try:
        yield
    finally:
        rr.word_ids = saved


@contextlib.contextmanager
def ids_only():
    """The re-read with its words' BM25 over the question's token ids alone (as they are, no pairs)."""
    saved = rr.lexical_scores
    rr.lexical_scores = functools.partial(saved, pairs=False)
    try:
        with token_words():
            yield
    finally:
        rr.lexical_scores = saved


@contextlib.contextmanager
def unnamed():
    """The re-read without the lines naming each passage's file (as before they were read)."""
    saved = rr.naming_lines
    rr.naming_lines = lambda spans, named: [() for _ in spans]
    try:
        yield
    finally:
        rr.naming_lines = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="a store ingested from a folder")
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("-n", "--max-new-tokens", type=int, default=40)
    ap.add_argument("--out", help="append the JSON lines to this file too")
    args = ap.parse_args()
    pairs = [line.split("\t") for line in Path(args.questions).read_text().splitlines() if line.strip()]
    score = dict.fromkeys(WAYS, 0)
    seconds = dict.fromkeys(WAYS, 0.0)
    out = open(args.out, "a") if args.out else None  # noqa: SIM115
    with emllm.open(emllm.store_path(args.store)) as mem:
        for question, want in pairs:
            row = {"question": question, "want": want}
            for way in WAYS:
                t0 = time.perf_counter()
                with {"reread_unnamed": unnamed, "reread_ids": ids_only, "reread_tokens": token_words}.get(
                        way, contextlib.nullcontext)():
                    answer = mem.ask(question, args.max_new_tokens, reread=way != "own")
                seconds[way] += time.perf_counter() - t0
                ok = right(answer, want)
                score[way] += ok
                row[way] = {"right": ok, "answer": answer}
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
        summary = {"store": args.store, "tokens": mem.info.rows.tokens, "documents": len(mem.info.documents),
                   "questions": len(pairs), "right": score,
                   "seconds_per_answer": {k: round(v / max(1, len(pairs)), 1) for k, v in seconds.items()}}
    print(json.dumps(summary), flush=True)
    if out:
        out.write(json.dumps(summary) + "\n")
        out.close()


if __name__ == "__main__":
    main()
