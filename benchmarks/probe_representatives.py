"""Offline probe: which representative key finds the needle? One ingest per RULER-style prompt
(the default profile with the paper's representatives, in RAM), then every layer's events ranked against the question's retrieval
query (as the engine scored it) with other representative keys computed from the same events'
keys: the attention's top 4 (the paper's), the mean of every token, the 4 most surprising
tokens, both means, the mean at unit length per head, the better of two z-scored rankings.
Prints, per prompt and needle asked, the share of layers whose budget would hold it.

    python -m benchmarks.probe_representatives 8192 prose      # or none (RULER's haystacks), chat, code

Not the engine's own path: a quick way to rank options before running one end to end
(benchmarks/quality.py --variant ...). Results: docs/benchmarks.md, representative keys."""
import dataclasses, random, sys, torch
from emllm import models
from emllm.engine.stream import Engine
from emllm.evals.ruler import build_prompt, TASKS
from emllm.evals.recall import RecallProbe
from emllm.memory.selection import select_events
torch.set_num_threads(1)
length = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
hay = sys.argv[2] if len(sys.argv) > 2 else "prose"
hay = None if hay == "none" else hay
src = models.resolve("smollm2")
# the paper's representatives (the default when this probe was written): per query head, by attention
prof = dataclasses.replace(src.profile, representative="attention")
model, tok = models.load(src, dtype="bfloat16")
variants = ["mass4", "all", "surp4", "norm_all", "max2"]
res = {v: [] for v in variants}
for task in TASKS:
    for i in range(2):
        pr = build_prompt(task, tok, length, (i + 0.5) / 2, random.Random(f"0/{task}/{length}/{i}"), hay)
        eng = Engine(model, prof)
        eng.feed(pr.document)
        probe = RecallProbe(eng)
        eng.begin_question()
        eng.feed(pr.question)
        probe.detach()
        lengths = eng.windows[0].events.event_lengths().cpu()
        E = lengths.numel()
        ends = torch.cumsum(lengths, 0) + prof.n_init; starts = ends - lengths
        sur = eng.surprise.view()[prof.n_init: prof.n_init + int(lengths.sum())].float()
        sur = torch.nan_to_num(sur, nan=-1e9)
        width = int(lengths.max())
        st0 = torch.cumsum(lengths, 0) - lengths
        col = torch.arange(width)
        valid = col[None] < lengths[:, None]
        idx = (st0[:, None] + col[None]).clamp_max(int(lengths.sum()) - 1)  # [E, width]
        per = {}
        for L, w in enumerate(eng.windows):
            _, query, _ = probe.last[L]  # [H_q, D] as scored (centred)
            hq, d = query.shape
            K = w.events.keys.view().float()  # [H_kv, T, D]
            g = hq // K.shape[0]
            Kq = K.repeat_interleave(g, 0)  # [H_q, T, D]
            ks = Kq[:, idx]  # [H_q, E, width, D]
            m = valid[None, :, :, None].float()
            allm = (ks * m).sum(2) / lengths[None, :, None]  # [H_q, E, D]
            s_tok = sur[idx].masked_fill(~valid, -1e30)  # [E, width]
            def topk_s(k):
                t = s_tok.topk(min(k, width), 1).indices  # [E, k]
                ok = torch.gather(valid, 1, t).float()
                sel = torch.gather(ks, 2, t[None, :, :, None].expand(hq, -1, -1, d))
                return (sel * ok[None, :, :, None]).sum(2) / ok.sum(1)[None, :, None]
            R = {"mass4": w.events.repr_keys().float().transpose(0, 1), "all": allm, "surp4": topk_s(4), "surp8": topk_s(8)}
            R["mass4+all"] = (R["mass4"] + R["all"]) / 2
            R["norm_all"] = allm / allm.norm(dim=-1, keepdim=True).clamp_min(1e-6)
            scores = {k: torch.einsum("hed,hd->e", v, query) for k, v in R.items()}
            a, b = scores["mass4"], scores["all"]
            scores["max2"] = torch.maximum((a - a.mean()) / a.std(), (b - b.mean()) / b.std())
            per[L] = scores
        for j in pr.targets:
            s, e = pr.needles[j]
            ev = torch.nonzero((starts < e) & (ends > s)).squeeze(1)
            if ev.numel() == 0: continue
            for v in variants:
                held = sum(bool(torch.isin(ev, select_events(per[L][v], lengths, prof.n_mem).ids).any()) for L in per)
                res[v].append(held / len(eng.windows))
        print(task, i, {v: round(res[v][-1], 2) for v in variants}, flush=True)
print({v: round(sum(x) / len(x), 3) for v, x in res.items()})
