"""RULER-style long-context tasks (Hsieh et al., 2024), generated deterministically over a tokenizer.

Same shape as `emllm.evals.passkey`: every generator is `build(tok, length, depth, rng) -> Prompt`, with
the document (instructions + haystack with the needles: the stream to ingest) and the question
(its own chunk, ending with the answer prefix) as token-id lists, plain text without a chat
template. `len(document) + len(question)` equals `length` (unless `length` is smaller than the
fixed parts). Scoring is RULER's `string_match_all`: the share of the expected values that the
answer contains, case-insensitively.

Tasks (`TASKS`):

- `niah_single_words` / `niah_single_numbers` / `niah_single_uuids`: one needle
  "One of the special magic {kind} for {key} is: {value}." at `depth`, asked for by its key.
- `niah_multikey`: four needles with different keys (the asked one at `depth`, the others at
  random places), one key asked.
- `niah_multivalue`: four needles with the same key and different values (the first at `depth`,
  the others at random places), all values asked.
- `vt`: variable tracking: a chain `VAR A = 12345`, `VAR B = VAR A`, ... (4 hops) spread over the
  document in order, plus `distractor` chains with other values; asked: every variable equal to
  the chain's value.

Haystacks: the passkey filler ("noise") or essay-like sentences generated from the rng ("essay"),
RULER's kinds; or real text from `emllm.evals.corpus` ("prose": library documentation, "code":
Python sources), from a random place on, where repeated filler would hide hub events (every event
alike).
Needles sit on sentence borders. The rng alone decides everything, so a prompt depends only on the
seed string the caller builds (`random.Random(f"{seed}/{task}/{length}/{sample}")`).
"""

from __future__ import annotations

import dataclasses
import random
import string
import uuid
from dataclasses import dataclass, field
from typing import Callable

from emllm.evals import corpus
from emllm.evals.passkey import FILLER, _stop_ids
from emllm.evals.recall import RecallProbe, needle_recall

# -- vocabularies (disjoint: no key or value word occurs in the essay filler or the templates) ---------------

KEY_ADJECTIVES = (
    "amber", "brisk", "cobalt", "dusky", "elated", "fabled", "gilded", "hollow", "ivory", "jagged",
    "kindly", "lunar", "mellow", "nimble", "opaline", "placid", "quaint", "rustic", "scarlet", "tawny",
    "umber", "velvet", "wistful", "zesty",
)
KEY_NOUNS = (
    "badger", "cactus", "dolphin", "falcon", "gazelle", "heron", "iguana", "jackal", "kestrel", "lobster",
    "marmot", "narwhal", "ocelot", "panther", "quokka", "raccoon", "salmon", "tortoise", "walrus", "yak",
)
VALUE_WORDS = (
    "accordion", "barometer", "carburetor", "dulcimer", "escalator", "flamingo", "gondola", "harmonica",
    "igloo", "jukebox", "kaleidoscope", "lantern", "marimba", "nectarine", "origami", "periscope",
    "quesadilla", "rickshaw", "saxophone", "trombone", "ukulele", "vermicelli", "wheelbarrow", "xylophone",
    "zeppelin", "pretzel", "bagpipe", "cinnamon", "dandelion", "tambourine",
)

_E_SUBJECTS = (
    "the history of cities", "most good ideas", "a careful reader", "the best teachers", "every small company",
    "an honest critic", "the modern school", "a new habit", "the average office", "young writers",
    "the typical startup", "a patient builder", "many old books", "the quiet student", "the wider public",
    "a thoughtful editor", "the early internet", "most ambitious people", "a growing town", "the local library",
)
_E_VERBS = (
    "suggested", "showed", "reminded us", "implied", "taught us", "made it clear", "hinted", "proved",
    "told us", "revealed",
)
_E_CLAUSES = (
    "that patient work often matters more than talent", "that curiosity is worth more than certainty",
    "that simple plans tend to survive longer", "that the obvious answer is sometimes wrong",
    "that good questions are harder to find than good answers", "that habits shape what we notice",
    "that people learn fastest when they are a little confused", "that clear writing follows clear thinking",
    "that most progress looks boring from the inside", "that taste can be learned slowly",
    "that the right problem is half of the solution", "that small groups move faster than large ones",
    "that trust is built over many ordinary days", "that a good draft is rarely the first one",
    "that attention is the scarcest thing we own", "that luck favours those who keep trying",
    "that rules written long ago still guide us", "that the future arrives unevenly",
    "that practice beats planning more often than not", "that the hardest part is getting started",
)
_E_TAILS = (
    "", "", "", " in the long run", " more than we admit", " if we look closely", " year after year",
    " even when nobody is watching", " in surprising ways", " for better or worse",
)
_E_OPENERS = ("", "", "", "In practice, ", "Over time, ", "Of course, ", "Still, ", "Perhaps ", "Often ")

INTRO = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n"
)
NEEDLE = "One of the special magic {kind} for {key} is: {value}. "
QUERY_ONE = "What is the special magic {kind_one} for {key} mentioned in the provided text?"
QUERY_ALL = "What are all the special magic {kind} for {key} mentioned in the provided text?"
PREFIX_ONE = "The special magic {kind_one} for {key} mentioned in the provided text is"
PREFIX_ALL = "The special magic {kind} for {key} mentioned in the provided text are"
# The same questions in other words: only the key and the kind's noun (singular where the needle's is
# plural) are shared with the needle, so a retrieval by the question's words alone has the key to go on
PARA_ONE = "Earlier on, a {kind_one} was tied to {key}. Which {kind_one} was it?"
PARA_ALL = "Earlier on, several {kind} were tied to {key}. Which were they?"
PARA_PREFIX_ONE = "The {kind_one} tied to {key} was"
PARA_PREFIX_ALL = "The {kind} tied to {key} were"
# ... and in words none of which the needle's sentence has, not even the key or the kind's noun
# (a synonym stands for it): only a task with one needle, or one key, can be asked so
BLIND_ONE = "Somewhere earlier, a {kind_one} was slipped into this text. Which {kind_one} was it?"
BLIND_ALL = "Somewhere earlier, several {kind} were slipped into this text. Which were they?"
BLIND_PREFIX_ONE = "That {kind_one} was"
BLIND_PREFIX_ALL = "Those {kind} were"
SYNONYMS = {"words": ("terms", "term"), "numbers": ("figures", "figure"), "uuids": ("identifiers", "identifier")}

VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUERY = "Question: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
    "assigned the value {value}, they are:"
)

HAYSTACKS_REAL = ("prose", "code", "chat")  # emllm.evals.corpus: text nobody here wrote
HAYSTACKS = ("noise", "essay") + HAYSTACKS_REAL
KINDS = {"words": ("words", "word"), "numbers": ("numbers", "number"), "uuids": ("uuids", "uuid")}


@dataclass(frozen=True)
class Prompt:
    task: str
    document: list[int]  # instructions + haystack with the needles: the stream to ingest
    question: list[int]  # question and answer prefix: its own chunk
    answers: list[str]  # every one must be in the answer (string_match_all)
    query: str  # the bare question (what a retriever searches with)
    needles: list[tuple[int, int]]  # token spans [start, end) of every inserted needle in `document`
    targets: list[int]  # indices into `needles` of those holding the answers
    head: int  # tokens of instructions at the start of `document`
    depth: float
    max_new_tokens: int = 32
    meta: dict = field(default_factory=dict)

    @property
    def needle_at(self) -> int:
        """Token position of the first asked needle."""
        return self.needles[self.targets[0]][0]

    @property
    def digest(self) -> str:
        """12 hex digits of the document's and the question's token ids: two results are of the same
        prompt only where these match (before the corpus snapshot, the code and prose haystacks were
        the running Python's own sources: a machine with another version built another prompt)."""
        import hashlib

        ids = self.document + [-1] + self.question
        return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:12]

    @property
    def key(self) -> str:  # passkey-compatible field for code that prints one
        return ",".join(self.answers)

    def score(self, answer: str) -> float:
        return score(answer, self.answers)


def score(answer: str, answers: list[str]) -> float:
    """RULER string_match_all: the share of `answers` contained in `answer`, case-insensitively."""
    if not answers:
        return 0.0
    a = answer.lower()
    return sum(r.lower() in a for r in answers) / len(answers)


def score_part(answer: str, answers: list[str]) -> float:
    """RULER string_match_part: 1 if any of `answers` is contained in `answer`."""
    a = answer.lower()
    return float(any(r.lower() in a for r in answers))


# -- values ------------------------------------------------------------------------------------------

def _key_word(rng: random.Random, taken: set[str]) -> str:
    while True:
        k = f"{rng.choice(KEY_ADJECTIVES)}-{rng.choice(KEY_NOUNS)}"
        if k not in taken:
            taken.add(k)
            return k


def _value(kind: str, rng: random.Random, taken: set[str]) -> str:
    while True:
        if kind == "numbers":
            v = str(rng.randint(1_000_000, 9_999_999))
        elif kind == "uuids":
            v = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        else:
            v = rng.choice(VALUE_WORDS)
        if v not in taken:
            taken.add(v)
            return v


# -- haystacks ---------------------------------------------------------------------------------------

def essay_sentence(rng: random.Random) -> str:
    s = (f"{rng.choice(_E_OPENERS)}{rng.choice(_E_SUBJECTS)} {rng.choice(_E_VERBS)} "
         f"{rng.choice(_E_CLAUSES)}{rng.choice(_E_TAILS)}. ")
    return s[0].upper() + s[1:]


class _Haystack:
    """Sentences as token lists, exactly `n` tokens in all (the last one cut), needles between them."""

    def __init__(self, tok, n: int, kind: str, rng: random.Random) -> None:
        enc = _encoder(tok)
        self.sents: list[list[int]] = []
        total = 0
        if kind == "noise":
            unit = enc(FILLER)
            while total < n:
                self.sents.append(unit)
                total += len(unit)
        elif kind in HAYSTACKS_REAL:  # real text from a random place on, sentence by sentence (lines of code)
            units = corpus.units(kind)
            i = rng.randrange(len(units))
            while total < n:
                ids = enc(units[i % len(units)])
                self.sents.append(ids)
                total += len(ids)
                i += 1
        else:
            cache: dict[str, list[int]] = {}
            while total < n:
                s = essay_sentence(rng)
                ids = cache.get(s) or cache.setdefault(s, enc(s))
                self.sents.append(ids)
                total += len(ids)
        if total > n:  # cut the last sentence so the haystack has exactly n tokens
            self.sents[-1] = self.sents[-1][: len(self.sents[-1]) - (total - n)]
            if not self.sents[-1]:
                self.sents.pop()
        self.n = n
        # needles go before sentence i, i in [0, full]; the cut sentence stays last
        self.full = len(self.sents) - (1 if total > n and self.sents else 0)

    def slot(self, depth: float) -> int:
        return min(self.full, max(0, round(depth * self.full)))

    def random_slots(self, rng: random.Random, k: int) -> list[int]:
        return [rng.randint(0, self.full) for _ in range(k)]

    def assemble(self, head: list[int], inserts: list[tuple[int, list[int]]]) -> tuple[list[int], list[tuple[int, int]]]:
        """inserts: (slot, needle ids) in the order they should appear at equal slots. Returns
        the document and the needles' spans in the order of `inserts`."""
        order = sorted(range(len(inserts)), key=lambda j: (inserts[j][0], j))
        doc = list(head)
        spans: list[tuple[int, int] | None] = [None] * len(inserts)
        nxt = 0
        for i, sent in enumerate(self.sents + [[]]):
            while nxt < len(order) and inserts[order[nxt]][0] == i:
                ids = inserts[order[nxt]][1]
                spans[order[nxt]] = (len(doc), len(doc) + len(ids))
                doc.extend(ids)
                nxt += 1
            doc.extend(sent)
        return doc, spans  # type: ignore[return-value]


def _encoder(tok) -> Callable[[str], list[int]]:
    return lambda s: tok(s, add_special_tokens=False)["input_ids"]


# -- needle tasks ------------------------------------------------------------------------------------

# Tokens a needle task's answer may take: RULER's generator gives its needle tasks 128
# (`tokens_to_generate`); fewer cut a small model that repeats the question before the value.
NIAH_NEW_TOKENS = 128

def _niah(tok, length: int, depth: float, rng: random.Random, *, task: str, kind: str, haystack: str,
          n_keys: int = 1, n_values: int = 1, max_new_tokens: int = NIAH_NEW_TOKENS) -> Prompt:
    enc = _encoder(tok)
    kinds, kind_one = KINDS[kind]
    taken_k: set[str] = set()
    taken_v: set[str] = set()
    keys = [_key_word(rng, taken_k) for _ in range(n_keys)]
    values = [[_value(kind, rng, taken_v) for _ in range(n_values)] for _ in keys]
    asked = 0  # the first key is the one asked for
    needles = [(keys[i], v) for i in range(n_keys) for v in values[i]]
    needle_ids = [enc(NEEDLE.format(kind=kinds, key=k, value=v)) for k, v in needles]
    head = enc(INTRO.format(kind=kinds))
    if n_values > 1:
        query = QUERY_ALL.format(kind=kinds, key=keys[asked])
        prefix = PREFIX_ALL.format(kind=kinds, key=keys[asked])
    else:
        query = QUERY_ONE.format(kind_one=kind_one, key=keys[asked])
        prefix = PREFIX_ONE.format(kind_one=kind_one, key=keys[asked])
    question = enc("\n" + query) + enc("\n" + prefix)
    n_hay = max(0, length - len(head) - sum(map(len, needle_ids)) - len(question))
    hay = _Haystack(tok, n_hay, haystack, rng)
    others = hay.random_slots(rng, len(needles) - 1)
    slots = [hay.slot(depth)] + others  # needle 0 (asked key, first value) at the requested depth
    document, spans = hay.assemble(head, list(zip(slots, needle_ids)))
    targets = [j for j, (k, _) in enumerate(needles) if k == keys[asked]]
    return Prompt(task, document, question, list(values[asked]), query, spans, targets, len(head), depth,
                  max_new_tokens, {"keys": keys, "values": values, "kind": kind})


def paraphrased(prompt: Prompt, tok, shared: str = "key") -> Prompt:
    """`prompt` (a needle task's) with its question asked in other words: the same document,
    needles and answers. `shared="key"` (PARA_*): only the key and the kind's noun are the
    needle's words; `shared="none"` (BLIND_*): none of the needle's words, the kind named by a
    synonym, which only a prompt whose needles all answer it (one key) can be asked."""
    if "kind" not in prompt.meta:
        raise ValueError(f"{prompt.task}: only the needle tasks' questions have a paraphrase")
    if shared not in ("key", "none"):
        raise ValueError(f"shared: 'key' or 'none', not {shared!r}")
    enc = _encoder(tok)
    key = prompt.meta["keys"][0]  # the asked key (`_niah`)
    if shared == "none":
        if len(prompt.meta["keys"]) > 1:
            raise ValueError(f"{prompt.task}: its needles have several keys; without the key the question is ambiguous")
        kinds, kind_one = SYNONYMS[prompt.meta["kind"]]
        templates = (BLIND_ALL, BLIND_PREFIX_ALL) if len(prompt.answers) > 1 else (BLIND_ONE, BLIND_PREFIX_ONE)
    else:
        kinds, kind_one = KINDS[prompt.meta["kind"]]
        templates = (PARA_ALL, PARA_PREFIX_ALL) if len(prompt.answers) > 1 else (PARA_ONE, PARA_PREFIX_ONE)
    query, prefix = (t.format(kind=kinds, kind_one=kind_one, key=key) for t in templates)
    return dataclasses.replace(prompt, question=enc("\n" + query) + enc("\n" + prefix), query=query)


def niah_single_words(tok, length: int, depth: float, rng: random.Random, haystack: str | None = None) -> Prompt:
    return _niah(tok, length, depth, rng, task="niah_single_words", kind="words", haystack=haystack or "essay")


def niah_single_numbers(tok, length: int, depth: float, rng: random.Random, haystack: str | None = None) -> Prompt:
    return _niah(tok, length, depth, rng, task="niah_single_numbers", kind="numbers", haystack=haystack or "noise")


def niah_single_uuids(tok, length: int, depth: float, rng: random.Random, haystack: str | None = None) -> Prompt:
    return _niah(tok, length, depth, rng, task="niah_single_uuids", kind="uuids", haystack=haystack or "essay")


def niah_multikey(tok, length: int, depth: float, rng: random.Random, haystack: str | None = None) -> Prompt:
    return _niah(tok, length, depth, rng, task="niah_multikey", kind="numbers", haystack=haystack or "essay", n_keys=4)


def niah_multivalue(tok, length: int, depth: float, rng: random.Random, haystack: str | None = None) -> Prompt:
    return _niah(tok, length, depth, rng, task="niah_multivalue", kind="numbers", haystack=haystack or "essay", n_values=4)


# -- variable tracking -------------------------------------------------------------------------------

def _var_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if v not in taken:
            taken.add(v)
            return v


def vt(tok, length: int, depth: float, rng: random.Random, haystack: str | None = None, hops: int = 4,
       distractors: int = 1) -> Prompt:
    """Variable tracking. The asked chain's first statement sits at `depth`, its later hops at
    random places after it; distractor chains (other values) anywhere, each in its own order."""
    enc = _encoder(tok)
    names: set[str] = set()
    values: set[str] = set()
    chains = []
    for _ in range(1 + distractors):
        val = str(rng.randint(10000, 99999))  # 5-digit values as in RULER
        while val in values:
            val = str(rng.randint(10000, 99999))
        values.add(val)
        chains.append((val, [_var_name(rng, names) for _ in range(hops + 1)]))
    statements: list[list[str]] = []
    for val, vs in chains:
        st = [f"VAR {vs[0]} = {val}. "] + [f"VAR {vs[i]} = VAR {vs[i - 1]}. " for i in range(1, len(vs))]
        statements.append(st)
    head = enc(VT_INTRO)
    val0, vars0 = chains[0]
    query = VT_QUERY.format(value=val0)
    question = enc("\n" + query) + enc("\n" + VT_PREFIX.format(n=len(vars0), value=val0))
    st_ids = [[enc(s) for s in st] for st in statements]
    n_fixed = sum(len(x) for st in st_ids for x in st)
    n_hay = max(0, length - len(head) - n_fixed - len(question))
    hay = _Haystack(tok, n_hay, haystack or "noise", rng)
    inserts: list[tuple[int, list[int]]] = []
    first = hay.slot(depth)
    later = sorted(rng.randint(first, hay.full) for _ in range(hops))
    for slot, ids in zip([first] + later, st_ids[0]):
        inserts.append((slot, ids))
    for st in st_ids[1:]:
        for slot, ids in zip(sorted(hay.random_slots(rng, len(st))), st):
            inserts.append((slot, ids))
    document, spans = hay.assemble(head, inserts)
    return Prompt("vt", document, question, list(vars0), query, spans, list(range(hops + 1)), len(head), depth,
                  30, {"chains": [[v, list(vs)] for v, vs in chains]})


TASKS: dict[str, Callable[..., Prompt]] = {
    "niah_single_words": niah_single_words,
    "niah_single_numbers": niah_single_numbers,
    "niah_single_uuids": niah_single_uuids,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "vt": vt,
}


def needle_only(prompt: Prompt) -> Prompt:
    """The prompt with its haystack removed: the instructions, the asked needles (in document
    order) and the question. What the plain model answers from it says whether the model can read
    the task at all, whatever a memory retrieves."""
    keep = sorted(prompt.needles[j] for j in prompt.targets)
    doc = list(prompt.document[: prompt.head])
    spans = []
    for s, e in keep:
        spans.append((len(doc), len(doc) + e - s))
        doc.extend(prompt.document[s:e])
    return dataclasses.replace(prompt, document=doc, needles=spans, targets=list(range(len(spans))))


def build_prompt(task: str, tok, length: int, depth: float, rng: random.Random, haystack: str | None = None) -> Prompt:
    """haystack: one of HAYSTACKS instead of the task's own (RULER's: noise or essay)."""
    try:
        gen = TASKS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}: one of {', '.join(TASKS)}") from None
    if haystack is not None and haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}: one of {', '.join(HAYSTACKS)}")
    return gen(tok, length, depth, rng, haystack=haystack)


def read_prompt(eng, prompt: Prompt, progress: Callable | None = None) -> RecallProbe:
    """Feed the document, then the question as its own chunk (`begin_question`); returns the probe
    that recorded every layer's retrieval at the question (`evals.recall`)."""
    eng.feed(prompt.document, progress=progress)
    probe = RecallProbe(eng)
    eng.begin_question()
    eng.feed(prompt.question)
    probe.detach()
    return probe


def run_task(engine_factory: Callable[[], object], tok, prompt: Prompt, max_new_tokens: int | None = None,
             progress: Callable | None = None, recall: list | None = None, reread: bool = False) -> str:
    """emllm: ingest the document, feed the question as its own chunk, generate greedily.
    recall: a list to extend with every needle's `evals.recall.NeedleRecall` at the question.
    reread: answer by re-reading the passages the memory chose (`app.reread`)."""
    n_new = max_new_tokens or prompt.max_new_tokens
    eng = engine_factory()
    if reread:
        from emllm.app.reread import reread as reread_passages

        eng.feed(prompt.document, progress=progress)
        probe = RecallProbe(eng)
        answering, _ = reread_passages(eng, prompt.question, tok, n_new)
        probe.detach()
    else:
        probe = read_prompt(eng, prompt, progress)
        answering = eng
    if recall is not None:
        recall.extend(needle_recall(eng, probe, prompt.needles))
    out = answering.generate(n_new, stop_ids=set(_stop_ids(tok, eng.model)))
    return tok.decode(out, skip_special_tokens=True)


@dataclass
class BothAnswers:
    """emllm's own answer and the re-read's, from one read of a prompt; the seconds of the read
    (document and question), of the own answer and of the re-read (its context chosen, read, answered)."""

    own: str
    reread: str
    read_s: float
    own_s: float
    reread_s: float


def run_task_both(engine_factory: Callable[[], object], tok, prompt: Prompt, max_new_tokens: int | None = None,
                  progress: Callable | None = None, recall: list | None = None) -> BothAnswers:
    """`run_task`'s answer and `run_task(reread=True)`'s from one read of the prompt: the re-read
    chooses its passages from the selections the question's own read made (the same selections
    `reread` records: a read of the question after `begin_question`), so each answer equals its
    own run's, at the cost of one read."""
    import time

    from emllm.app.reread import SelectionRecorder, read_again, reread_context, reread_room

    n_new = max_new_tokens or prompt.max_new_tokens
    t0 = time.perf_counter()
    eng = engine_factory()
    eng.feed(prompt.document, progress=progress)
    probe = RecallProbe(eng)
    rec = SelectionRecorder(eng)
    try:
        eng.begin_question()
        eng.feed(prompt.question)
    finally:
        rec.detach()
        probe.detach()
    if recall is not None:
        recall.extend(needle_recall(eng, probe, prompt.needles))
    t1 = time.perf_counter()
    stops = set(_stop_ids(tok, eng.model))
    own = tok.decode(eng.generate(n_new, stop_ids=stops), skip_special_tokens=True)
    t2 = time.perf_counter()
    n = len(prompt.document)
    rr = reread_context(eng, rec.votes(), tok, n, reread_room(eng.profile, n, len(prompt.question)), prompt.question)
    reader = read_again(eng.model, eng.profile, rr.ids, prompt.question, n_new)
    again = tok.decode(reader.generate(n_new, stop_ids=stops), skip_special_tokens=True)
    t3 = time.perf_counter()
    return BothAnswers(own, again, t1 - t0, t2 - t1, t3 - t2)


__all__ = ["TASKS", "HAYSTACKS", "BothAnswers", "needle_only", "paraphrased", "Prompt", "build_prompt", "read_prompt", "run_task",
           "run_task_both", "score", "score_part", "essay_sentence"]
