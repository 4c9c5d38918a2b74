"""Offline probe: how the question's retrieval query could be shaped. One ingest per RULER-style
prompt with the default profile (mean representative keys per KV head, the question centred), in
RAM; then every layer's events ranked against variants of the question's query, all computed from
what the engine scored (query q less the layer's running mean query m, summed per GQA group):

- `sX`: q - X m, X in 0 (no centring), 0.5, 0.75, 1 (the default), 1.5, 2;
- `w1`, `wh1`: the default query divided per dimension by the variance (`wh1`: the standard
  deviation) of the layer's representative keys: a diagonal Mahalanobis score, one query vector;
- `n1`, `cn1`: the default query against representative keys scaled to unit length per head
  (`cn1`: after taking out the layer's mean key); `nX`: unit keys, the query less X m;
  `nwh1`: unit keys, the default query divided by the unit keys' standard deviation per dimension;
- `z1`: the default query with each head's part divided by the spread (standard deviation over
  the layer's events) of that head's scores, so that no head's ranking outweighs the others by
  the scale of its scores alone; `z0`: the same without centring.

Each is another query vector (a per-head scaling is one too), so exact search stays exact for it,
in RAM, in a store and through the sketch's bounds. Prints, per prompt and needle asked, the
share of layers whose budget would hold it, then the means.

    python -m benchmarks.probe_query_scaling 8192 prose      # or none (RULER's haystacks), chat, code

Not the engine's own path: a quick way to rank options before running one end to end
(benchmarks/quality.py --variant ...). Results: docs/benchmarks.md, recall.
"""

from __future__ import annotations

import random
import sys

import torch

from emllm import models
from emllm.engine.stream import Engine
from emllm.evals.ruler import TASKS, build_prompt
from emllm.memory.selection import fold_query, select_events

VARIANTS = ("s0", "s0.5", "s0.75", "s1", "s1.5", "s2", "z0", "z1", "w1", "wh1", "n1", "cn1",
            "n0.5", "n0.75", "n1.25", "nwh1")
# variants that also transform the events' keys
KEY_SIDE = {"n1": "unit", "cn1": "centred-unit", "n0.5": "unit", "n0.75": "unit", "n1.25": "unit", "nwh1": "unit"}


def head_spread(reprs: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """reprs [E, H, D], query [H, D] -> each head's score spread over the events [H] (> 0)."""
    per_head = torch.einsum("ehd,hd->eh", reprs, query)  # [E, H]
    return per_head.std(0).clamp_min(1e-6) if per_head.shape[0] > 1 else torch.ones(query.shape[0])


def queries(scored: torch.Tensor, mean: torch.Tensor, reprs: torch.Tensor) -> dict[str, torch.Tensor]:
    """scored: the default query as the engine scored it [H_r, D] (q - m, folded); mean: m folded."""
    q = {f"s{s:g}": scored + (1 - s) * mean for s in (0, 0.5, 0.75, 1, 1.5, 2)}
    q["z0"] = q["s0"] / head_spread(reprs, q["s0"])[:, None]
    q["z1"] = q["s1"] / head_spread(reprs, q["s1"])[:, None]
    var = reprs.var(0).clamp_min(1e-6) if reprs.shape[0] > 1 else torch.ones_like(scored)  # [H, D]
    q["w1"] = q["s1"] / var  # q' Sigma^-1 r with the keys' diagonal covariance: still one query vector
    q["wh1"] = q["s1"] / var.sqrt()
    q["n1"] = q["cn1"] = q["s1"]
    for share in (0.5, 0.75, 1.25):
        q[f"n{share:g}"] = scored + (1 - share) * mean
    unit = reprs / reprs.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    uvar = unit.var(0).clamp_min(1e-6) if reprs.shape[0] > 1 else torch.ones_like(scored)
    q["nwh1"] = q["s1"] / uvar.sqrt()
    return q


def keys_for(variant: str, reprs: torch.Tensor) -> torch.Tensor:
    """The events' keys a variant scores: as stored, or (KEY_SIDE) unit length per head, after
    taking out the layer's mean key for `cn1` (a ranking change only once scaled)."""
    kind = KEY_SIDE.get(variant)
    if kind is None:
        return reprs
    x = reprs - reprs.mean(0, keepdim=True) if kind == "centred-unit" else reprs
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def main() -> None:
    torch.set_num_threads(1)
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    hay = sys.argv[2] if len(sys.argv) > 2 else "prose"
    hay = None if hay == "none" else hay
    src = models.resolve("smollm2")
    prof = src.profile
    model, tok = models.load(src, dtype="bfloat16")
    res: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for task in TASKS:
        for i in range(2):
            pr = build_prompt(task, tok, length, (i + 0.5) / 2, random.Random(f"0/{task}/{length}/{i}"), hay)
            eng = Engine(model, prof)
            eng.feed(pr.document)
            seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

            def record(layer: int, sel, query: torch.Tensor) -> None:
                w = eng.windows[layer]
                mean = w.query_sum / max(w.query_n, 1)  # before this step's query joins it
                seen[layer] = (query.float().clone(), fold_query(mean, w.events.repr_heads).float())

            eng.on_retrieval = record
            eng.begin_question()
            eng.feed(pr.question)
            eng.on_retrieval = None
            lengths = eng.windows[0].events.event_lengths().cpu()
            ends = torch.cumsum(lengths, 0) + prof.n_init
            starts = ends - lengths
            per = {}
            for layer, (scored, mean) in seen.items():
                reprs = eng.windows[layer].events.repr_keys().float()  # [E, H_r, D]
                per[layer] = {k: torch.einsum("ehd,hd->e", keys_for(k, reprs), v)
                              for k, v in queries(scored, mean, reprs).items()}
            for j in pr.targets:
                s, e = pr.needles[j]
                ev = torch.nonzero((starts < e) & (ends > s)).squeeze(1)
                if ev.numel() == 0:
                    continue
                for v in VARIANTS:
                    held = sum(bool(torch.isin(ev, select_events(per[L][v], lengths, prof.n_mem).ids).any()) for L in per)
                    res[v].append(held / len(eng.windows))
            print(task, i, {v: round(res[v][-1], 2) for v in VARIANTS if res[v]}, flush=True)
    print({v: round(sum(x) / len(x), 3) for v, x in res.items() if x})


if __name__ == "__main__":
    main()
