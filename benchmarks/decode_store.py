"""Decoding from stores, side by side: seconds per generated token of `emllm ask` (the store opened
read-only, the question fed as its own chunk, greedy tokens) against the plain model with a
sliding window of the same size (n_init + n_mem + n_local), in one process, rounds interleaved.

    python -m benchmarks.decode_store /var/tmp/prose32k-a /var/tmp/prose32k-b --tokens 20 --rounds 3

Each store and the window take turns, `--tokens` tokens a turn, `--rounds` turns each; the figures
are the median turn. The window reads the last tokens of the store's own document, then the
question, and decodes the same tokens as the first store (so both do the same work per token).
The answers' first tokens are printed per store: stores that should answer alike can be compared.
Run it with nothing else on the machine: only ratios measured in one run are comparable.

The window is the plain model as transformers runs it (sdpa in the model's dtype), as emllm's
generated tokens attend on the CPU (torch's flash kernel in the model's dtype).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.ingest_speed import Vanilla
from emllm import models
from emllm.app import stream
from emllm.store import Store

QUESTION = "\n\nQuestion: What does the text say about exceptions and how are they raised?\nAnswer:"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stores", nargs="+", help="store folders (of the same model and dtype)")
    ap.add_argument("--model", "-m", default="smollm2")
    ap.add_argument("--tokens", type=int, default=20, help="generated tokens per turn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=None, help="JSON lines, appended")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    stores = [Store.open(p) for p in a.stores]
    src = models.resolve(a.model)
    model, tok = models.load(src, dtype=stores[0].geometry.dtype)
    q = torch.tensor(tok(QUESTION, add_special_tokens=False)["input_ids"])
    engines, answers = [], []
    with torch.no_grad():
        for st in stores:
            em = stream.open_engine(st, model)
            em.begin_question()
            em.step(q)
            engines.append(em)
            answers.append([])
        prof = stream.store_profile(stores[0])
        w = prof.n_init + prof.n_mem + prof.n_local
        wins = {"window": Vanilla(model, w)}
        ids = stores[0].tokens.read()[-w:].long()
        for win in wins.values():
            for s in range(0, ids.numel(), prof.chunk_size):
                win.step(ids[s : s + prof.chunk_size])
            win.step(q)

    def turn_emllm(i: int) -> float:
        em, out = engines[i], answers[i]
        t = time.perf_counter()
        with torch.no_grad():
            for _ in range(a.tokens):
                x = em.last_logits.argmax()[None]
                out.append(int(x))
                em.step(x)
        return (time.perf_counter() - t) / a.tokens

    def turn_window(win: Vanilla, r: int) -> float:
        toks = answers[0][r * a.tokens : (r + 1) * a.tokens]
        t = time.perf_counter()
        for x in toks:
            win.step(torch.tensor([x]))
        return (time.perf_counter() - t) / len(toks)

    times: dict[str, list[float]] = {p: [] for p in a.stores}
    times.update({name: [] for name in wins})
    for r in range(a.rounds):
        for i, p in enumerate(a.stores):
            times[p].append(turn_emllm(i))
        for name, win in wins.items():
            times[name].append(turn_window(win, r))
        print(" ".join(f"{k.split('/')[-1]} {v[-1] * 1000:.1f}" for k, v in times.items()), "ms/token", flush=True)
    base = statistics.median(times["window"])
    rows = []
    for i, p in enumerate(a.stores):
        st = stores[i]
        med = statistics.median(times[p])
        row = {"store": p, "version": st.manifest["version"], "repr_heads": st.repr_heads,
               "tokens": st.tokens.rows, "events": st.events.rows, "threads": torch.get_num_threads(),
               "s_per_token": round(med, 4), "window_s_per_token": round(base, 4), "ratio": round(med / base, 3),
               "answer": tok.decode(answers[i][:24])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    same = all(x[: len(answers[0])] == answers[0] for x in answers)
    print(f"answers identical across stores: {same}")
    if a.out:
        with open(a.out, "a") as f:
            for row in rows:
                f.write(json.dumps({**row, "answers_identical": same}) + "\n")


if __name__ == "__main__":
    main()
