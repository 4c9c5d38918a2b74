"""One long stream: the passkey at 1M tokens (or any length), with the memory in a store on disk.

    python -m benchmarks.million --tokens 1m --depth 0.5 --store /var/tmp/m1 --out docs/results/million.jsonl

The document goes through `emllm ingest`'s own loop (`run_job`: commits every 4 chunks), into a
store that is kept (`--store`; a fresh folder), so `emllm ask --store` can be timed on it later.
The question is then asked as `emllm ask` does: the store reopened read-only, the stream continued
from its last commit.

Reports what issue 8's scale item asks for: tokens/s at the start and at the end of the stream
(over the first and the last 5% of chunks, commits included), peak RSS (VmHWM of this process),
the store's bytes on disk, and whether the answer holds the key. Progress (tokens, tok/s, RSS) is
printed every `--every` chunks, so a run stopped early still tells how far it got and how fast.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from benchmarks import git_commit, machine
from emllm import models
from emllm.app.ask import Session
from emllm.app.ingest import run_job
from emllm.app.stream import create_store, open_engine
from emllm.evals.passkey import build_prompt, parse_length, score
from emllm.store import Store


def vm(key: str) -> int:
    """VmHWM / VmRSS of this process, bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reread_answer(path: Path, model, tok, question: list[int], key: str) -> dict:
    """The answer `emllm ask --reread` gives on the store at `path` (opened afresh, read-only),
    whether it holds `key`, and the seconds from the question to the answer's end."""
    t = time.perf_counter()
    with Store.open(path) as st:
        session = Session(st, model, tok, reread=True)
        answer = tok.decode(list(session.answer_ids(question, 10)), skip_special_tokens=True)
        tokens = sum(e - s for s, e in session.passages)
    return {"reread_answer": answer.strip(), "reread_correct": score(answer, key), "reread_tokens": tokens,
            "reread_seconds": round(time.perf_counter() - t, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="smollm2")
    ap.add_argument("--tokens", default="1m")
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store", required=True, help="new folder for the store (needs ~51 kB per token on SmolLM2)")
    ap.add_argument("--every", type=int, default=100, help="progress line every N chunks")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: the profile's, auto)")
    ap.add_argument("--format", default=None, help="store format (default: the compute dtype)")
    ap.add_argument("--out", required=True, help="JSON lines, appended")
    ap.add_argument("--ask-only", action="store_true", help="only ask the question of a store this script made (same --tokens, --depth, --seed)")
    ap.add_argument("--reread", action="store_true", help="also answer as `emllm ask --reread` does (the store opened again: the same question read against it, the passages it chose read again)")
    a = ap.parse_args()
    commit = git_commit()  # the code this run loads (HEAD may move during an hour-long run)
    src = models.resolve(a.model)
    model, tok = models.load(src, dtype=a.dtype)
    n = parse_length(a.tokens)
    prompt = build_prompt(tok, n, a.depth, random.Random(f"{a.seed}/{n}/{a.depth}/0"))
    cs = src.profile.chunk_size
    times: list[float] = []
    t_start = last = time.perf_counter()

    def progress(p) -> None:
        nonlocal last
        now = time.perf_counter()
        if p.done == len(times) * cs + cs:  # one callback per chunk, then one at the end
            times.append(now - last)
        last = now
        if len(times) % a.every == 0 and p.done < p.total:
            recent = times[-a.every :]
            print(json.dumps({"tokens": p.done, "tok_s_recent": round(cs * len(recent) / sum(recent), 1),
                              "events": p.events, "rss_mib": vm("VmRSS") >> 20, "hwm_mib": vm("VmHWM") >> 20,
                              "elapsed_s": round(now - t_start)}), flush=True)

    path = Path(a.store)
    if a.ask_only:
        with Store.open(path) as st:
            eng = (session := Session(st, model, tok)).engine
            t = time.perf_counter()
            session.read_question_ids(prompt.question)
            answer = tok.decode(eng.generate(10), skip_special_tokens=True)
            row = {"date": time.strftime("%Y-%m-%d %H:%M"), "ask_only": True, "store": str(path),
                   "tokens": st.manifest["rows"]["tokens"], "sketch": bool(st.manifest.get("sketch")), "key": prompt.key,
                   "answer": answer.strip(), "correct": score(answer, prompt.key),
                   "question_seconds": round(time.perf_counter() - t, 2), "commit": commit}
        if a.reread:
            row |= reread_answer(path, model, tok, prompt.question, prompt.key)
        print(json.dumps(row))
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        return
    with create_store(path, src.name, model, tok, src.profile, chat=False, kv_format=a.format) as st:
        st.set_job(torch.tensor(prompt.document, dtype=torch.int32), [{
            "name": f"passkey-{n}-{a.depth}", "sha256": "", "start": 0, "tokens": len(prompt.document), "chars": 0}])
        run_job(st, open_engine(st, model), progress=progress)
    t = time.perf_counter()
    with Store.open(path) as st:  # as `emllm ask`: read-only, from the last commit
        eng = (session := Session(st, model, tok)).engine
        session.read_question_ids(prompt.question)  # the tail short of a chunk, then the question
        out, ttft = [], 0.0
        for i in eng.generate_iter(10):
            ttft = ttft or time.perf_counter() - t
            out.append(i)
        answer = tok.decode(out, skip_special_tokens=True)
    disk = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    doc_tokens = len(prompt.document)
    k = max(1, len(times) // 20)
    row = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(torch.get_num_threads()),
        "model": src.name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "format": a.format or "auto", "tokens": len(prompt.document) + len(prompt.question), "depth": a.depth,
        "key": prompt.key, "answer": answer.strip(), "correct": score(answer, prompt.key),
        "tok_s_start": round(cs * k / sum(times[:k]), 1), "tok_s_end": round(cs * k / sum(times[-k:]), 1),
        "tok_s_total": round(cs * len(times) / sum(times), 1), "peak_rss_mib": vm("VmHWM") >> 20,
        "disk_bytes": disk, "disk_bytes_per_token": round(disk / doc_tokens, 1),
        "question_to_first_token_s": round(ttft, 2), "commit": commit,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    if a.reread:
        row |= reread_answer(path, model, tok, prompt.question, prompt.key)
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
