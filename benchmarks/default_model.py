"""Which embedded model answers: the candidates side by side on the same questions, in one run.

    python -m benchmarks.default_model [--models smollm2,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b] [--out FILE]

For each model: the README's quick start (docs/store-format.md, its question), and a document
nobody here wrote (Python's licence and history, then transformers' Apache licence: ~6k tokens,
past every candidate's window) with questions whose answers it states. Each question is asked as
`emllm ask` answers (the re-read) and as emllm reads itself (`--no-reread`), greedy (`--ways`
adds the re-read as it chose its passages before a change: `benchmarks.code_base.WAYS`). Printed per
model: answers right, ingest tokens/s, the first answer token's time and seconds per answer token
(the licence store, emllm's own reading), the installed packages' and converted folder's sizes.
The conversation benchmark and the RULER-style tasks are their own scripts
(`benchmarks.long_conversation`, `benchmarks.quality`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.code_base import WAYS, parse_ways
from emllm import models
from emllm.app.api import create
from emllm.app.ask import Session
from emllm.embedded import EMBEDDED
from emllm.evals.corpus import SNAPSHOT as CORPUS_TEXT

ROOT = Path(__file__).resolve().parent.parent
README_DOC = ROOT / "docs" / "store-format.md"
README_Q = ("What does a crash in the middle of an ingest leave behind?", ("last commit",))
LICENCE_QS = [  # (question, any of these in the answer counts as right; case-insensitive unless in capitals)
    ("Who created Python?", ("guido",)),
    ("Python was created as a successor of which language?", ("abc",)),
    ("In which town was CNRI, where Guido continued his work on Python in 1995?", ("reston",)),
    ("In what year was the Python Software Foundation formed?", ("2001",)),
    ("Which company did the PythonLabs team move to in October 2000?", ("digital creations", "zope")),  # it became Zope
    ("Under the Apache License, what is the name of the text file whose attribution notices a "
     "redistribution must include?", ("NOTICE",)),  # capitals: "notices" restates the question
]


def _folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def install_bytes(key: str) -> int:
    total = 0
    for mod, _ in EMBEDDED[key].parts:
        spec = importlib.util.find_spec(mod)
        if spec is not None and spec.origin:
            total += _folder_bytes(Path(spec.origin).parent)
    return total


def ask(mem, question: str, reread: bool, n: int) -> tuple[str, float, float]:
    """(answer, seconds to the first token, seconds per later token)."""
    s = Session(mem.store, mem.model, mem.tokenizer, reread=reread)
    t0 = time.perf_counter()
    ids, first = [], None
    for t in s.answer(question, n):
        if first is None:
            first = time.perf_counter() - t0
        ids.append(t)
    per = (time.perf_counter() - t0 - first) / max(1, len(ids) - 1) if ids else float("nan")
    return mem.tokenizer.decode(ids, skip_special_tokens=True).strip(), first or float("nan"), per


def right(answer: str, expect: tuple[str, ...]) -> bool:
    return any(e in answer if e != e.lower() else e in answer.lower() for e in expect)


def run_model(key: str, work: Path, n: int, profile: str | None = None, ways: list[str] | None = None) -> dict:
    ways = ways or ["reread", "own"]
    out: dict = {"model": key, "profile": profile, "ways": ways, "install_mb": install_bytes(key) / 2**20}
    out["converted_mb"] = _folder_bytes(models.resolve(key).path) / 2**20
    licence = (CORPUS_TEXT / "LICENSE-python.txt").read_text() + "\n\n" + (CORPUS_TEXT / "LICENSE-transformers.txt").read_text()
    docs = {"readme": (README_DOC.name, README_DOC.read_text(), [README_Q]),
            "licence": ("licences.txt", licence, LICENCE_QS)}
    for tag, (name, text, qs) in docs.items():
        path = work / f"{key}-{tag}"
        shutil.rmtree(path, ignore_errors=True)
        with create(path, model=key, profile=profile) as mem:
            t0 = time.perf_counter()
            tokens = mem.ingest((name, text)).summary["tokens"]
            out[f"{tag}_tokens"], out[f"{tag}_ingest_tok_s"] = tokens, tokens / (time.perf_counter() - t0)
            for way in ways:
                rows = []
                for q, expect in qs:
                    with WAYS.get(way, contextlib.nullcontext)():
                        a, first, per = ask(mem, q, way != "own", n)
                    rows.append({"q": q, "answer": a, "right": right(a, expect), "first_s": first, "per_token_s": per})
                    print(f"  [{key} {tag} {way}] {'RIGHT' if rows[-1]['right'] else 'wrong'}  {q}\n      -> {a[:160]!r}", flush=True)
                out[f"{tag}_{way}"] = rows
        shutil.rmtree(path, ignore_errors=True)
    own = out["licence_own"]
    out["first_token_s"] = sorted(r["first_s"] for r in own)[len(own) // 2]
    out["decode_s_per_token"] = sorted(r["per_token_s"] for r in own)[len(own) // 2]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--max-new-tokens", "-n", type=int, default=48)
    ap.add_argument("--profile", "-p", help="a profile for every model instead of its own (a built-in name or a .yaml)")
    ap.add_argument("--ways", default="reread,own", help="ways to answer each question, comma-separated: those of "
                    "benchmarks.code_base.WAYS (reread: today's) and own (--no-reread); reread and own are always asked")
    ap.add_argument("--out", help="append the results as one JSON line per model")
    ap.add_argument("--rescore", metavar="FILE", help="print the table of an earlier --out file, scored by today's checks")
    a = ap.parse_args()
    if a.rescore:
        results = [json.loads(line) for line in open(a.rescore)]
        for r in results:
            for key in ("readme_reread", "readme_own", "licence_reread", "licence_own"):
                qs = dict([README_Q] if key.startswith("readme") else LICENCE_QS)
                for x in r[key]:
                    x["right"] = right(x["answer"], qs[x["q"]])
        table(results)
        return
    torch.manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory(prefix="emllm-default-") as work:
        for key in a.models.split(","):
            results.append(run_model(key, Path(work), a.max_new_tokens, a.profile,
                                     ["reread", "own", *(w for w in parse_ways(a.ways) if w not in ("reread", "own"))]))
    table(results)
    if a.out:
        with open(a.out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")


def table(results: list[dict]) -> None:
    print(f"\n{'model':<40}{'readme':>8}{'licence':>10}{'ingest tok/s':>14}{'first tok s':>12}{'s/token':>9}"
          f"{'install MB':>11}{'converted MB':>13}")
    for r in results:
        rd = sum(x["right"] for x in r["readme_reread"]), sum(x["right"] for x in r["readme_own"])
        lc = sum(x["right"] for x in r["licence_reread"]), sum(x["right"] for x in r["licence_own"])
        prof = r.get("profile") or ""
        prof = Path(prof).stem if prof.endswith((".yaml", ".yml")) else prof
        print(f"{r['model'] + (' ' + prof if prof else ''):<40}{f'{rd[0]}/{rd[1]}':>8}{f'{lc[0]}/{lc[1]} of {len(LICENCE_QS)}':>10}"
              f"{r['licence_ingest_tok_s']:>14.0f}{r['first_token_s']:>12.2f}{r['decode_s_per_token']:>9.3f}"
              f"{r['install_mb']:>11.0f}{r['converted_mb']:>13.0f}")
    print("(right answers: re-read / emllm's own reading)")
    for r in results:
        for way in [w for w in r.get("ways", ()) if w not in ("reread", "own")]:
            print(f"{r['model']}, {way}: readme {sum(x['right'] for x in r['readme_' + way])}, "
                  f"licence {sum(x['right'] for x in r['licence_' + way])} of {len(LICENCE_QS)}")


if __name__ == "__main__":
    main()
