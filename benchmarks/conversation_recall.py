"""Recall in a remembered conversation: several facts stated in different exchanges of a long
conversation, each asked about at its end; for each, the rank of the fact's event among all
events (by how many layers selected it, as `emllm inspect --query` ranks them) and how many of
the 30 layers selected it, for the question read with the store's own scoring and with the
read-time variants named in --scorings.

    python -m benchmarks.conversation_recall --store /var/tmp/facts [--profile P.yaml] \\
        [--scorings lse:1,mean:0] [--out docs/results/conversation-recall.jsonl]

The conversation is the library's (`Conversation`, as `emllm chat` runs it), greedy, SmolLM2;
each message is ~90 words of prose (Python's docs), each answer at most 16 tokens; the facts
end the messages of exchanges spread over the conversation (FACTS). With --reuse the store of an
earlier run is asked again (the conversation is not replayed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

from benchmarks import git_commit
from benchmarks.long_conversation import fact_position
from emllm import models
from emllm.app.ask import Session
from emllm.app.conversation import Conversation
from emllm.app.report import retrieval_doc
from emllm.app.stream import create_store, pending_tokens
from emllm.app.trace import Trace
from emllm.evals.corpus import prose
from emllm.store import Store

# (the fact, as the user states it; the question; its answer, as the fact words it)
FACTS = [
    ("Remember: the secret word is pineapple.", "What is the secret word?", "pineapple"),
    ("Note that my locker code is 4721.", "What is my locker code?", "4721"),
    ("By the way, my cat is called Biscuit.", "What is my cat called?", "Biscuit"),
    ("Also, I was born in Lisbon.", "Where was I born?", "Lisbon"),
    ("My favourite colour is turquoise.", "What is my favourite colour?", "turquoise"),
]


def fact_rank(doc: dict, at: int) -> tuple[int | None, int]:
    """(1-based rank, layers) of the event holding stream position `at` in a retrieval_doc's
    events (all of them, most layers first); (None, 0) when no layer selected it."""
    for r, e in enumerate(doc["top_events"]):
        if e["tokens"][0] <= at < e["tokens"][1]:
            return (r + 1, e["layers"]) if e["layers"] else (None, 0)
    return None, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--exchanges", type=int, default=60)
    ap.add_argument("--profile", "-p", help="a built-in profile name or a .yaml file (default: SmolLM2's)")
    ap.add_argument("--scorings", default="",
                    help="read-time variants, comma-separated question_scoring:question_centering[:distinct_events 0|1] "
                         "(e.g. mean:0, lse:1:1); the store's own is always asked")
    ap.add_argument("--reuse", action="store_true", help="ask the store of an earlier run (no new conversation)")
    ap.add_argument("--out")
    a = ap.parse_args()
    path = Path(a.store)
    src = models.resolve("smollm2", a.profile)
    model, tok = models.load(src)
    every = max(1, a.exchanges // len(FACTS))
    t0 = time.perf_counter()
    if not a.reuse:
        shutil.rmtree(path, ignore_errors=True)
        st = create_store(path, "smollm2", model, tok, src.profile)
        st.publish_empty()
        st.close()
        words = prose().split()
        with Conversation(path, model, tok) as talk:
            for i in range(a.exchanges):
                msg = " ".join(words[(i * 90) % (len(words) - 90):][:90])
                if i % every == 0 and i // every < len(FACTS):
                    msg += " " + FACTS[i // every][0]
                talk.say_all(msg, max_new_tokens=16)
    built = time.perf_counter() - t0
    with Store.open(path) as st:
        ids = st.tokens.read().tolist() + pending_tokens(st)  # (a short conversation may have committed no chunk)
        variants = [("store", None)] + [(v, tuple(v.split(":"))) for v in a.scorings.split(",") if v]
        for fact, question, answer in FACTS[: (a.exchanges + every - 1) // every]:
            at = fact_position(ids, tok, fact, answer)
            for name, override in variants:
                session = Session(st, model, tok)
                if override is not None:
                    session.engine.profile = dataclasses.replace(
                        session.engine.profile, question_scoring=override[0], question_centering=float(override[1]),
                        distinct_events=(override[2] == "1") if len(override) > 2 else session.engine.profile.distinct_events)
                trace = Trace.attach(session.engine)
                session.read_question(question)
                trace.detach()
                doc = retrieval_doc(trace, st, tok, question, top=10**9, window_start=session.engine.window_start)
                rank, layers = fact_rank(doc, at)
                pr = session.engine.profile
                row = {"fact": fact, "question": question, "fact_at": at, "scoring": name,
                       "question_scoring": pr.question_scoring, "question_centering": pr.question_centering,
                       "representative": pr.representative, "repr_normalise": pr.repr_normalise,
                       "distinct_events": pr.distinct_events,
                       "rank": rank, "layers": layers, "events": len(doc["top_events"]),
                       "in_window": at >= doc["window_start"], "tokens": len(ids),
                       "exchanges": a.exchanges, "build_seconds": round(built, 1), "commit": git_commit()}
                print(json.dumps(row), flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(json.dumps({"date": time.strftime("%Y-%m-%d"), **row}) + "\n")


if __name__ == "__main__":
    main()
