"""A remembered conversation longer than the model's window: a fact stated in the first exchange,
then many exchanges of other text, then a question about the fact. Reports whether the answer has
it and how many layers retrieved the first exchange's events for the question.

    python -m benchmarks.long_conversation --exchanges 60 --store /var/tmp/talk [--reread] [--out docs/results/conversation.jsonl]

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
from emllm.app.ask import Session
from emllm.app.conversation import Conversation
from emllm.models import stop_token_ids
from emllm.app.report import retrieval_report
from emllm.app.stream import create_store, pending_tokens
from emllm.engine.sampling import Sampling
from emllm.store import Store

# A fact SmolLM2 reads back from its own window after several exchanges of other text (checked with
# the plain model, whole conversation in its context); "my locker code is 4721" it does not read
# back even two exchanges later, so a miss there measures the model, not the memory.
FACT = "Remember: the secret word is pineapple."
QUESTION = "What is the secret word?"
EXPECT = "pineapple"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exchanges", type=int, default=60)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out")
    ap.add_argument("--model", "-m", default="smollm2", help="a profile alias, a local folder or a cached hub id")
    ap.add_argument("--profile", "-p", help="a built-in profile name or a .yaml file (default: the model's)")
    ap.add_argument("--fact", default=FACT, help="stated at the end of the first message")
    ap.add_argument("--question", default=QUESTION, help="asked after the last exchange")
    ap.add_argument("--expect", default=EXPECT, help="the answer is found if it holds this text")
    ap.add_argument("--control", action="store_true",
                    help="also ask the plain model with the whole conversation in its context (when it fits): "
                         "whether the model reads the fact at all, memory aside")
    ap.add_argument("--prefix", default="Here is more of the text: ",
                    help="what each message after the first starts with (the same in every one: their events "
                         "are alike; '' for none)")
    ap.add_argument("--reread", action="store_true",
                    help="also answer the last question as `emllm chat --reread` does (`app.reread`), not "
                         "remembered, before the usual answer (which is remembered)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="for every answer (greedy otherwise)")
    a = ap.parse_args()
    path = Path(a.store)
    shutil.rmtree(path, ignore_errors=True)
    src = models.resolve(a.model, a.profile)
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
        talk.say_all(" ".join(text[-90:]) + " " + a.fact, **opts)
        for i in range(a.exchanges - 1):
            words = text[(i * 90) % (len(text) - 90):][:90]
            talk.say_all(a.prefix + " ".join(words), **opts)
            if (i + 1) % 10 == 0:
                with Store.open(path) as s:
                    print(f"{i + 2} exchanges, {s.manifest['rows']['tokens']} tokens, {time.perf_counter() - t0:.0f} s", flush=True)
        reread = None
        if a.reread:  # asked first and forgotten, so that both answers see the same store
            talk.remember, talk.reread = False, True
            reread = talk.say_all(a.question, **opts)
            reread_passages = talk.last_passages
            talk.remember, talk.reread = True, False
        answer = talk.say_all(a.question, **opts)
    with Store.open(path) as s:
        tokens, events = s.manifest["rows"]["tokens"], s.manifest["rows"]["events"]
        ids = s.tokens.read().tolist() + pending_tokens(s)  # (a short conversation may have committed no chunk)
        at = fact_position(ids, tok, a.fact, a.expect)
        report = retrieval_report(s, model, tok, a.question, top=events)  # every event: the fact's rank however low
        control = plain_answer(s, model, tok, a.question) if a.control else None
    spans = [(r, e) for r, e in enumerate(report["top_events"]) if e["tokens"][0] <= at < e["tokens"][1]]
    layers, rank = (spans[0][1]["layers"], spans[0][0] + 1) if spans else (0, None)
    # events selected by more layers than the fact's, among them those of the messages' common prefix
    above = report["top_events"][: rank - 1] if rank else []
    prefix_above = sum(1 for e in above if a.prefix.strip() and a.prefix.strip()[:12] in e["preview"])
    in_window = at >= report["window_start"] or at < report["initial_tokens"]
    # A model that repeats the fact in its replies keeps it in later turns, the window's too: the
    # answer then says nothing of the memory. (The stream ends with the remembered answer: not counted.)
    count = lambda t: t.lower().count(a.expect.lower())  # noqa: E731
    mentions = count(tok.decode(ids)) - count(answer)
    in_window_mentions = count(tok.decode(ids[report["window_start"]:])) - count(answer)
    row = {"exchanges": a.exchanges, "prefix": a.prefix, "repetition_penalty": a.repetition_penalty, "tokens": tokens, "events": events, "fact_at": at, "answer": answer,
           "fact": a.fact, "question": a.question, "found": a.expect.lower() in answer.lower(), "fact_event_layers": layers, "fact_event_rank": rank, "prefix_events_above": prefix_above, "fact_in_window_or_initial": in_window, "expect_mentions": mentions, "expect_in_window": in_window_mentions,
           "seconds": round(time.perf_counter() - t0, 1)}
    if reread is not None:
        row.update(reread_answer=reread, reread_found=a.expect.lower() in reread.lower(),
                   reread_read_fact=any(s0 <= at < s1 for s0, s1 in reread_passages),
                   reread_passages=len(reread_passages))
    if control is not None:
        row.update(control_answer=control, control_found=a.expect.lower() in control.lower())
    print(json.dumps(row))
    if in_window_mentions > 0:
        print(f"warning: {a.expect!r} is in the window at the question ({in_window_mentions} times: the model's "
              "replies repeat it): the answer does not measure the memory; try another --prefix", flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps({"date": time.strftime("%Y-%m-%d"), **row}) + "\n")


def fact_position(ids: list[int], tok, fact: str, expect: str) -> int:
    """Stream position of `expect`'s first token where the first message that ends with `fact`
    states it (a message's last sentence follows a space). Looked for inside the fact: the answer's
    own first token may be common ("4721" starts with a bare space token in SmolLM2's vocabulary)."""
    f = tok.encode(" " + fact, add_special_tokens=False)
    e = tok.encode(" " + expect, add_special_tokens=False)
    start = next(i for i in range(len(ids) - len(f) + 1) if ids[i : i + len(f)] == f)
    return start + next(j for j in range(len(f) - len(e) + 1) if f[j : j + len(e)] == e)


def plain_answer(st: Store, model, tok, question: str, max_new_tokens: int = 16) -> str | None:
    """The plain model's greedy answer to `question` after the store's whole stream, as one
    context (the same token ids emllm reads); None when that exceeds the model's context."""
    import torch

    session = Session(st, model, tok)
    ids = st.tokens.read().tolist() + session.tail + session.question_ids(question)
    if len(ids) + max_new_tokens > model.config.max_position_embeddings:
        return None
    model.set_attn_implementation("sdpa")
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=sorted(stop_token_ids(tok, model)))
    return tok.decode(out[0, len(ids):], skip_special_tokens=True).strip()


if __name__ == "__main__":
    main()
