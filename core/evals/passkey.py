"""The passkey retrieval test (∞-Bench style, spec §7): a 5-digit key hidden at a given depth in
a haystack of filler, asked for at the end, scored by the first integer of the answer.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass
from typing import Callable, Collection

import torch

from emllm.errors import UsageError
from emllm.models import cache_kwargs, input_device, leading_ids
from emllm.evals.recall import RecallProbe, needle_recall

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n\n"
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key?"
ANSWER_PREFIX = "The pass key is"


@dataclass(frozen=True)
class Prompt:
    document: list[int]  # intro + haystack with the needle: the stream to ingest
    question: list[int]  # question, end of the user turn, start of the answer: its own chunk
    key: str
    needle_at: int  # token position of the needle in `document`
    needle_len: int = 0  # its tokens

    @property
    def needles(self) -> list[tuple[int, int]]:
        """The needle's token span [start, end) in `document` (as the RULER prompts give theirs)."""
        return [(self.needle_at, self.needle_at + self.needle_len)]


@dataclass
class TrialResult:
    length: int
    depth: float
    trial: int
    key: str
    answer: str
    correct: bool
    method: str  # "emllm", "reread" (`ask --reread` from emllm's same read) or "baseline"
    seconds: float
    tokens: int
    # Of the document, read by a trunk shared with other trials (emllm.evals.scratch.TrunkStores): in the
    # seconds of the first trial that needed them only.
    trunk_tokens: int = 0
    # Of the document, read by an earlier process whose store this trial continued (resumed grid).
    resumed_tokens: int = 0
    # emllm only (evals.recall): where the needle was at the question ("memory", "window", "init"),
    # the share of layers whose selection held it, and its best rank per layer (memory only)
    needle_where: str | None = None
    needle_layers: float | None = None
    needle_ranks: list[int] | None = None
    # reread only: whether the tokens read again (initial tokens and passages) held the whole needle, and how many
    needle_read: bool | None = None
    reread_tokens: int | None = None


MAX_LENGTH = 1 << 30  # tokens: a haystack past this would not fit in memory to build, nor in a day to read


def parse_length(text: str) -> int:
    """'16k' -> 16384, '1m' -> 1048576, '1500000' -> 1500000."""
    t = text.strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    num = t[:-1] if mult != 1 else t
    try:
        value = int(float(num) * mult)
    except (ValueError, OverflowError):  # OverflowError: "inf"
        raise ValueError(f"not a length: {text!r} (use e.g. 4k, 16k, 1m or 1500000)") from None
    if value <= 0:
        raise ValueError(f"not a length: {text!r} (must be positive)")
    if value > MAX_LENGTH:
        raise ValueError(f"not a length: {text!r} (at most {MAX_LENGTH // (1 << 20)}m tokens)")
    return value


def build_prompt(tok, length: int, depth: float, rng: random.Random) -> Prompt:
    """A document + question of about `length` tokens in all, the needle at `depth` in [0, 1]."""
    key = str(rng.randint(10000, 99999))
    # The plain ∞-Bench form, no chat template: SmolLM2 fails the chat-wrapped form already at 1k,
    # which would test the template rather than the memory (docs/benchmark-log.md, passkey).
    before, after = "", "\n"
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = leading_ids(tok) + enc(before + INTRO)
    needle = enc(NEEDLE.format(key=key))
    question = enc(QUESTION) + enc(after + ANSWER_PREFIX)
    unit = enc(FILLER)
    n_hay = max(0, length - len(head) - len(needle) - len(question))
    reps = -(-n_hay // len(unit))
    hay = (unit * reps)[:n_hay]
    # Put the needle on a sentence border of the filler, at the requested depth.
    at = round(depth * (n_hay // len(unit))) * len(unit) if n_hay >= len(unit) else 0
    at = min(at, len(hay))
    document = head + hay[:at] + needle + hay[at:]
    return Prompt(document, question, key, len(head) + at, len(needle))


def shortest_prompt(tok) -> int:
    """Tokens of a passkey prompt without filler: a length below it has no haystack to hide in."""
    p = build_prompt(tok, 0, 0.0, random.Random(0))
    return len(p.document) + len(p.question)


def check_lengths(tok, lengths: Collection[int]) -> None:
    """Refuse a length too short to hold a haystack (its prompt would be longer than asked)."""
    short = shortest_prompt(tok)
    if lengths and min(lengths) < short:
        raise UsageError(f"{min(lengths)} tokens hold no haystack: a passkey prompt without filler is {short} "
                         "tokens with this model's tokenizer")


def score(answer: str, key: str) -> bool:
    m = re.search(r"\d+", answer)
    return m is not None and m.group(0) == key


def run_emllm(engine_factory: Callable[[], "object"], tok, prompt: Prompt, max_new_tokens: int = 10,
              progress: Callable | None = None, last: bool = False, recall: list | None = None,
              reread: list | None = None) -> str:
    """emllm's answer. `recall`: a list to extend with the needle's `evals.recall.NeedleRecall`;
    `reread`: a list to extend with `ask --reread`'s answer from the same read of the question, as
    (answer, tokens read again, whether they held the whole needle, seconds of the re-read)."""
    from emllm.app.reread import SelectionRecorder, read_again, reread_context, reread_room

    # A factory that shares prefixes (emllm.evals.scratch.TrunkStores) hands over an engine that has read
    # the document's whole chunks, the haystack before the needle (the same for every key and
    # depth) from its trunk; `last`: no later prompt will need that trunk.
    make = getattr(engine_factory, "engine_for", None)
    eng, k = make(prompt.document, prompt.needle_at, last=last, progress=progress) if make else (engine_factory(), 0)
    if k < len(prompt.document):
        eng.feed(prompt.document[k:], progress=progress)
    probe = RecallProbe(eng) if recall is not None else None
    rec = SelectionRecorder(eng) if reread is not None else None
    eng.begin_question()
    eng.feed(prompt.question)
    if rec is not None:
        rec.detach()
    if probe is not None:
        probe.detach()
        recall.extend(needle_recall(eng, probe, prompt.needles))
    stops = set(_stop_ids(tok, eng.model))
    out = eng.generate(max_new_tokens, stop_ids=stops)
    if reread is not None:
        t0, n = time.perf_counter(), len(prompt.document)
        rr = reread_context(eng, rec.votes(), tok, n, reread_room(eng.profile, n, len(prompt.question)),
                            question=prompt.question)
        reader = read_again(eng.model, eng.profile, rr.ids, prompt.question, max_new_tokens)
        text = tok.decode(reader.generate(max_new_tokens, stop_ids=stops), skip_special_tokens=True)
        read = torch.zeros(n, dtype=torch.bool)  # the initial tokens, then the passages
        read[: len(rr.ids) - sum(e - s for s, e in rr.passages)] = True
        for s, e in rr.passages:
            read[s:e] = True
        whole = bool(read[prompt.needle_at : prompt.needle_at + prompt.needle_len].all())
        reread.append((text, len(rr.ids), whole, time.perf_counter() - t0))
    return tok.decode(out, skip_special_tokens=True)


@torch.no_grad()
def run_baseline(model, tok, prompt: Prompt, max_new_tokens: int = 10) -> str:
    """The plain model on the prompt truncated from the left to its context."""
    model.set_attn_implementation("sdpa")
    ctx = int(getattr(model.config, "max_position_embeddings", 4096))
    lead = leading_ids(tok)  # kept at the front when the rest is cut
    body = prompt.document[len(lead):] if prompt.document[: len(lead)] == lead else prompt.document
    ids = lead + (body + prompt.question)[-(ctx - max_new_tokens - len(lead)):]
    x = torch.tensor([ids], device=input_device(model))
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=_stop_ids(tok, model), pad_token_id=tok.pad_token_id or tok.eos_token_id,
                         **_prefilled(model, x))
    return tok.decode(out[0, x.shape[1]:], skip_special_tokens=True)


PREFILL_CHUNK = 2048


@torch.no_grad()
def _prefilled(model, x: torch.Tensor) -> dict:
    """For a model with sliding-window layers, `generate`'s cache with all of x [1, n] but its last
    token read in chunks: one pass over the whole prompt would compute every sliding layer's
    attention over all n² pairs, of which it keeps a window's width (several times slower on a
    32k prompt); chunked, those layers attend within their window, as the model does. Other
    models read the prompt in one pass, as `generate` does ({})."""
    from transformers import DynamicCache

    from emllm.engine.stream import sliding_layers

    if not any(sliding_layers(model.config)) or x.shape[1] <= PREFILL_CHUNK:
        return {}
    kw = cache_kwargs(model, DynamicCache(config=model.config))
    for s in range(0, x.shape[1] - 1, PREFILL_CHUNK):
        model(input_ids=x[:, s : min(s + PREFILL_CHUNK, x.shape[1] - 1)], **kw, use_cache=True, logits_to_keep=1)
    return kw


def _stop_ids(tok, model) -> list[int]:
    from emllm.models import stop_token_ids

    return stop_token_ids(tok, model)


def read_plan(lengths: list[int], depths: list[float], trials: int, shared: bool) -> dict[tuple[int, float, int], int]:
    """(length, depth, trial) -> about how many tokens emllm reads for that trial: its whole
    document; or, with a factory that shares the filler before the needles (`shared`), what
    follows its needle and what the shared filler grows by for it (the trials run in the order of
    their needles). For progress and its ETA: the needle is taken at depth x length."""
    cells = sorted(((n * d, n, d, t) for n in lengths for d in depths for t in range(trials)), key=lambda c: c[0])
    plan, trunk = {}, 0.0
    for at, n, d, t in cells:
        plan[(n, d, t)] = n if not shared else round(n - at + max(0.0, at - trunk))
        trunk = max(trunk, at)
    return plan


def run_grid(
    model, tok, engine_factory, lengths: list[int], depths: list[float], trials: int, seed: int,
    baseline: bool = False, on_result: Callable[[TrialResult], None] | None = None,
    progress: Callable | None = None, first_trial: int = 0, skip: Collection[tuple[int, float, int, str]] = (),
    reread: bool = False,
) -> list[TrialResult]:
    """Every (length, depth, trial) cell; the key and prompt depend only on (seed, length, depth, trial),
    so a grid can be extended later with `first_trial` without repeating a prompt, or resumed
    with `skip`: the (length, depth, trial, method) cells answered already.

    `reread`: also `ask --reread`'s answer, from emllm's read of the same prompt (its seconds: that
    read and the re-read).

    With a factory that shares prefixes, cells run in the order of their needle's position (all
    haystacks begin with the same filler), so the filler before the needles is read once."""
    check_lengths(tok, lengths)
    results = []
    methods = ["emllm"] + (["reread"] if reread else []) + (["baseline"] if baseline else [])
    cells = [(length, depth, t, build_prompt(tok, length, depth, random.Random(f"{seed}/{length}/{depth}/{t}")))
             for length in lengths for depth in depths for t in range(first_trial, first_trial + trials)]
    if hasattr(engine_factory, "engine_for"):
        cells.sort(key=lambda c: c[3].needle_at)
    todo = [(c, [m for m in methods if (c[0], c[1], c[2], m) not in skip]) for c in cells]
    todo = [(c, ms) for c, ms in todo if ms]
    reads = lambda ms: [m for m in ms if m != "baseline"]  # noqa: E731 - emllm's read answers both
    last_read = max((i for i, (_, ms) in enumerate(todo) if reads(ms)), default=-1)
    counts = lambda: (getattr(engine_factory, "shared_tokens", 0), getattr(engine_factory, "resumed_tokens", 0))  # noqa: E731

    def emit(r: TrialResult) -> None:
        results.append(r)
        if on_result:
            on_result(r)

    for i, ((length, depth, t, prompt), ms) in enumerate(todo):
        tokens = len(prompt.document) + len(prompt.question)
        if reads(ms):
            t0, (shared, resumed) = time.perf_counter(), counts()
            found: list = []
            again: list | None = [] if "reread" in ms else None
            answer = run_emllm(engine_factory, tok, prompt, progress=progress, last=i == last_read, recall=found,
                               reread=again)
            secs = time.perf_counter() - t0
            trunk = dict(trunk_tokens=counts()[0] - shared, resumed_tokens=counts()[1] - resumed)
            held = ({"needle_where": found[0].where, "needle_layers": round(found[0].share, 4),
                     "needle_ranks": found[0].ranks} if found else {})
            if "emllm" in ms:
                spent = secs - (again[0][3] if again else 0.0)
                emit(TrialResult(length, depth, t, prompt.key, answer.strip(), score(answer, prompt.key), "emllm",
                                 round(spent, 2), tokens, **trunk, **held))
            if again:
                text, n_read, whole, _ = again[0]
                emit(TrialResult(length, depth, t, prompt.key, text.strip(), score(text, prompt.key), "reread",
                                 round(secs, 2), tokens, **trunk, **held, needle_read=whole, reread_tokens=n_read))
        if "baseline" in ms:
            t0 = time.perf_counter()
            answer = run_baseline(model, tok, prompt)
            emit(TrialResult(length, depth, t, prompt.key, answer.strip(), score(answer, prompt.key), "baseline",
                             round(time.perf_counter() - t0, 2), tokens))
    return results


__all__ = ["build_prompt", "read_plan", "run_grid", "parse_length", "score", "TrialResult", "asdict"]
