"""Questions about a code base read from its folder (`emllm ingest FOLDER`), side by side in one
run: each asked as `emllm ask` answers (the re-read, whose passages are read after the lines
naming their files), as the re-read chose its passages before a change (`--ways`, those of
`WAYS`: by default without stemming the words), and as emllm reads itself
(`own`, `--no-reread`), greedy.

    emllm ingest core --store core-code
    python -m benchmarks.code_base --store core-code --out docs/results/code-base-core.jsonl

The questions (`--questions`, a tab-separated file: question, then what a right answer names)
default to `benchmarks/code_base_questions.tsv`: which file of this project's `core/` defines a
name, and two of its constants. A file (`engine/stream.py`) is named by its path or its module
(`emllm.engine.stream`), whole parts only (`rotated.py` is not `rotated_window.py`); a value, as a
whole word. Prints one JSON line per question and a summary: right answers of each way, seconds
each.

`benchmarks/document_questions.tsv` asks a store of prose the same way: 24 questions in a
reader's own words about `docs/store-format.md` and the licences of Python and transformers,
read into one store:

    emllm ingest docs/store-format.md core/evals/corpus_text/LICENSE-python.txt core/evals/corpus_text/LICENSE-transformers.txt --store docs-qa
    python -m benchmarks.code_base --store docs-qa --questions benchmarks/document_questions.tsv
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import time
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import torch

import emllm
from emllm.app import reread as rr

QUESTIONS = Path(__file__).resolve().parent / "code_base_questions.tsv"
DEFAULT_WAYS = "reread,reread_unstemmed,own"


# The re-read as it chose its passages before a change, to compare ways side by side from one store
# (here, in benchmarks.default_model and benchmarks.words_rank): each a context manager that patches
# `app.reread` while a question is answered.
@contextlib.contextmanager
def _patched(name: str, value: object) -> Iterator[None]:
    saved = getattr(rr, name)
    setattr(rr, name, value)
    try:
        yield
    finally:
        setattr(rr, name, saved)


def unstemmed() -> ContextManager[None]:
    """Words blind to case and spaces but not stemmed."""
    return _patched("word_ids", functools.partial(rr.word_ids, stem=False))


def token_words() -> ContextManager[None]:
    """Words the question's token ids as they are (" class" is not "class")."""
    return _patched("word_ids", lambda tok, *seqs, **_: [torch.as_tensor(s, dtype=torch.long).flatten() for s in seqs])


@contextlib.contextmanager
def ids_only() -> Iterator[None]:
    """BM25 over the question's token ids alone (as they are, no pairs)."""
    with _patched("lexical_scores", functools.partial(rr.lexical_scores, pairs=False)), token_words():
        yield


def unnamed() -> ContextManager[None]:
    """No line naming each passage's file before it."""
    return _patched("naming_lines", lambda spans, named: [() for _ in spans])


WAYS: dict[str, Callable[[], ContextManager[None]]] = {
    "reread": contextlib.nullcontext, "reread_unstemmed": unstemmed,
    "reread_tokens": token_words, "reread_ids": ids_only, "reread_unnamed": unnamed}


def parse_ways(text: str) -> list[str]:
    """A comma-separated list of way names (those of WAYS, and "own": emllm's own reading)."""
    ways = [w for w in text.split(",") if w]
    bad = [w for w in ways if w not in WAYS and w != "own"]
    if bad:
        raise SystemExit(f"unknown way {bad[0]!r}: one of {', '.join([*WAYS, 'own'])}")
    return ways


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="a store ingested from a folder (or from documents, asked --questions about them)")
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("-n", "--max-new-tokens", type=int, default=40)
    ap.add_argument("--ways", default=DEFAULT_WAYS, help="ways to answer each question, comma-separated: reread "
                    "(today's), reread_unstemmed, reread_tokens, reread_ids, reread_unnamed, own (--no-reread)")
    ap.add_argument("--out", help="append the JSON lines to this file too")
    args = ap.parse_args()
    ways = parse_ways(args.ways)
    pairs = [line.split("\t") for line in Path(args.questions).read_text().splitlines() if line.strip()]
    score = dict.fromkeys(ways, 0)
    seconds = dict.fromkeys(ways, 0.0)
    out = open(args.out, "a") if args.out else None  # noqa: SIM115
    with emllm.open(emllm.store_path(args.store)) as mem:
        for question, want in pairs:
            row = {"question": question, "want": want}
            for way in ways:
                t0 = time.perf_counter()
                with WAYS.get(way, contextlib.nullcontext)():
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
