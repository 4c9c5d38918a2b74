"""Offline probe: score events with the question token by token instead of with its mean query.
One ingest per RULER-style prompt (the default profile with the paper's representatives, in RAM); every layer's centred memory
queries of the question's tokens are captured, and events ranked by their mean (the engine's
scoring), the maximum, a log-sum-exp, the best two, z-scored per token (max and mean). Prints
the share of layers whose budget would hold each asked needle.

    python -m benchmarks.probe_question_tokens 8192 prose

Results: docs/benchmarks.md, representative keys (every token-wise scoring was worse)."""
import dataclasses, random, sys, json, torch
from emllm import models
from emllm.engine.stream import Engine
from emllm.engine import window as W
from emllm.math.rope import apply_rotary
from emllm.evals.ruler import build_prompt, TASKS
from emllm.memory.selection import select_events
torch.set_num_threads(1)
length = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
hay = sys.argv[2] if len(sys.argv) > 2 else "prose"
src = models.resolve("smollm2")
# the paper's representatives (the default when this probe was written): per query head, by attention
prof = dataclasses.replace(src.profile, representative="attention")
model, tok = models.load(src, dtype="bfloat16")
cap = {}
orig = W.LayerWindow.forward
def fwd(self, q, k, v, scaling, st):
    if self._capture:
        p = st.n_local - 1
        qm = apply_rotary(q, st.cos[p:p+1], st.sin[p:p+1]).float()  # [H, c, D]
        mean = self.query_sum / self.query_n if self.query_n else torch.zeros_like(self.query_sum)
        cap[self.layer_idx] = (qm, mean.clone())
    return orig(self, q, k, v, scaling, st)
W.LayerWindow.forward = fwd
W.LayerWindow._capture = False
variants = ["mean", "max", "lse", "zmax", "zmean", "top2"]
res = {v: [] for v in variants}
for task in TASKS:
    for i in range(2):
        depth = (i + 0.5) / 2
        pr = build_prompt(task, tok, length, depth, random.Random(f"0/{task}/{length}/{i}"), hay)
        eng = Engine(model, prof)
        eng.feed(pr.document)
        eng.begin_question()
        for w in eng.windows: w._capture = True
        eng.feed(pr.question)
        for w in eng.windows: w._capture = False
        lengths = eng.windows[0].events.event_lengths().cpu()
        ends = torch.cumsum(lengths, 0) + prof.n_init; starts = ends - lengths
        for j in pr.targets:
            s, e = pr.needles[j]
            ev = torch.nonzero((starts < e) & (ends > s)).squeeze(1)
            if ev.numel() == 0: continue
            for v in variants:
                held = 0
                for L, w in enumerate(eng.windows):
                    qm, mean = cap[L]
                    r = w.events.repr_keys().float().reshape(len(lengths), -1)  # [E, H*D]
                    qt = (qm - mean[:, None]).transpose(0, 1).reshape(qm.shape[1], -1)  # [c, H*D]
                    S = r @ qt.T  # [E, c]
                    if v == "mean": sc = S.mean(1)
                    elif v == "max": sc = S.max(1).values
                    elif v == "lse": sc = torch.logsumexp(S * 0.125, 1)
                    elif v == "top2": sc = S.topk(min(2, S.shape[1]), 1).values.mean(1)
                    else:
                        Z = (S - S.mean(0)) / S.std(0).clamp_min(1e-6)
                        sc = Z.max(1).values if v == "zmax" else Z.mean(1)
                    sel = select_events(sc, lengths, prof.n_mem)
                    held += bool(torch.isin(ev, sel.ids).any())
                res[v].append(held / len(eng.windows))
        print(task, i, {v: round(res[v][-1], 2) for v in variants}, flush=True)
print({v: round(sum(x) / len(x), 3) for v, x in res.items()})
