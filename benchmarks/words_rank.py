"""Where the re-read's words rank the passages that hold the answer, no model run: BM25
(`memory.passages.lexical_scores`) over the question's token ids alone (`ids`), over the ids and
their consecutive pairs (`ids_and_pairs`), over words and their pairs (`words_and_pairs`:
tokens blind to case and the spaces around them), and over stemmed words and their pairs
(`stems_and_pairs`, the re-read's way: `app.reread.word_ids`, "leaves" is "leave"). The re-read
reads the words' `WORDS_TOP` best beside the layers' votes
(`app.reread.context_from_votes`), so what counts is whether an answer's passage is among them.

    python -m benchmarks.words_rank [--lengths 64k,128k] [--haystacks essay,prose,code,chat] [--folder core]

RULER-style prompts (`evals.ruler`, the four tasks of docs/benchmarks.md's answers, `--samples` of
each at spread depths, the model's tokenizer and passages as its profile cuts them): each target
needle's best passage rank. A folder (`--folder`, read as `emllm ingest FOLDER` streams it) with
`--questions` ("which file defines X?"): the rank of the passage holding `class X` or `def X`.
Prints one JSON line per haystack and length, and one for the folder: targets in the words' top
`WORDS_TOP`, first, and their mean rank, each way.

`--answers N` also answers the first N prompts of each task (of each haystack and length) with
the model, greedy, re-read each way from one read of the prompt (the same layers' votes): the
passages each way reads, whether they differ, and the RULER score of each answer (another answer
only where the passages differ). Slow: a read of every prompt.

    python -m benchmarks.words_rank --answers 2 --lengths 16k --haystacks essay,code --folder ""
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
from pathlib import Path

import torch

from benchmarks.code_base import QUESTIONS, ids_only, token_words, unstemmed
from emllm.app import reread as rr
from emllm.app.reread import WORDS_TOP, passage_spans, reread_room

TASKS = ("niah_single_words", "niah_multikey", "niah_multivalue", "vt")
# each way: the re-read's words as it scored them then (benchmarks.code_base's patches of `app.reread`)
WAYS = {"ids": ids_only, "ids_and_pairs": token_words, "words_and_pairs": unstemmed,
        "stems_and_pairs": contextlib.nullcontext}


def ranks(tok, stream: torch.Tensor, spans: list[tuple[int, int]], question: list[int], targets: list[list[int]]) -> dict:
    """Each way's best rank (0 first) of each target's passages (`targets`: passage indices each;
    None for a target in no passage: in the initial tokens, which a re-read always reads)."""
    out = {}
    for way, patched in WAYS.items():
        with patched():  # (as `context_from_votes` scores them)
            words, asked = rr.word_ids(tok, stream, question)
            scores = rr.lexical_scores(words, spans, asked)
        order = torch.sort(-scores, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))
        out[way] = [int(rank[t].min()) if t else None for t in targets]
    return out


def summary(found: dict[str, list[int | None]]) -> dict:
    """Each way: targets in the words' top WORDS_TOP, first, their mean rank, of how many ranked;
    and how many sat in the initial tokens (no rank)."""
    out: dict = {}
    for way, all_ranks in found.items():
        rs = [r for r in all_ranks if r is not None]
        out[way] = {f"top{WORDS_TOP}": sum(r < WORDS_TOP for r in rs), "first": sum(r == 0 for r in rs),
                    "mean_rank": round(sum(rs) / max(len(rs), 1), 1), "of": len(rs)}
        out["in_initial_tokens"] = len(all_ranks) - len(rs)
    return out


def ruler_ranks(tok, profile, length: int, haystack: str | None, samples: int) -> dict:
    from emllm.evals.ruler import build_prompt

    found: dict[str, list[int]] = {w: [] for w in WAYS}
    for task in TASKS:
        for i in range(samples):
            pr = build_prompt(task, tok, length, (i + 0.5) / samples, random.Random(i), haystack)
            stream = torch.tensor(pr.document)
            room = reread_room(profile, len(stream), len(pr.question))
            spans = passage_spans(tok, stream, min(profile.n_init, len(stream)), room)
            targets = [[j for j, (a, b) in enumerate(spans) if a < pr.needles[t][1] and b > pr.needles[t][0]]
                       for t in pr.targets]
            for way, rs in ranks(tok, stream, spans, pr.question, targets).items():
                found[way] += rs
    return found


def ruler_answers(model, tok, profile, length: int, haystack: str | None, n: int) -> list[dict]:
    """The re-read's answer each way to the first `n` prompts of each task (`--answers`)."""
    from emllm.engine.stream import Engine
    from emllm.evals.ruler import build_prompt, score
    from emllm.models import stop_token_ids

    rows = []
    for task in TASKS:
        for i in range(n):
            pr = build_prompt(task, tok, length, (i + 0.5) / n, random.Random(i), haystack)
            eng = Engine(model, profile)
            eng.feed(pr.document)
            rec = rr.SelectionRecorder(eng)
            try:
                eng.begin_question()
                eng.feed(pr.question)
            finally:
                rec.detach()
            m = len(pr.document)
            room = rr.reread_room(profile, m, len(pr.question))
            row: dict = {"task": task, "haystack": haystack, "length": length, "depth": (i + 0.5) / n}
            answers: dict[tuple, str] = {}
            for way, patched in WAYS.items():
                with patched():
                    ctx = rr.reread_context(eng, rec.votes(), tok, m, room, pr.question)
                key = tuple(ctx.ids)
                if key not in answers:  # (the same context, the same greedy answer)
                    reader = rr.read_again(model, profile, ctx.ids, pr.question, pr.max_new_tokens)
                    out = reader.generate(pr.max_new_tokens, stop_ids=set(stop_token_ids(tok, model)))
                    answers[key] = tok.decode(out, skip_special_tokens=True)
                row[way] = {"score": score(answers[key], pr.answers), "answer": answers[key],
                            "passages": [list(p) for p in ctx.passages]}
            row["same_context"] = len(answers) == 1
            rows.append(row)
    return rows


def folder_ranks(tok, profile, folder: Path, questions: Path) -> dict:
    import emllm
    from emllm.app.stream import SEPARATOR, StreamFormat, encode_framing

    # the files ingest reads, each after its naming line (binary and empty ones left out)
    text = SEPARATOR.join("".join(src.pieces()) for _, src in emllm.open_documents([str(folder)]))
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    stream, offsets = torch.tensor(enc["input_ids"]), enc["offset_mapping"]
    suffix = encode_framing(tok, StreamFormat.for_tokenizer(tok, True).suffix)
    found: dict[str, list[int]] = {w: [] for w in WAYS}
    cut: dict[int, tuple[list, list[str]]] = {}  # room -> (passages, their texts): cut once
    for line in questions.read_text().splitlines():
        q = line.split("\t")[0]
        m = re.search(r"(class|function) (\w+)", q)
        if not m:
            continue  # (a constant's question: no definition to find)
        pattern = ("class " if m[1] == "class" else "def ") + m[2]
        question = tok(SEPARATOR + q, add_special_tokens=False)["input_ids"] + suffix
        room = reread_room(profile, len(stream), len(question))
        if room not in cut:
            spans = passage_spans(tok, stream, profile.n_init, room)
            cut[room] = spans, [text[offsets[s][0] : offsets[e - 1][1]] for s, e in spans]
        spans, texts = cut[room]
        defines = [i for i, t in enumerate(texts) if pattern in t]
        for way, rs in ranks(tok, stream, spans, question, [defines]).items():
            found[way] += rs
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b", help="whose tokenizer and profile")
    ap.add_argument("--lengths", default="64k,128k")
    ap.add_argument("--haystacks", default="essay,prose,code,chat", help="RULER's essay or the project's corpora (evals.ruler)")
    ap.add_argument("--samples", type=int, default=6, help="prompts of each task")
    ap.add_argument("--folder", default="core", help="a folder to ask 'which file defines X?' of ('' for none)")
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("--answers", type=int, default=0, help="also answer the first N prompts of each task with the model")
    ap.add_argument("--dtype", default=None, help="the model's compute dtype for --answers (default: its profile's)")
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from emllm import models
    from emllm.evals.passkey import parse_length

    src = models.resolve(a.model)
    tok, profile = AutoTokenizer.from_pretrained(src.path), src.profile
    model = models.load(src, dtype=a.dtype)[0] if a.answers else None
    for length in (parse_length(x) for x in a.lengths.split(",")):
        for hay in a.haystacks.split(","):
            found = ruler_ranks(tok, profile, length, hay, a.samples)
            print(json.dumps({"haystack": hay, "length": length, **summary(found)}), flush=True)
            if model is not None:
                rows = ruler_answers(model, tok, profile, length, hay, a.answers)
                for row in rows:
                    print(json.dumps(row), flush=True)
                print(json.dumps({"haystack": hay, "length": length, "answers": len(rows),
                                  "same_context": sum(r["same_context"] for r in rows),
                                  "score": {w: round(100 * sum(r[w]["score"] for r in rows) / len(rows), 1) for w in WAYS}}),
                      flush=True)
    if a.folder:
        print(json.dumps({"folder": a.folder, **summary(folder_ranks(tok, profile, Path(a.folder), Path(a.questions)))}))


if __name__ == "__main__":
    main()
