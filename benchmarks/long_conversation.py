"""A remembered conversation longer than the model's window: a fact stated in the first exchange,
then many exchanges of other text, then a question about the fact. Reports whether the answer has
it and how many layers retrieved the first exchange's events for the question.

    python -m benchmarks.long_conversation --exchanges 60 --store /var/tmp/talk [--out docs/results/conversation.jsonl]

The conversation is the library's (`Conversation`, as `emllm chat` runs it), greedy, on the
embedded SmolLM2 unless -m names another model; each message after the first is ~120 tokens of prose (Python's docs), each
answer at most 16 tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from emllm.evals.corpus import prose
from emllm import models
from emllm.app.conversation import Conversation
from emllm.app.report import retrieval_report
from emllm.app.stream import create_store
from emllm.engine.sampling import Sampling
from emllm.store import Store

FACT = "Please remember this: my locker code is 4721."
QUESTION = "What is my locker code?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exchanges", type=int, default=60)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out")
    ap.add_argument("--model", "-m", default="smollm2", help="a profile alias, a local folder or a cached hub id")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="for every answer (greedy otherwise)")
    a = ap.parse_args()
    path = Path(a.store)
    shutil.rmtree(path, ignore_errors=True)
    src = models.resolve(a.model)
    model, tok = models.load(src)
    st = create_store(path, a.model, model, tok, src.profile)
    st.publish_empty()
    st.close()
    text = prose().split()
    opts = {"max_new_tokens": 16, "sampling": Sampling(repetition_penalty=a.repetition_penalty)}
    t0 = time.perf_counter()
    with Conversation(path, model, tok) as talk:
        # the fact after ~120 tokens of other text: past the initial tokens (n_init), which every
        # step attends to anyway, so it is recalled from an event, or not at all
        talk.say_all(" ".join(text[-90:]) + " " + FACT, **opts)
        for i in range(a.exchanges - 1):
            words = text[(i * 90) % (len(text) - 90):][:90]
            talk.say_all("Here is more of the text: " + " ".join(words), **opts)
            if (i + 1) % 10 == 0:
                with Store.open(path) as s:
                    print(f"{i + 2} exchanges, {s.manifest['rows']['tokens']} tokens, {time.perf_counter() - t0:.0f} s", flush=True)
        answer = talk.say_all(QUESTION, **opts)
    with Store.open(path) as s:
        tokens, events = s.manifest["rows"]["tokens"], s.manifest["rows"]["events"]
        ids = s.tokens.read().tolist()
        code = tok.encode("4721", add_special_tokens=False)
        at = next(i for i in range(len(ids)) if ids[i : i + len(code)] == code)  # the fact's position
        report = retrieval_report(s, model, tok, QUESTION, top=100)
    spans = [e for e in report["top_events"] if e["tokens"][0] <= at < e["tokens"][1]]
    layers = spans[0]["layers"] if spans else 0
    in_window = at >= report["window_start"] or at < report["initial_tokens"]
    row = {"exchanges": a.exchanges, "repetition_penalty": a.repetition_penalty, "tokens": tokens, "events": events, "fact_at": at, "answer": answer,
           "found": "4721" in answer, "fact_event_layers": layers, "fact_in_window_or_initial": in_window,
           "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(row))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps({"date": time.strftime("%Y-%m-%d"), **row}) + "\n")


if __name__ == "__main__":
    main()
