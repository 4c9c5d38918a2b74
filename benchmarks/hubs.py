"""Hub events: how often each event is retrieved across unrelated questions, per query centering.

    python -m benchmarks.hubs --tokens 8k --variant c1=query_centering:1 --variant n=repr_normalise:true --out docs/results/hubs-8k.json

A store is built from real prose (emllm.evals.corpus: the docstrings of Python's standard library
and of transformers' models, text nobody here wrote), then each of a dozen unrelated questions is
read as a question of `emllm ask` (a read-only session on the store's state) and every layer's
selection at the question step is recorded. An event every question retrieves is a hub: it
takes budget from whatever the question is about. The profile's own scoring and each `--variant`
(profile keys changed, e.g. `query_centering`, `repr_normalise`: a store of its own, read with it
from the first token) report:

- hub share: of all (question, layer) selections' events, the share that are hubs (retrieved in
  that layer by at least 3/4 of the questions);
- overlap: the mean Jaccard similarity of two questions' selections in one layer (1: every
  question gets the same events);
- the three most retrieved events: in how many (question, layer) pairs, and where they are;
- distinct: events retrieved by any question in any layer, of all events x layers.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from emllm.evals.corpus import tokens as corpus_tokens
from emllm import models
from emllm.app.ask import Session
from emllm.app.ingest import add_documents, run_job
from emllm.app.stream import SEPARATOR, create_store, encode, open_engine
from emllm.evals.passkey import parse_length
from emllm.evals.recall import RecallProbe
from emllm.store import Store

QUESTIONS = [
    "What does the text say about exceptions?",
    "Who wrote this document?",
    "List the special magic numbers.",
    "How do I parse command-line arguments?",
    "What is a dataclass?",
    "How are HTTP headers handled?",
    "What happens when a subprocess times out?",
    "Explain how logging levels work.",
    "How is a tar archive read?",
    "What is the median of a list of numbers?",
    "How do I compare two sequences of lines?",
    "Which models does the library support for images?",
]


def selections(store: Store, model, tok, bare: bool = False) -> list[dict[int, list[int]]]:
    """Per question, per layer: the event ids selected at the question step. bare: the question's
    own words only, without the chat template's framing (which every question shares)."""
    out = []
    for q in QUESTIONS:
        session = Session(store, model, tok)
        probe = RecallProbe(session.engine)
        if bare:
            if session.tail:  # the pending tail first, unrecorded (its own chunk either way)
                session.engine.feed(session.tail)
                probe.last.clear()
            session.engine.feed(encode(tok, SEPARATOR + q))
        else:
            session.read_question(q)  # (the store's pending tail first: retrievals of the last read the probe's)
        probe.detach()
        out.append({layer: sel.ids.tolist() for layer, (sel, _, _) in probe.last.items()})
    return out


def hub_report(sel: list[dict[int, list[int]]], n_events: int, spans: torch.Tensor) -> dict:
    layers = sorted(sel[0])
    n_q = len(sel)
    hubs = taken = 0
    jacc = []
    pairs: Counter = Counter()
    distinct = 0
    for layer in layers:
        count = Counter(e for s in sel for e in s[layer])
        distinct += len(count)
        hub = {e for e, c in count.items() if c >= 0.75 * n_q}
        taken += sum(len(s[layer]) for s in sel)
        hubs += sum(e in hub for s in sel for e in s[layer])
        for i in range(n_q):
            for j in range(i + 1, n_q):
                a, b = set(sel[i][layer]), set(sel[j][layer])
                jacc.append(len(a & b) / max(1, len(a | b)))
        pairs.update(count)
    top = [{"event": e, "pairs": c, "of": n_q * len(layers), "tokens": spans[e].tolist()}
           for e, c in pairs.most_common(3)]
    return {"hub_share": round(hubs / max(1, taken), 4), "overlap": round(sum(jacc) / max(1, len(jacc)), 4),
            "top": top, "distinct": distinct, "of": n_events * len(layers)}


def main() -> None:
    from benchmarks.quality import parse_variant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8k")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY:VALUE[,KEY:VALUE]",
                    help="a store read with these profile keys changed (repeatable)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--bare", action="store_true",
                    help="ask with the questions' own words only (no chat-template framing, which all questions share)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    a = ap.parse_args()
    n = parse_length(a.tokens)
    src = models.resolve("smollm2")
    model, tok = models.load(src, dtype=a.dtype)
    text = tok.decode(corpus_tokens(tok, "prose", n))
    variants = [("plain", src.profile)] + [parse_variant(v, src.profile) for v in a.variant]
    res = {"tokens": n, "questions": QUESTIONS, "date": time.strftime("%Y-%m-%d %H:%M"),
           "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "runs": []}
    for name, prof in variants:
        with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
            t0 = time.perf_counter()
            st = create_store(Path(tmp) / "s", src.name, model, tok, prof, chat=True)
            add_documents(st, tok, [("prose", text)])
            run_job(st, open_engine(st, model), 8, None)
            st.close()
            with Store.open(Path(tmp) / "s") as store:
                lengths = store.events.read().long()
                ends = torch.cumsum(lengths, 0) + prof.n_init
                rep = hub_report(selections(store, model, tok, a.bare), lengths.numel(), torch.stack((ends - lengths, ends), 1))
        rep = {"variant": name, "bare_questions": a.bare, "changes": {k: v for k, v in asdict(prof).items() if v != getattr(src.profile, k)},
               **rep, "seconds": round(time.perf_counter() - t0, 1)}
        res["runs"].append(rep)
        print(json.dumps(rep), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
