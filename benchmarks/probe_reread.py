"""Re-read answers against emllm's own and the retrieval baseline's, side by side on each prompt.

Per RULER-style prompt, emllm (today's profile, in RAM) reads the document once, then the question
with every layer's selection recorded (`app.reread.SelectionRecorder`). From that one read:

- `emllm`: emllm's own answer (the memory at one distance, spec §1);
- `reread`: `emllm ask --reread`'s answer (core/app/reread.py): the stream's passages of ~128
  tokens ranked by the layers' votes, taken up to emllm's attention span (n_init + n_mem +
  n_local), read in order by the plain model: the retrieval baseline's layout with emllm's choice
  of chunks. The tokens in no event yet (remainder, window) are scored as events would be;
- `reread-votes`: the same with the votes of emllm's own selections only (the tail has none:
  `ask --reread` before 2026-11-28, late);
- `reread-window`: the window's passages first (every layer attends to them);
- `reread-rrf`: `reread` with the passages ranked by the reciprocal rank fusion of the layers'
  selections (`memory.passages.event_rrf`) instead of their counts;
- `reread-last`: `reread` with its best-ranked passage read last, next to the question;
- `reread-rank`: `reread` with its passages read by rank, the worst first, the best last;
- `reread-rank-rrf`: `reread-rank` with passages of equal votes ranked by the fusion of the
  layers' ranks (`memory.passages.event_votes_rrf`), not by the stream's order;
- `reread-lexical`: `reread` with its passages read by their BM25 for the question's token ids,
  the best last (`app.reread` layout "lexical": the votes choose, the words order);
- `reread-hybrid`: `reread-lexical` with the passages chosen by the fusion of the votes' ranking
  and the question's best few by BM25 (`app.reread` choice "votes+words": a passage the
  question's rare words point to is read where the votes passed it over);
- `reread-maxsim`: `reread-rank-rrf` with each layer's selection ranked by its tokens' keys, not
  their events' mean keys: an event scores, per question token, its best token's attention logit
  (the question's queries as the memory's retrieval scores them, against each token's stored key),
  combined over the question's tokens as the retrieval combines them. Look-alike needles (the
  multi-key task) tie in votes, and the events' mean keys hardly tell them apart
  (docs/benchmarks.md, re-read answers);
- `rag`: the retrieval baseline at emllm's span (`quality.py --methods rag --rag-budget 2176`):
  the same chunks, chosen by MiniLM, read in document order;
- `rag-rank`: the baseline with its chunks read by MiniLM's rank, the best last (as `reread-rank`).

    python -m benchmarks.probe_reread niah_multikey --samples 0:2,2:3,5:10 --out results.jsonl
    python -m benchmarks.probe_reread niah_multikey --haystack code --samples 0:2,2:3,5:10 --out ...

--save-votes DIR writes each prompt's votes (safetensors, `app.reread.Votes`) and reads them back
when they are there, so that the re-read methods (reread, reread-rrf) can be compared again by
reading alone, without emllm's read of the document (~85 s of a prompt's ~125 s at 8k). A file is
named by the prompt's digest too: the same sample in another run (another depth) is another prompt,
whose votes must not be taken for it.

--paraphrase asks each prompt's question in other words (`evals.ruler.paraphrased`: the same
document; only the key and the kind's noun shared with the needle), to see whether a choice that
leans on the question's words holds where they are not the needle's; `--paraphrase none` in words
none of which the needle has (tasks with one key only), where that choice has nothing to go on.

--samples lists quality.py's (--first-sample, --samples) runs whose prompts to ask: a prompt's
depth depends on its run (quality.py spreads a run's depths evenly). Results: docs/benchmarks.md,
recall (re-read answers).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from benchmarks import git_commit
from emllm import models
from emllm.app.reread import SelectionRecorder, Votes, context_from_votes, read_again, reread_room
from emllm.engine.stream import Engine
from emllm.evals.passkey import _stop_ids
from emllm.evals.rag import run_rag
from emllm.evals.ruler import HAYSTACKS, TASKS, build_prompt, paraphrased
from emllm.memory.buffers import token_index
from emllm.memory.selection import TOKEN_SCORINGS, Selection


METHODS = ("emllm", "reread", "reread-rrf", "reread-last", "reread-rank", "reread-rank-rrf", "reread-lexical", "reread-hybrid", "reread-votes", "reread-window", "reread-maxsim", "rag", "rag-rank")
NEED_THE_READ = {"emllm", "reread-votes", "reread-window", "reread-maxsim"}  # not from saved votes
BASELINES = {"rag", "rag-rank"}  # need no read of emllm's


class TokenRescorer(SelectionRecorder):
    """A SelectionRecorder whose scores are each selected event's (and tail piece's) best token
    for each of the question's tokens: [T, n] logits q . k over the selection's tokens, the
    maximum per item, then `TOKEN_SCORINGS[question_scoring]` over its [T, k] (z-scores among the
    items this layer selected). The ids are the recorder's; only their ranking changes."""

    def heard(self, layer: int, sel: Selection, query: torch.Tensor) -> None:
        super().heard(layer, sel, query)
        eng = self.engine
        w, ids = eng.windows[layer], self.last[layer]
        n_ev = len(w.events)
        ev = torch.sort(ids[ids < n_ev]).values
        pieces = torch.sort(ids[ids >= n_ev]).values - n_ev
        keys, lengths = [], []
        if len(ev):
            k, _ = w.events.gather(ev)  # [H_kv, n, D], the events in id order
            keys.append(k)
            lengths.append(w.events.event_lengths().cpu()[ev])
        if len(pieces):
            tail = torch.cat((w.rem_k, w.local_k[:, : eng.profile.n_local]), 1)
            at = torch.cumsum(self._tail, 0) - self._tail
            keys.append(tail[:, token_index(at[pieces], self._tail[pieces])])
            lengths.append(self._tail[pieces])
        kk, ln = torch.cat(keys, 1).float(), torch.cat(lengths)  # [H_kv, n, D], [k]
        q = (query if query.dim() == 3 else query[None]).float()  # [T, H_r, D]
        if q.shape[1] != kk.shape[0]:
            raise SystemExit("reread-maxsim needs a representative key per KV head (store version 7 on)")
        logits = torch.einsum("thd,hnd->tn", q, kk)  # [T, n]
        item = torch.repeat_interleave(torch.arange(len(ln)), ln)  # [n] the item of each token
        best = torch.full((q.shape[0], len(ln)), float("-inf")).scatter_reduce(
            1, item.expand(q.shape[0], -1), logits, "amax")  # [T, k]
        order = torch.cat((ev, pieces + n_ev))  # the items' ids in `best`'s column order
        by_id = torch.argsort(order)
        self.last[layer] = order[by_id]
        self.scores[layer] = TOKEN_SCORINGS[eng.profile.question_scoring](best)[by_id].float()


def needles_in(spans: list[tuple[int, int]], needles: list[tuple[int, int]]) -> list[bool]:
    return [any(s < ne and ns < e for s, e in spans) for ns, ne in needles]


def read_at(spans: list[tuple[int, int]], needle: tuple[int, int] | None) -> int | None:
    """Where the passage holding `needle` is read, counted from the question: 1 = the last read."""
    if needle is None:
        return None
    at = [len(spans) - i for i, (s, e) in enumerate(spans) if s < needle[1] and needle[0] < e]
    return at[-1] if at else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", choices=sorted(TASKS))
    ap.add_argument("--haystack", choices=sorted(HAYSTACKS))
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--samples", default="0:5", help="FIRST:COUNT[,FIRST:COUNT]: quality.py's runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=None, help="auto, float32, bfloat16 (default: the profile's)")
    ap.add_argument("--out", required=True, help="JSON lines, appended")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--paraphrase", nargs="?", const="key", choices=("key", "none"),
                    help="ask each prompt's question in other words (evals.ruler.paraphrased): the same document; "
                         "'key' (the bare flag): the needle's key and kind shared; 'none': no word of the needle")
    ap.add_argument("--max-new-tokens", type=int, metavar="N",
                    help="tokens each method may generate (default: the task's, `evals.ruler`; RULER's own "
                         "generator gives its needle tasks 128)")
    ap.add_argument("--save-votes", type=Path, metavar="DIR",
                    help="keep each prompt's votes here; where they are already, read them instead of the document")
    a = ap.parse_args()
    methods = a.methods.split(",")
    if not set(methods) <= set(METHODS):
        ap.error(f"--methods: unknown {sorted(set(methods) - set(METHODS))}")
    if a.save_votes:
        a.save_votes.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    src = models.resolve("smollm2")
    model, tok = models.load(src, dtype=a.dtype)
    prof = src.profile.replace(segmentation="S")
    span = prof.n_init + prof.n_mem + prof.n_local
    name = a.task if a.haystack is None else f"{a.task} ({a.haystack})"
    commit = git_commit()
    stops = set(_stop_ids(tok, model))
    for run in a.samples.split(","):
        first, count = (int(x) for x in run.split(":"))
        for i in range(first, first + count):
            depth = round((i - first + 0.5) / count, 4)  # as quality.py places them
            p = build_prompt(a.task, tok, a.length, depth, random.Random(f"{a.seed}/{a.task}/{a.length}/{i}"), a.haystack)
            if a.paraphrase:
                p = paraphrased(p, tok, shared=a.paraphrase)
            q, n_new = p.question, a.max_new_tokens or p.max_new_tokens
            asked = p.needles[p.targets[0]] if p.targets else None
            t0 = time.perf_counter()
            saved = a.save_votes / f"{a.task}-{a.haystack or 'ruler'}-{a.length}-s{a.seed}-{i}-{p.digest}.safetensors" \
                if a.save_votes else None
            room = reread_room(prof, len(p.document), len(q))
            # the listeners of the prompt before hold its engine: dropped before this one's read (at
            # 128k each engine holds ~6 GB)
            eng = rec = own_votes = maxsim = None
            if not set(methods) - BASELINES:
                votes = {}  # the baselines alone: emllm's read is not needed
            elif saved is not None and saved.exists() and not NEED_THE_READ & set(methods):
                votes = {"reread": Votes.load(saved)}
            else:
                eng = Engine(model, prof)
                eng.feed(p.document)
                own_votes = SelectionRecorder(eng, tail=False)
                rec = SelectionRecorder(eng)  # (chained: all see every retrieval)
                maxsim = TokenRescorer(eng) if "reread-maxsim" in methods else None
                eng.begin_question()
                eng.feed(q)
                for r in (maxsim, rec, own_votes):
                    if r is not None:
                        r.detach()
                votes = {"reread": rec.votes(), "own": own_votes.votes()}
                if maxsim is not None:
                    votes["maxsim"] = maxsim.votes()
                if saved is not None:
                    votes["reread"].save(saved)
            # method -> (whose votes, window first, ranking, layout, choice)
            variants = {"reread": ("reread", False, "votes", "stream", "votes"),
                        "reread-rrf": ("reread", False, "rrf", "stream", "votes"),
                        "reread-last": ("reread", False, "votes", "best-last", "votes"),
                        "reread-rank": ("reread", False, "votes", "rank", "votes"),
                        "reread-rank-rrf": ("reread", False, "votes-rrf", "rank", "votes"),
                        "reread-maxsim": ("maxsim", False, "votes-rrf", "rank", "votes"),
                        "reread-lexical": ("reread", False, "votes", "lexical", "votes"),
                        "reread-hybrid": ("reread", False, "votes", "lexical", "votes+words"),
                        "reread-votes": ("own", False, "votes", "stream", "votes"),
                        "reread-window": ("own", True, "votes", "stream", "votes")}
            stream = torch.tensor(p.document)
            contexts = {m: context_from_votes(stream, votes[v], tok, prof.n_init, prof.n_local, room,
                                              model.config.num_hidden_layers, window=w, ranking=rk, layout=lay,
                                              question=q, choice=ch)
                        for m, (v, w, rk, lay, ch) in variants.items() if m in methods}
            rows = []
            if "emllm" in methods:
                own = tok.decode(eng.generate(n_new, stops), skip_special_tokens=True)
                rows.append({"method": "emllm", "answer": own, "seconds": round(time.perf_counter() - t0, 1)})
            answered: dict[tuple[int, ...], str] = {}  # a context read already: the same answer (greedy)
            for m, rr in contexts.items():
                t1 = time.perf_counter()
                key = tuple(rr.ids)
                if key not in answered:
                    r_eng = read_again(model, prof, rr.ids, q, n_new)
                    answered[key] = tok.decode(r_eng.generate(n_new, stops), skip_special_tokens=True)
                rows.append({"method": m, "answer": answered[key], "context": len(rr.ids) + len(q),
                             "passages": len(rr.passages), "needle_in": needles_in(rr.passages, p.needles),
                             "asked_at": read_at(rr.passages, asked),
                             "seconds": round(time.perf_counter() - t1, 1)})
            for m, lay in (("rag", "stream"), ("rag-rank", "rank")):
                if m not in methods:
                    continue
                t1 = time.perf_counter()
                ans, rc = run_rag(model, tok, p, max_new_tokens=n_new, budget=span, layout=lay)
                rows.append({"method": m, "answer": ans, "context": len(rc.ids), "passages": len(rc.spans),
                             "needle_in": needles_in(rc.spans, p.needles),
                             "asked_at": read_at(rc.spans, asked), "seconds": round(time.perf_counter() - t1, 1)})
            for r in rows:
                r = {"task": name, "length": a.length, "sample": i, "depth": depth, "method": r["method"],
                     "answers": p.answers, "answer": r["answer"].strip(), "score": p.score(r["answer"]),
                     "targets": list(p.targets), **{k: v for k, v in r.items() if k not in ("method", "answer")},
                     "dtype": str(model.dtype).removeprefix("torch."), "commit": commit, "prompt": p.digest,
                     **({"max_new_tokens": n_new} if a.max_new_tokens else {}),
                     **({"question": "paraphrased" if a.paraphrase == "key" else "no word of the needle"}
                        if a.paraphrase else {})}
                print(json.dumps(r), flush=True)
                with open(a.out, "a") as f:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
