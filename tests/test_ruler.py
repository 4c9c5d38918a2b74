"""RULER-style task generators (core/evals/ruler.py) and the RAG baseline's chunking/retrieval (core/evals/rag.py).
Tokenizer only (SmolLM2's); the one model forward is the small sentence embedder."""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest

from emllm.evals import ruler
from emllm.evals.rag import build_context, chunk_spans, prompt_budget, sentence_ends
from emllm.evals.ruler import TASKS, build_prompt, score

NIAH = [t for t in TASKS if t.startswith("niah")]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from emllm import models
    return AutoTokenizer.from_pretrained(models.resolve("smollm2").path, local_files_only=True)


@pytest.mark.parametrize("task", list(TASKS))
def test_deterministic_by_seed(tok, task):
    a = build_prompt(task, tok, 1500, 0.4, random.Random("s/1"))
    b = build_prompt(task, tok, 1500, 0.4, random.Random("s/1"))
    c = build_prompt(task, tok, 1500, 0.4, random.Random("s/2"))
    assert (a.document, a.question, a.answers, a.needles) == (b.document, b.question, b.answers, b.needles)
    assert a.answers != c.answers and a.document != c.document
    # the digest recorded beside results: the same prompt, the same digest; another, another
    assert a.digest == b.digest != c.digest and len(a.digest) == 12
    assert replace(a, question=a.question[:-1]).digest != a.digest
    assert replace(a, document=a.document + a.question[:1], question=a.question[1:]).digest != a.digest


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [700, 3000, 9000])
def test_length(tok, task, length):
    p = build_prompt(task, tok, length, 0.5, random.Random(length))
    assert abs(len(p.document) + len(p.question) - length) <= 4
    assert tok.decode(p.question).rstrip().endswith(("is", "are", "they are:"))
    assert 0 < p.head < p.needles[0][0] + 1
    # the answer's room as RULER's generator gives it (tokens_to_generate): 128 a needle task, 30 vt
    assert p.max_new_tokens == (30 if task == "vt" else ruler.NIAH_NEW_TOKENS) and ruler.NIAH_NEW_TOKENS == 128


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.8, 1.0])
def test_needle_at_depth(tok, task, depth):
    p = build_prompt(task, tok, 4000, depth, random.Random(7))
    n_hay = len(p.document) - p.head - sum(e - s for s, e in p.needles)
    # needles sit on sentence borders: within about a filler sentence of the requested depth
    before = p.needle_at - p.head - sum(e - s for s, e in p.needles if s < p.needle_at)
    assert abs(before - depth * n_hay) <= 40
    # the spans hold the needles' text
    for j, (s, e) in enumerate(p.needles):
        text = tok.decode(p.document[s:e])
        assert text.startswith(("One of the special magic", "VAR ")), text
    for j, ans in zip(p.targets, p.answers):
        assert ans in tok.decode(p.document[slice(*p.needles[j])])


@pytest.mark.parametrize("task", NIAH)
def test_answers_appear_once(tok, task):
    for seed in range(3):
        p = build_prompt(task, tok, 3000, 0.5, random.Random(seed))
        doc = tok.decode(p.document)
        q = tok.decode(p.question)
        for a in p.answers:
            assert doc.count(a) == 1, (a, task)
            assert a not in q
        keys = p.meta["keys"]
        assert len(set(keys)) == len(keys)
        assert q.count(keys[0]) == 2  # in the question and the answer prefix
        n_needles_of_key = len(p.meta["values"][0])
        assert doc.count(keys[0]) == n_needles_of_key
        for other in keys[1:]:
            assert other not in q


@pytest.mark.parametrize("task", NIAH)
def test_paraphrased_asks_the_same_key_in_other_words(tok, task):
    p = build_prompt(task, tok, 3000, 0.5, random.Random(2))
    para = ruler.paraphrased(p, tok)
    assert (para.document, para.needles, para.targets, para.answers) == (p.document, p.needles, p.targets, p.answers)
    q, key = tok.decode(para.question), p.meta["keys"][0]
    assert q.count(key) == 2 and para.query in q and para.query != p.query
    # besides the key, no word of the needle's sentence but the kind's noun and "the"
    needle = set(re.findall(r"[a-z]+", tok.decode(p.document[slice(*p.needles[p.targets[0]])]).lower()))
    shared = set(re.findall(r"[a-z]+", q.lower().replace(key, " "))) & needle
    assert shared <= {"word", "number", "uuid", "words", "numbers", "uuids", "the"}, shared
    assert "magic" in tok.decode(p.question) and "magic" not in q
    with pytest.raises(ValueError, match="needle tasks"):
        ruler.paraphrased(build_prompt("vt", tok, 1000, 0.5, random.Random(0)), tok)


@pytest.mark.parametrize("task", [t for t in NIAH if t != "niah_multikey"])
def test_blind_question_shares_no_word_with_the_needles(tok, task):
    p = build_prompt(task, tok, 3000, 0.5, random.Random(3))
    blind = ruler.paraphrased(p, tok, shared="none")
    assert (blind.document, blind.needles, blind.targets, blind.answers) == (p.document, p.needles, p.targets, p.answers)
    q = tok.decode(blind.question)
    words = set(re.findall(r"[a-z]+", q.lower()))
    for t, value in zip(p.targets, p.answers):  # the needle's words but its value (a uuid's hex letters)
        needle = tok.decode(p.document[slice(*p.needles[t])]).replace(value, " ")
        assert value not in q and not words & set(re.findall(r"[a-z]+", needle.lower())), words
    assert blind.query in q and p.meta["keys"][0] not in q
    with pytest.raises(ValueError, match="several keys"):
        ruler.paraphrased(build_prompt("niah_multikey", tok, 3000, 0.5, random.Random(3)), tok, shared="none")
    with pytest.raises(ValueError, match="shared"):
        ruler.paraphrased(p, tok, shared="all")


def test_multi_tasks_shape(tok):
    mk = build_prompt("niah_multikey", tok, 3000, 0.5, random.Random(1))
    assert len(mk.needles) == 4 and len(mk.answers) == 1 and mk.targets == [0]
    mv = build_prompt("niah_multivalue", tok, 3000, 0.5, random.Random(1))
    assert len(mv.needles) == 4 and len(mv.answers) == 4 and len(set(mv.answers)) == 4 and mv.targets == [0, 1, 2, 3]
    u = build_prompt("niah_single_uuids", tok, 1000, 0.5, random.Random(1))
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", u.answers[0])
    n = build_prompt("niah_single_numbers", tok, 1000, 0.5, random.Random(1))
    assert re.fullmatch(r"\d{7}", n.answers[0])
    w = build_prompt("niah_single_words", tok, 1000, 0.5, random.Random(1))
    assert w.answers[0] in ruler.VALUE_WORDS


def test_vocabularies_disjoint():
    essay = " ".join(ruler._E_SUBJECTS + ruler._E_VERBS + ruler._E_CLAUSES + ruler._E_TAILS + ruler._E_OPENERS).lower()
    fixed = (ruler.INTRO + ruler.QUERY_ALL + ruler.PREFIX_ALL + ruler.NEEDLE + ruler.FILLER).lower()
    for w in ruler.VALUE_WORDS + ruler.KEY_ADJECTIVES + ruler.KEY_NOUNS:
        assert w not in essay and w not in fixed, w


def test_score():
    assert score("The number is 1234567.", ["1234567"]) == 1.0
    assert score("7654321", ["1234567"]) == 0.0
    assert score("", ["1234567"]) == 0.0
    assert score(" ACCORDION!", ["accordion"]) == 1.0
    assert score("1, 2 and 4", ["1", "2", "3", "4"]) == 0.75
    assert score("they are: ABCDE, FGHIJ", ["abcde", "fghij", "klmno"]) == pytest.approx(2 / 3)
    assert ruler.score_part("FGHIJ", ["abcde", "fghij"]) == 1.0 and ruler.score_part("x", ["abcde"]) == 0.0


def test_prompt_score_uses_answers(tok):
    p = build_prompt("niah_multivalue", tok, 1200, 0.5, random.Random(5))
    assert p.score(" " + ", ".join(p.answers)) == 1.0
    assert p.score(" " + ", ".join(p.answers[:2])) == 0.5
    assert p.score(" none") == 0.0


def _resolve_vt(text: str) -> dict[str, str]:
    """Brute force: every variable's value, by iterating the assignments to a fixed point."""
    direct = dict(re.findall(r"VAR ([A-Z]{5}) = (\d+)\.", text))
    refs = dict(re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})\.", text))
    values = dict(direct)
    changed = True
    while changed:
        changed = False
        for a, b in refs.items():
            if b in values and values.get(a) != values[b]:
                values[a] = values[b]
                changed = True
    return values


@pytest.mark.parametrize("seed", range(4))
def test_vt_chain_resolves(tok, seed):
    p = ruler.vt(tok, 2500, 0.3, random.Random(seed), hops=4, distractors=2)
    text = tok.decode(p.document)
    values = _resolve_vt(text)
    value = p.meta["chains"][0][0]
    assert f"value {value} " in tok.decode(p.question)
    assert sorted(v for v, x in values.items() if x == value) == sorted(p.answers)
    assert len(p.answers) == 5 and len(values) == 15
    # each assignment comes after the one it refers to
    for a, b in re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})\.", text):
        assert text.index(f"VAR {b} =") < text.index(f"VAR {a} =")
    assert f"{len(p.answers)} variables" in tok.decode(p.question)


def test_chunk_spans_cover():
    for n, size, start in [(1000, 128, 0), (1000, 128, 37), (129, 128, 0), (5, 128, 0), (0, 16, 0)]:
        spans = chunk_spans(n, size, start)
        assert all(0 < e - s <= size for s, e in spans)
        assert [s for s, _ in spans[1:]] == [e for _, e in spans[:-1]]
        if n > start:
            assert spans[0][0] == start and spans[-1][1] == n


def test_chunk_spans_snap_to_sentences(tok):
    p = build_prompt("niah_single_words", tok, 3000, 0.5, random.Random(2))
    ends = sentence_ends(tok, p.document)
    spans = chunk_spans(len(p.document), 128, p.head, ends)
    assert spans[0][0] == p.head and spans[-1][1] == len(p.document)
    assert [s for s, _ in spans[1:]] == [e for _, e in spans[:-1]]
    assert all(64 < e - s <= 128 for s, e in spans[:-1])
    assert sum(ends[e - 1] for s, e in spans[:-1]) == len(spans) - 1  # every cut after a sentence
    s, e = p.needles[0]
    assert any(a <= s and e <= b for a, b in spans)  # the needle is not cut


def test_rag_retrieves_the_needle(tok):
    try:
        from emllm.evals.rag import load_embedder

        emb = load_embedder()
    except Exception as e:  # pragma: no cover - the package is part of the dev install
        pytest.skip(f"embedder not available: {e}")
    p = build_prompt("niah_single_numbers", tok, 6000, 0.63, random.Random(11))
    rc = build_context(tok, emb, p.document, p.question, p.query, p.head, budget=400, chunk_tokens=128)
    s, e = p.needles[0]
    best = rc.ranked[0]
    assert any(a <= s < b for a, b in rc.spans)
    assert p.answers[0] in tok.decode(rc.ids)
    assert len(rc.ids) <= 400 and rc.ids[:p.head] == p.document[:p.head] and rc.ids[-len(p.question):] == p.question
    assert rc.spans == sorted(rc.spans) and best >= 0


def test_rag_prompt_budget():
    """A given budget is the prompt's (the span a re-read fills), whatever the answer's length;
    without one, the model's context less the answer; never past what the context leaves."""
    assert prompt_budget(2176, 8192, 20) == prompt_budget(2176, 8192, 128) == 2176
    assert prompt_budget(None, 8192, 128) == 8064
    assert prompt_budget(8192, 8192, 32) == 8160


def test_rag_layouts(tok):
    """The baseline's chunks read by rank (the best last) or best-last: the same chunks as in
    document order, ordered by MiniLM's scores; every chunk read when all fit: document order."""
    try:
        from emllm.evals.rag import load_embedder, retrieve

        emb = load_embedder()
    except Exception as e:  # pragma: no cover - the package is part of the dev install
        pytest.skip(f"embedder not available: {e}")
    p = build_prompt("niah_single_numbers", tok, 3000, 0.4, random.Random(5))
    ctx = {lay: build_context(tok, emb, p.document, p.question, p.query, p.head, budget=700, layout=lay)
           for lay in ("stream", "best-last", "rank")}
    st, bl, rk = ctx["stream"], ctx["best-last"], ctx["rank"]
    assert 2 < len(st.spans) < st.n_chunks  # some chunks left out
    assert sorted(rk.spans) == sorted(bl.spans) == st.spans and rk.ranked == st.ranked
    spans = chunk_spans(len(p.document), 128, start=p.head, sentence_ends=sentence_ends(tok, p.document))
    texts = [tok.decode(p.document[s:e], skip_special_tokens=True) for s, e in spans]
    order, scores = retrieve(emb, texts, p.query, len(texts))
    score = dict(zip(order, scores))
    read = [score[spans.index(sp)] for sp in rk.spans]
    assert read == sorted(read)  # the worst first, the best last
    assert bl.spans[-1] == spans[order[0]] and bl.spans[:-1] == sorted(bl.spans[:-1])
    body = [t for sp in rk.spans for t in p.document[slice(*sp)]]
    assert rk.ids == p.document[:p.head] + body + p.question
    whole = build_context(tok, emb, p.document, p.question, p.query, p.head, budget=10_000, layout="rank")
    assert len(whole.spans) == whole.n_chunks and whole.spans == sorted(whole.spans)
    with pytest.raises(ValueError, match="layout"):
        build_context(tok, emb, p.document, p.question, p.query, p.head, budget=700, layout="best-first")


@pytest.mark.parametrize("haystack", ["prose", "code", "chat"])
@pytest.mark.parametrize("task", ["niah_single_words", "niah_multikey", "vt"])
def test_real_text_haystacks(tok, task, haystack):
    """Any task on real text: the length, the needles where their spans say, the answers once,
    and a haystack that is the corpus's own text from some place on (not a repeated filler)."""
    from emllm.evals import corpus

    seen = set()
    for seed in range(3):
        p = build_prompt(task, tok, 3000, 0.5, random.Random(seed), haystack=haystack)
        assert abs(len(p.document) + len(p.question) - 3000) <= 4
        doc = tok.decode(p.document)
        for j, ans in zip(p.targets, p.answers):
            assert ans in tok.decode(p.document[slice(*p.needles[j])])
            # never in the haystack: only where needles put it (vt names a variable twice)
            assert doc.count(ans) == sum(tok.decode(p.document[slice(*n)]).count(ans) for n in p.needles), (ans, task)
        cut = sorted({0, len(p.document), p.head} | {x for s in p.needles for x in s})
        hay = [tok.decode(p.document[a:b]) for a, b in zip(cut, cut[1:]) if (a, b) not in p.needles and a >= p.head]
        whole = "".join(corpus.units(haystack)) * 2
        assert all(h in whole for h in hay if h), task  # (the last piece may stop mid-sentence: still a substring)
        seen.add(hay[0][:50])
        if haystack == "chat":  # turns of dialogues, a user's and an assistant's
            assert "\nUser: " in doc and "\nAssistant: " in doc
    assert len(seen) == 3  # each seed starts elsewhere
    with pytest.raises(ValueError, match="unknown haystack"):
        build_prompt(task, tok, 3000, 0.5, random.Random(0), haystack="tweets")


@pytest.mark.parametrize("task", ["niah_multikey", "vt"])
def test_needle_only_keeps_the_instructions_the_asked_needles_and_the_question(tok, task):
    p = build_prompt(task, tok, 3000, 0.4, random.Random(5))
    q = ruler.needle_only(p)
    assert q.question == p.question and q.answers == p.answers and q.document[: p.head] == p.document[: p.head]
    asked = sorted(p.needles[j] for j in p.targets)
    assert q.document[p.head:] == [t for s, e in asked for t in p.document[s:e]]
    assert [q.document[s:e] for s, e in q.needles] == [p.document[s:e] for s, e in asked]


def test_code_and_prose_haystacks_are_the_snapshot_not_the_interpreter(tok, monkeypatch, tmp_path):
    """The same prompt on any Python: the haystacks come from the shipped snapshot. The digest is
    the one this prompt had when results were first recorded (docs/results/quality-reread-hybrid-8k.jsonl,
    sample 0, built from Python 3.11.7's own files), so earlier results stay comparable."""
    from emllm.evals import corpus

    def no_interpreter():
        raise AssertionError("the haystack must not be read from the running interpreter")

    monkeypatch.setattr(corpus, "_modules", no_interpreter)
    monkeypatch.setattr(corpus, "_CACHE", {})
    p = build_prompt("niah_multikey", tok, 8192, 0.25, random.Random("0/niah_multikey/8192/0"), haystack="code")
    assert p.digest == "68f4f35b89ff"
    assert "def " in corpus.code() and len(corpus.prose()) > 150_000
    # a snapshot changed or cut short is refused with its path, not read as another haystack
    import lzma
    data = lzma.decompress((corpus.SNAPSHOT / "code.txt.xz").read_bytes())
    (tmp_path / "code.txt.xz").write_bytes(lzma.compress(data[:-1] + b"!"))
    with pytest.raises(RuntimeError, match="sha256 differs"):
        corpus._snapshot("code", tmp_path)
    (tmp_path / "code.txt.xz").write_bytes((corpus.SNAPSHOT / "code.txt.xz").read_bytes()[:1000])
    with pytest.raises(RuntimeError, match="cannot be read"):
        corpus._snapshot("code", tmp_path)


def test_one_read_answers_both_ways_as_their_own_runs(smollm2):
    """quality.py's emllm-S and emllm-S-reread from one read: each answer and the needle recall
    equal those of the method's own run (the memory in use: the prompt is twice emllm's span)."""
    from emllm.engine.stream import Engine

    model, tok, profile = smollm2
    pr = profile.replace(chunk_size=128, n_init=32, n_local=256, n_mem=128)
    p = build_prompt("niah_multikey", tok, 1200, 0.3, random.Random(3))
    make = lambda: Engine(model, pr)  # noqa: E731
    own_found, again_found, both_found = [], [], []
    own = ruler.run_task(make, tok, p, recall=own_found)
    again = ruler.run_task(make, tok, p, recall=again_found, reread=True)
    both = ruler.run_task_both(make, tok, p, recall=both_found)
    assert (both.own, both.reread) == (own, again)
    assert both_found == own_found == again_found
    assert any(r.where == "memory" for r in both_found)
    assert min(both.read_s, both.own_s, both.reread_s) > 0
