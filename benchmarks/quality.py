"""RULER-style quality grid: emllm (segmentations S, SM, F; "emllm-S-reread": S, answered by
re-reading the passages its layers chose, core/app/reread.py) against the plain model truncated
from the left to its context and a retrieval-augmented baseline (core/evals/rag.py); "oracle" is
the plain model given the asked needles alone (can the model read the task at all?).

    python benchmarks/quality.py --lengths 8k --samples 2 --out docs/results/quality.jsonl
    python benchmarks/quality.py --dtype bfloat16 --formats bfloat16,int8,int4 --methods emllm-S ...

--formats adds, for each store format, emllm-S with its memory in a scratch store of that
format (method "emllm-S-int4", ...): the formats' quality against each other on the same prompts.

For every task × length × sample one prompt (seeded by seed/task/length/sample; the needle depth
spread evenly over the samples: (i + 0.5) / samples) is answered by every method; one JSON line per
answer is appended to --out as it finishes, then a markdown table of the mean score (RULER
string_match_all, in %) per task × length × method is printed (`--table FILE`: the table of every
answer in a results file, all runs together). emllm-S and emllm-S-reread asked together share one
read (their rows say read_shared; each one's seconds: the read and its own answer). A long prompt is slow to read on a CPU: --resume
skips the answers --out has already from runs of the same grid (model, profile, seed, RAG settings)
and asks the rest, so a killed run loses at most the answer under way.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, benchmarks/ is not a package on the path
from benchmarks import git_commit, machine  # noqa: E402
from emllm import models
from emllm.evals import results_log
from emllm.engine.stream import Engine
from emllm.evals.passkey import parse_length, run_baseline
from emllm.evals.rag import run_rag
from emllm.evals.ruler import HAYSTACKS, TASKS, build_prompt, needle_only, run_task, run_task_both

METHODS = ("emllm-S", "emllm-SM", "emllm-F", "emllm-S-reread", "baseline", "rag", "oracle")


def _order(cell: tuple[str, int]) -> tuple:
    """Table rows: tasks in TASKS order (a task on another haystack, "vt (prose)", after its own), then length."""
    task = cell[0].split(" (")[0]
    return (list(TASKS).index(task) if task in TASKS else 99, cell[0], cell[1])


def table(rows: list[dict], methods: list[str]) -> str:
    acc: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        acc[(r["task"], r["length"], r["method"])].append(r["score"])
    cells = sorted({(t, n) for t, n, _ in acc}, key=_order)
    out = ["| task | length | " + " | ".join(methods) + " |", "|---|---:|" + "---:|" * len(methods)]
    for t, n in cells:
        vals = []
        for m in methods:
            v = acc.get((t, n, m))
            vals.append(f"{100 * sum(v) / len(v):.0f} ({len(v)})" if v else "–")
        out.append(f"| {t} | {n} | " + " | ".join(vals) + " |")
    # The mean only over prompts every method answered: cells with more samples for some methods
    # (a run stopped midway) would otherwise weigh differently per method.
    by_prompt: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in rows:
        by_prompt[(r["task"], r["length"], r["sample"], r["depth"])][r["method"]] = r["score"]
    full = [d for d in by_prompt.values() if all(m in d for m in methods)]
    means = [f"{100 * sum(d[m] for d in full) / len(full):.0f}" if full else "–" for m in methods]
    out.append(f"| **mean over the {len(full)} prompts all answered** | | " + " | ".join(means) + " |")
    return "\n".join(out)


def parse_variant(text: str, base):
    """'NAME=key:value,key:value' -> (NAME, base with those profile keys changed; values as YAML)."""
    import yaml

    name, _, changes = text.partition("=")
    if not name or not changes:
        raise SystemExit(f"--variant {text!r}: expected NAME=KEY:VALUE[,KEY:VALUE]")
    kw = {}
    for part in changes.split(","):
        key, _, value = part.partition(":")
        kw[key.strip()] = yaml.safe_load(value)
    return name, base.replace(**kw)


def recall_fields(found: list) -> dict:
    """An emllm answer's recall of the asked needles (evals.recall): per needle where it was and
    how many layers held it at the question, with ranks per layer; `retrieved`: every asked needle
    was in the window/initial tokens or held by at least half the layers; `needle_whole`: the share
    of layers that held every event of the needle (its key and its value, where boundaries split them)."""
    return {"recall": [r.as_dict() for r in found],
            "needle_layers": round(sum(r.share for r in found) / len(found), 4) if found else None,
            "needle_whole": round(sum(r.whole / r.of for r in found) / len(found), 4) if found else None,
            "retrieved": all(r.share >= 0.5 for r in found)}


def rag_recall(tok, prompt, chunk_tokens: int, budget: int) -> dict:
    """The retrieval baseline's view of the asked needles at emllm's retrieval budget (n_mem tokens
    per layer): each needle's chunk rank, and whether it is among the best chunks that fit."""
    from emllm.evals.rag import build_context, load_embedder
    from emllm.evals.recall import chunk_recall

    rc = build_context(tok, load_embedder(), prompt.document, prompt.question, prompt.query, prompt.head,
                       budget=1 << 40, chunk_tokens=chunk_tokens)  # every chunk, ranked
    got = [chunk_recall(rc.ranked, rc.spans, prompt.needles[j], budget) for j in prompt.targets]
    return {"rag_ranks": [r for r, _ in got], "rag_recall_at_n_mem": round(sum(h for _, h in got) / len(got), 4)}


def recall_table(rows: list[dict], methods: list[str]) -> str:
    """Per task x length x method: emllm's share of layers holding the asked needles at the question
    (and answers: correct / retrieved but misread / not retrieved; where recorded, the share of
    layers that held every event of the needle, "whole"), the baseline's chunk recall at the same
    budget (n_mem tokens)."""
    acc: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        acc[(r["task"], r["length"], r["method"])].append(r)
    cells = sorted({(t, n) for t, n, _ in acc}, key=_order)
    shown = [m for m in methods if m.startswith("emllm") or m == "rag"]
    out = ["| task | length | " + " | ".join(shown) + " |", "|---|---:|" + "---:|" * len(shown)]
    for t, n in cells:
        vals = []
        for m in shown:
            rs = acc.get((t, n, m), [])
            if m == "rag":
                v = [r["rag_recall_at_n_mem"] for r in rs if "rag_recall_at_n_mem" in r]
                vals.append(f"{100 * sum(v) / len(v):.0f}%" if v else "–")
                continue
            rs = [r for r in rs if r.get("needle_layers") is not None]
            if not rs:
                vals.append("–")
                continue
            share = 100 * sum(r["needle_layers"] for r in rs) / len(rs)
            ok = sum(r["score"] == 1 for r in rs)
            misread = sum(r["score"] < 1 and r["retrieved"] for r in rs)
            w = [r["needle_whole"] for r in rs if r.get("needle_whole") is not None]
            whole = f"{100 * sum(w) / len(w):.0f}% whole; " if len(w) == len(rs) else ""
            vals.append(f"{share:.0f}% ({whole}{ok} right, {misread} misread, {len(rs) - ok - misread} not retrieved)")
        out.append(f"| {t} | {n} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def recall_pooled(rows: list[dict], methods: list[str]) -> str:
    """Per haystack x length x method, every asked needle counted once (a task of five needles
    weighs five times a single needle's, where `recall_table` averages per task): emllm's mean
    share of layers holding a needle, and the share of needles held by at least half the layers
    (a needle in the window or the initial tokens counts as held by all); the baseline's share of
    needles whose chunk is among the best that fit in n_mem tokens."""
    acc: dict[tuple, list[float]] = defaultdict(list)  # (haystack, length, method) -> per-needle shares
    for r in rows:
        hay = r["task"].split(" (")[1].rstrip(")") if " (" in r["task"] else "ruler"
        key = (hay, r["length"], r["method"])
        if r["method"] == "rag" and "rag_ranks" in r:
            n = len(r["rag_ranks"])
            hits = round(r["rag_recall_at_n_mem"] * n)
            acc[key] += [1.0] * hits + [0.0] * (n - hits)
        elif r["method"].startswith("emllm") and r.get("recall"):
            acc[key] += [1.0 if x["where"] != "memory" else x["layers"] / x["of"] for x in r["recall"]]
    shown = [m for m in methods if m.startswith("emllm") or m == "rag"]
    cells = sorted({(h, n) for h, n, _ in acc})
    out = ["| haystack | length | " + " | ".join(shown) + " |", "|---|---:|" + "---:|" * len(shown)]
    for h, n in cells:
        vals = []
        for m in shown:
            v = acc.get((h, n, m), [])
            if not v:
                vals.append("–")
            elif m == "rag":
                vals.append(f"{100 * sum(v) / len(v):.1f}% of {len(v)}")
            else:
                half = sum(x >= 0.5 for x in v)
                vals.append(f"{100 * sum(v) / len(v):.1f}%, {half} of {len(v)} by half the layers")
        out.append(f"| {h} | {n} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="smollm2")
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of: {', '.join(TASKS)}")
    ap.add_argument("--lengths", default="8k,32k,128k")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--first-sample", type=int, default=0, help="extend an earlier grid without repeating a prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of: {', '.join(METHODS)}")
    ap.add_argument("--rag-chunk", type=int, default=128, help="RAG chunk size in tokens")
    ap.add_argument("--rag-k", type=int, default=None, help="RAG chunks kept (default: as many as fit)")
    ap.add_argument("--rag-budget", type=int, default=None,
                    help="RAG prompt tokens (default: the model's context); e.g. n_local + n_mem to match emllm's attention")
    ap.add_argument("--dtype", default=None, help="compute dtype (auto, float32, bfloat16; default: the profile's)")
    ap.add_argument("--formats", default="", help="store formats to run emllm-S on, comma-separated (float32, bfloat16, int8, int4)")
    ap.add_argument("--haystack", default=None, choices=HAYSTACKS,
                    help="one haystack for every task instead of each task's own (prose, code: real text)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY:VALUE[,KEY:VALUE]",
                    help="emllm-S with these profile keys changed, as method emllm-S-NAME (repeatable), "
                         "e.g. c1=query_centering:1 or n=repr_normalise:true")
    ap.add_argument("--store-dir", default=None, help="where --formats' scratch stores go (default: a temporary folder here)")
    ap.add_argument("--out", help="JSON lines, appended (required unless --table)")
    ap.add_argument("--resume", action="store_true",
                    help="skip the answers --out has from runs of the same grid (model, profile, seed, RAG settings)")
    ap.add_argument("--table", metavar="FILE", nargs="+",
                    help="only print the tables of every answer in these results files (e.g. emllm's and the baseline's runs of the same prompts); a prompt a method answered more than once counts its last answer")
    a = ap.parse_args()
    if a.table:
        rows = [r for f in a.table for r in results_log.records(f) if "task" in r]  # skips a line a kill cut short
        # a prompt answered twice by one method (a grid run again) counts once: its last answer
        rows = list({(r["task"], r["length"], r["sample"], r["depth"], r["method"], r.get("prompt")): r
                     for r in rows}.values())
        names = list(METHODS) + sorted({r["method"] for r in rows} - set(METHODS))
        shown = [m for m in names if any(r["method"] == m for r in rows)]
        print(table(rows, shown))
        if any("needle_layers" in r for r in rows):
            print("\nRecall: share of layers holding the asked needles at the question; rag: chunk recall at n_mem tokens\n")
            print(recall_table(rows, shown))
            print("\nRecall per needle, pooled: emllm's mean share of layers and needles held by half the layers; rag: needles in budget\n")
            print(recall_pooled(rows, shown))
        return
    if not a.out:
        ap.error("--out is required")
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    for t in tasks:
        if t not in TASKS:
            ap.error(f"unknown task {t!r}: one of {', '.join(TASKS)}")
    for m in methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}: one of {', '.join(METHODS)}")
    lengths = [parse_length(x) for x in a.lengths.split(",")]
    src = models.resolve(a.model, log=lambda s: print(s, file=sys.stderr))
    model, tok = models.load(src, dtype=a.dtype)
    factories = {f"emllm-{s}": (lambda s=s: Engine(model, src.profile.replace(segmentation=s))) for s in ("S", "SM", "F")}
    # answered by re-reading the passages chosen (app.reread)
    factories["emllm-S-reread"] = factories["emllm-S"]
    import tempfile

    from emllm.evals.scratch import ScratchStores
    from emllm.memory.quant import FORMATS

    for v in a.variant:
        name, prof = parse_variant(v, src.profile.replace(segmentation="S"))
        factories[f"emllm-S-{name}"] = lambda prof=prof: Engine(model, prof)
        methods.append(f"emllm-S-{name}")
    if a.store_dir:
        Path(a.store_dir).mkdir(parents=True, exist_ok=True)
    scratch_root = tempfile.TemporaryDirectory(dir=a.store_dir or Path.cwd())
    for f in formats:
        if f not in FORMATS:
            ap.error(f"unknown format {f!r}: one of {', '.join(FORMATS)}")
        factories[f"emllm-S-{f}"] = ScratchStores(model, tok, src.profile, Path(scratch_root.name) / f, kv_format=f)
        methods.append(f"emllm-S-{f}")
    grid = {"model": src.name, "profile": asdict(src.profile), "seed": a.seed,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "rag": {"chunk": a.rag_chunk, "k": a.rag_k, "budget": a.rag_budget},
            **({"haystack": a.haystack} if a.haystack else {})}
    # A row's task names its haystack ("vt (prose)"), so the rows of this grid on any haystack can be
    # pooled: older rows, written without their run's id beside a run of another haystack, are found too.
    base = {k: v for k, v in grid.items() if k != "haystack"}
    pooled = [{**base, **({"haystack": h} if h else {})} for h in (None, *HAYSTACKS)]
    done = {(r["task"], r["length"], r["sample"], r["depth"], r["method"]): r
            for g in pooled for r in results_log.results_of(a.out, g)} if a.resume else {}
    if done:
        print(f"resuming: {len(done)} answers of this grid in {a.out} already", file=sys.stderr, flush=True)
    run_id = results_log.start_run(a.out, grid, machine=machine(),
                          device=str(next(model.parameters()).device), threads=torch.get_num_threads(),
                          git=git_commit(), argv=sys.argv)
    rows = []
    # samples outside tasks: a grid stopped part way (they take hours at 128k) has every task's first prompt
    for length in lengths:
        for i in range(a.first_sample, a.first_sample + a.samples):
            for task in tasks:
                name = task if a.haystack is None else f"{task} ({a.haystack})"  # as its rows record it
                depth = round((i - a.first_sample + 0.5) / a.samples, 4)
                todo = [m for m in methods if (name, length, i, depth, m) not in done]
                rows += [done[(name, length, i, depth, m)] for m in methods if m not in todo]
                if not todo:
                    continue
                prompt = build_prompt(task, tok, length, depth, random.Random(f"{a.seed}/{task}/{length}/{i}"), a.haystack)
                shared: dict[str, tuple[str, float, dict]] = {}
                if "emllm-S" in todo and "emllm-S-reread" in todo:
                    # one read answers both ways (each answer as its own run's: run_task_both)
                    found: list = []
                    both = run_task_both(factories["emllm-S"], tok, prompt, recall=found)
                    extra = {**recall_fields([found[j] for j in prompt.targets]), "read_shared": True}
                    shared["emllm-S"] = both.own, both.read_s + both.own_s, extra
                    shared["emllm-S-reread"] = both.reread, both.read_s + both.reread_s, extra
                for m in todo:
                    t0 = time.perf_counter()
                    extra = {}
                    if m in shared:
                        answer, seconds, extra = shared[m]
                    elif m in factories:
                        found = []
                        answer = run_task(factories[m], tok, prompt, recall=found, reread=m == "emllm-S-reread")
                        extra = recall_fields([found[j] for j in prompt.targets])
                    elif m == "baseline":
                        answer = run_baseline(model, tok, prompt, max_new_tokens=prompt.max_new_tokens)
                    elif m == "oracle":  # the plain model given the asked needles alone: can it read the task?
                        answer = run_baseline(model, tok, needle_only(prompt), max_new_tokens=prompt.max_new_tokens)
                    else:
                        answer, rc = run_rag(model, tok, prompt, chunk_tokens=a.rag_chunk, k=a.rag_k, budget=a.rag_budget)
                        hit = [any(s <= prompt.needles[j][0] < e for s, e in rc.spans) for j in prompt.targets]
                        extra = {"rag_chunks": len(rc.spans), "rag_of": rc.n_chunks, "rag_needles_found": sum(hit),
                                 "rag_tokens": len(rc.ids),
                                 **rag_recall(tok, prompt, a.rag_chunk, src.profile.n_mem)}
                    if m not in shared:
                        seconds = time.perf_counter() - t0
                    r = {"task": name, "length": length, "sample": i, "depth": depth, "method": m,
                         "answers": prompt.answers, "answer": answer.strip(), "score": prompt.score(answer),
                         "seconds": round(seconds, 2),
                         "tokens": len(prompt.document) + len(prompt.question), "prompt": prompt.digest, **extra}
                    rows.append(r)
                    results_log.append(a.out, r, run=run_id)
                    print(f"{task:20} {length:>7} #{i} d{depth:.2f} {m:9} {100 * r['score']:3.0f}% {r['answer'][:60]!r} "
                          f"(want {','.join(prompt.answers)[:40]}, {r['seconds']:.0f} s)", file=sys.stderr, flush=True)
    for f in factories.values():
        if isinstance(f, ScratchStores):
            f.close()
    scratch_root.cleanup()
    print(table(rows, methods))
    print("\nRecall: share of layers holding the asked needles at the question; rag: chunk recall at n_mem tokens\n")
    print(recall_table(rows, methods))


if __name__ == "__main__":
    main()
