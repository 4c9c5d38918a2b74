"""Offline probe: how a question's tokens should score events. One ingest per RULER-style prompt
(today's default profile, in RAM); every layer's memory queries of the question's tokens are
captured as the engine retrieves with them (rotated at the memory position, centred, folded per
KV head), and the events there were at that retrieval ranked by
- mean: the tokens' mean query (the paper's; profile question_scoring "mean"),
- zmax: each token's scores z-scored over the events, an event's best (question_scoring "max"),
- lse:T: a log-sum-exp of those z-scores at temperature T (a softer maximum; at 0.5 it ranks
  as question_scoring "lse", the default since 2026-11-27),
- zmean: the mean of the z-scores, max: the best raw score.
Prints, per variant, the share of layers whose budget (`select_positions`, exact scores) holds
each asked needle, averaged over needles, and the needles each layer misses.

    python -m benchmarks.probe_question_tokens 32768 ruler 2     # length, haystack, prompts a task
    python -m benchmarks.probe_question_tokens 8192 prose 2

Results: docs/benchmarks.md, recall (question scoring). A first version, with the paper's
representatives per query head and keys not of unit length, found every token-wise scoring worse
than the mean (43-60% of layers against 77-93% at 8k prose); with today's keys it is the reverse.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch

from emllm import models
from emllm.engine import window as W
from emllm.engine.stream import Engine
from emllm.evals.ruler import TASKS, build_prompt
from emllm.math.rope import apply_rotary
from emllm.memory.selection import event_scores, fold_query, select_positions, token_max

VARIANTS = ("mean", "zmax", "lse:0.5", "zmean", "max")


def ranked(c: dict, variant: str) -> np.ndarray:
    """Scores of the events for one layer's captured question (`c`) under `variant`."""
    q, qs, qn, share, reprs = c["q"], c["qs"], c["qn"], c["share"], c["reprs"]
    if variant == "mean":  # as the engine computes it: the mean in the model's dtype, then centred
        m = q.mean(1)
        m = m.float() - (share / qn) * qs if share and qn else m
        return event_scores(reprs, fold_query(m, c["heads"])).numpy()
    qt = q.transpose(0, 1).float()
    qt = qt - (share / qn) * qs if share and qn else qt
    f = fold_query(qt, c["heads"])  # [T, H_r, D]
    s = torch.stack([event_scores(reprs, x) for x in f]).double()  # [T, E]
    if variant == "max":
        return s.max(0).values.numpy()
    if variant == "zmax":  # the engine's own (question_scoring "max")
        return token_max(s).numpy()
    z = (s - s.mean(1, keepdim=True)) / s.std(1, correction=0, keepdim=True)
    if variant == "zmean":
        return z.mean(0).numpy()
    tau = float(variant.split(":")[1])
    return torch.logsumexp(z / tau, 0).numpy()


def main() -> None:
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    hay = sys.argv[2] if len(sys.argv) > 2 else "prose"
    samples = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    torch.set_num_threads(1)
    src = models.resolve("smollm2")
    model, tok = models.load(src)
    profile = src.profile.replace(segmentation="S", question_scoring="mean")  # (the capture is the same either way)
    cap: dict[int, dict] = {}
    capturing = [False]
    forward = W.LayerWindow.forward

    def fwd(self, q, k, v, scaling, st):
        if capturing[0]:
            p = st.n_local - 1
            cap[self.layer_idx] = dict(
                q=apply_rotary(q, st.cos[p : p + 1], st.sin[p : p + 1]),  # [H_q, c, D], the model's dtype
                qs=self.query_sum.clone(), qn=self.query_n, share=st.centering, heads=self.events.repr_heads,
                reprs=self.events.repr_keys().float().clone(), budget=st.budget,
                lengths=self.events.event_lengths().cpu().numpy().copy())
        return forward(self, q, k, v, scaling, st)

    W.LayerWindow.forward = fwd
    held: dict[str, list[np.ndarray]] = {v: [] for v in VARIANTS}
    for task in TASKS:
        for i in range(samples):
            pr = build_prompt(task, tok, length, (i + 0.5) / samples, random.Random(f"0/{task}/{length}/{i}"),
                              None if hay == "ruler" else hay)
            eng = Engine(model, profile)
            eng.feed(pr.document)
            eng.begin_question()
            capturing[0] = True
            eng.feed(pr.question)
            capturing[0] = False
            lengths = cap[0]["lengths"]
            ends = np.cumsum(lengths) + profile.n_init
            starts = ends - lengths
            for j in pr.targets:
                s, e = pr.needles[j]
                ev = np.flatnonzero((starts < e) & (ends > s))
                if ev.size == 0:
                    continue
                for v in VARIANTS:
                    held[v].append(np.array([np.isin(ev, select_positions(ranked(cap[L], v), cap[L]["lengths"], cap[L]["budget"])).any()
                                             for L in sorted(cap)]))
            print(task, i, {v: round(float(held[v][-1].mean()), 2) for v in VARIANTS if held[v]}, flush=True)
    for v in VARIANTS:
        h = np.array(held[v])  # [needles, layers]
        print(f"{v:8} {100 * h.mean():5.1f}% of layers, needles held by half the layers {int((h.mean(1) >= 0.5).sum())}"
              f"/{len(h)}; misses per layer {' '.join(str(int(x)) for x in (1 - h).sum(0))}")


if __name__ == "__main__":
    main()
