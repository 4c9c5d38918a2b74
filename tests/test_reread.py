"""Re-read answers (`app.reread`, `memory.passages`): passages voted for by the layers' selections,
checked against brute-force versions; the re-read answer is the plain model's on its context; the
store is not changed."""

from __future__ import annotations

import random

import pytest
import torch

from emllm.app.ask import Session
from emllm.app.reread import SelectionRecorder, passage_spans, reread_context, sentence_ends
from emllm.memory.passages import choose_passages, chunk_spans, event_spans, event_votes, passage_order, token_votes
from emllm.store import Store

from .helpers import QUESTION, TOL, ingest_store, load_tiny, named_context, store_files, vanilla_logits, words


def _walk(n, size, start, ends):
    """chunk_spans as first written: walk back from each span's end to a sentence end."""
    spans, s = [], start
    while s < n:
        e = min(s + size, n)
        if ends is not None and e < n:
            for j in range(e - 1, s + size // 2 - 1, -1):
                if ends[j]:
                    e = j + 1
                    break
        spans.append((s, e))
        s = e
    return spans


def test_chunk_spans_match_the_walk_back_to_sentence_ends():
    rng = random.Random(0)
    for _ in range(200):
        n, size, start = rng.randint(0, 700), rng.randint(1, 130), rng.randint(0, 40)
        ends = [rng.random() < rng.choice((0.0, 0.02, 0.2, 1.0)) for _ in range(n)]
        assert chunk_spans(n, size, start, ends) == _walk(n, size, start, ends)
        assert chunk_spans(n, size, start, torch.tensor(ends, dtype=torch.bool)) == _walk(n, size, start, ends)
        assert chunk_spans(n, size, start) == _walk(n, size, start, None)
    with pytest.raises(ValueError):
        chunk_spans(10, 0)


def test_votes_and_the_order_of_passages_against_brute_force():
    rng = random.Random(1)
    for _ in range(50):
        n_init, n = rng.randint(0, 8), rng.randint(50, 400)
        cuts = sorted(rng.sample(range(n_init + 1, n), rng.randint(1, 20)))
        spans_e = torch.tensor(list(zip([n_init] + cuts[:-1], cuts)))  # events, disjoint, in order
        layers = rng.randint(1, 6)
        sels = [torch.tensor(sorted(rng.sample(range(len(spans_e)), rng.randint(0, len(spans_e))))) for _ in range(layers)]
        votes = event_votes(sels, len(spans_e))
        assert votes.tolist() == [sum(int(e in s.tolist()) for s in sels) for e in range(len(spans_e))]
        tv = token_votes(spans_e, votes, n)
        want = [0.0] * n
        for (a, b), v in zip(spans_e.tolist(), votes.tolist()):
            for t in range(a, b):
                want[t] = float(v)
        assert tv.tolist() == want
        spans = chunk_spans(n, rng.randint(4, 40), n_init)
        keys = [(-max(want[s:e]), -sum(want[s:e]) / (e - s), i) for i, (s, e) in enumerate(spans)]
        assert passage_order(tv, spans) == [k[2] for k in sorted(keys)]
        room = rng.randint(0, n)
        kept, used = [], 0
        for i in (k[2] for k in sorted(keys)):
            s, e = spans[i]
            if used + e - s <= room:
                kept.append(i)
                used += e - s
        assert choose_passages(passage_order(tv, spans), spans, room) == sorted(kept)
    assert event_votes([], 3).tolist() == [0, 0, 0] and passage_order(torch.zeros(4), []) == []


def test_lexical_scores_rank_the_question_s_words_in_its_order_first():
    """Two passages with the same words, of the same length: the one holding the question's two
    ids in a row (a name, "class SlidingRows") scores above the one holding them apart."""
    from emllm.memory.passages import lexical_scores
    stream = torch.tensor([7, 8, 1, 2, 9, 9, 1, 9, 9, 2, 9, 9, 7, 7, 7, 7, 7, 7])
    together, apart, neither = lexical_scores(stream, [(0, 6), (6, 12), (12, 18)], [1, 2]).tolist()
    assert together > apart > neither == 0.0


def test_lexical_scores_against_brute_force():
    """lexical_scores: Okapi BM25 of each passage for the query's distinct ids and its distinct
    pairs of consecutive ids (a pair where a passage holds them in a row), against the formula term
    by term in Python; repeated query terms count once; no passages, no query."""
    import math

    from emllm.memory.passages import lexical_scores
    rng = random.Random(4)

    def bm25(docs: list[list], terms: set, lengths: list[int]) -> list[float]:
        avg = sum(lengths) / len(docs)
        out = []
        for d, n in zip(docs, lengths):
            total = 0.0
            for t in terms:
                tf, df = d.count(t), sum(t in x for x in docs)
                if tf:
                    idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
                    total += idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * n / avg))
            out.append(total)
        return out

    for _ in range(30):
        n, vocab = rng.randint(20, 200), rng.randint(3, 30)
        stream = torch.tensor([rng.randrange(vocab) for _ in range(n)])
        start = rng.randint(0, 5)
        spans = chunk_spans(n, rng.randint(3, 40), start=start)
        query = [rng.randrange(vocab + 5) for _ in range(rng.randint(0, 12))]
        docs = [stream[s:e].tolist() for s, e in spans]
        pairs = [list(zip(d, d[1:])) for d in docs]  # (a passage's own: none across two)
        tokens = [len(d) for d in docs]  # (a passage's length in tokens for both)
        want = [a + b for a, b in zip(bm25(docs, set(query), tokens), bm25(pairs, set(zip(query, query[1:])), tokens))]
        got = lexical_scores(stream, spans, query)
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        # every term and pair again, with an id between that no passage holds (nor a pair with it)
        assert torch.equal(lexical_scores(stream, spans, query + [vocab + 9] + query), got)
    assert lexical_scores(torch.arange(5), [], [1]).numel() == 0
    assert lexical_scores(torch.arange(5), [(0, 5)], []).tolist() == [0.0]


def test_rank_fusion_of_passage_orders_against_brute_force():
    """fuse_orders: 1 / (60 + rank) summed over the lists that rank an item, best first; ties in
    the first list's order, then the items it leaves out by index; no list, every item by index."""
    from emllm.memory.passages import fuse_orders
    rng = random.Random(5)
    for _ in range(60):
        n = rng.randint(1, 40)
        orders = [rng.sample(range(n), rng.randint(0, n)) for _ in range(rng.randint(1, 3))]
        score = [0.0] * n
        for order in orders:
            for r, i in enumerate(order):
                score[i] += 1.0 / (60 + r)
        base = orders[0] + sorted(set(range(n)) - set(orders[0]))
        want = sorted(range(n), key=lambda i: (-score[i], base.index(i)))
        assert fuse_orders(orders, n) == want
    assert fuse_orders([], 3) == [0, 1, 2]
    assert fuse_orders([[2], [1, 2]], 3) == [2, 1, 0]  # ranked by both beats ranked first by one


def test_passages_chosen_by_votes_and_words(tiny):
    """The passages read: those taken by the fusion of the votes' ranking (passages with a vote) and
    the question's BM25 ranking (passages with one of its words), checked step by step; a passage
    the votes passed over but that alone holds the question's word is read (only the WORDS_TOP
    best by BM25 take part); a question none of whose words is in the stream chooses as the votes do."""
    from emllm.app.reread import WORDS_TOP, context_from_votes, word_ids
    from emllm.memory.passages import fuse_orders, lexical_scores, passage_votes
    from emllm.config import load_profile_file
    from emllm.engine.stream import Engine
    folder, prof_path, _, _ = tiny
    model, tok = load_tiny(folder)
    prof = load_profile_file(prof_path)
    stream = tok(words(7, 300), add_special_tokens=False)["input_ids"]
    planted = [model.config.vocab_size - 1 - k for k in range(6)]  # ids the words never use, one each
    assert not set(planted) & set(stream)
    for k, t in enumerate(planted):
        stream.insert((k + 1) * len(stream) // 7, t)
    eng = Engine(model, prof)
    eng.feed(stream)
    rec = SelectionRecorder(eng)
    eng.begin_question()
    eng.feed(tok(QUESTION, add_special_tokens=False)["input_ids"])
    rec.detach()
    votes, st = rec.votes(), torch.tensor(stream)
    room = len(stream) // 3
    ctx = lambda q: context_from_votes(st, votes, tok, prof.n_init, room, q)  # noqa: E731
    spans = passage_spans(tok, st, prof.n_init, room)
    tv = token_votes(votes.spans, event_votes(list(votes.selections.values()), len(votes.spans)), len(stream))
    order = passage_order(tv, spans)
    most = passage_votes(tv, spans)[0]
    voted = [i for i in order if most[i] > 0]
    by_votes = choose_passages(voted, spans, room)
    left_out = [i for i in order if i not in by_votes]
    # a planted id in a passage the votes did not choose: the question asks for it
    rare = next((t, i) for i in reversed(left_out) for t in planted if t in stream[spans[i][0]:spans[i][1]])
    for q in ([rare[0]], [rare[0]] + stream[spans[order[0]][0]:spans[order[0]][0] + 3]):
        words_of, asked = word_ids(tok, st, q)
        bm25 = lexical_scores(words_of, spans, asked)
        worded = [i for i in sorted(range(len(spans)), key=lambda i: -float(bm25[i])) if bm25[i] > 0][:WORDS_TOP]
        fused = fuse_orders([voted, worded], len(spans))
        want = choose_passages(fused, spans, room)
        got = ctx(q)
        assert sorted(got.passages) == [spans[i] for i in want] and spans[rare[1]] in got.passages
        best = max(want, key=lambda i: (float(bm25[i]), -fused.index(i)))  # ordered by BM25, the best last
        assert got.passages[-1] == spans[best] and (len(q) > 1 or best == rare[1])
    absent = [int(st.max()) + 1]  # no word of the question in the stream: the votes' choice, the best last
    assert ctx(absent).passages == [spans[i] for i in reversed(voted) if i in by_votes]


def test_word_ids_against_the_tokens_texts(tiny):
    """word_ids: two ids are one word where their texts, stripped of the spaces around them, are
    the same in lower case (checked pair by pair against the texts), a word of letters stemmed by
    Snowball's English stemmer; a piece of a character and an id the tokenizer lacks are words of
    their own; one numbering across the sequences."""
    import snowballstemmer

    from emllm.app.reread import word_ids
    stem = snowballstemmer.stemmer("english").stemWord
    _, tok = load_tiny(tiny[0])
    rng = random.Random(3)
    ids = [tok.convert_tokens_to_ids(t) for t in ("class", "\u0120class", "Class", "\u0120apple", "Apple", "apple", "\u010a",
                                                 "\u0120", "\u0120\u0120")]
    bits = tok.encode("\U0001f600")  # (an emoji: byte tokens, each alone a replacement character)
    past = len(tok) + 5
    sample = ids + bits + [past] + rng.sample(range(len(tok)), 400)
    a, b = word_ids(tok, sample[:200], sample[200:])
    got = torch.cat((a, b)).tolist()
    text = [tok.decode([i]) if i < len(tok) else None for i in sample]

    def word(t: str) -> str:
        w = t.strip().lower()
        return stem(w) if w.isalpha() else w
    for i in range(len(sample)):
        for j in range(i + 1, len(sample)):
            same = sample[i] == sample[j] or (None not in (text[i], text[j]) and "\ufffd" not in text[i] + text[j]
                                              and word(text[i]) == word(text[j]))
            assert (got[i] == got[j]) == same, (sample[i], sample[j], text[i], text[j])
    assert got[0] == got[1] == got[2] != got[3] and got[3] == got[4] == got[5] and got[6] == got[7] == got[8]
    assert len(bits) > 1 and len(set(got[9 : 9 + len(bits)])) == len(bits)
    assert [t.tolist() for t in word_ids(tok, [], [])] == [[], []]
    # a question's "leave" is a text's "leaves" (one word stemmed, not without)
    leave, leaves = (tok.encode(w) for w in (" leave", " leaves"))
    assert len(leave) == len(leaves) == 1
    assert len(set(torch.cat(word_ids(tok, leave, leaves)).tolist())) == 1
    assert len(set(torch.cat(word_ids(tok, leave, leaves, stem=False)).tolist())) == 2


def test_the_re_read_s_words_are_blind_to_case_and_spaces(tiny):
    """A question's " apple" (one token id) finds the passage that holds "Apple" (another id; one
    word to the re-read's BM25): read, last, though the votes passed it over; by its token ids
    the question matched no passage."""
    from emllm.app.reread import context_from_votes
    eng, tok, prof, stream, q_ids, votes, st = _asked(tiny)
    (asked,), (held,) = tok.encode(" apple"), tok.encode("Apple")
    assert asked != held and not {asked, held} & set(stream)
    room = len(stream) // 3
    spans = passage_spans(tok, st, prof.n_init, room)
    by_votes = context_from_votes(st, votes, tok, prof.n_init, room, [asked]).passages  # (no word of it in the stream)
    assert by_votes == context_from_votes(st, votes, tok, prof.n_init, room).passages
    left = next(p for p in reversed(spans) if p not in by_votes)
    planted = st.clone()
    planted[left[0] + 1] = held
    assert passage_spans(tok, planted, prof.n_init, room) == spans
    got = context_from_votes(planted, votes, tok, prof.n_init, room, [asked]).passages
    assert got[-1] == left and got != by_votes


def _read_into_engine(tiny, seed: int, n_words: int):
    """An engine of the tiny model and profile that has read `n_words` words: (engine, tok, profile, stream)."""
    from emllm.config import load_profile_file
    from emllm.engine.stream import Engine
    folder, prof_path, _, _ = tiny
    model, tok = load_tiny(folder)
    prof = load_profile_file(prof_path)
    eng = Engine(model, prof)
    stream = tok(words(seed, n_words), add_special_tokens=False)["input_ids"]
    eng.feed(stream)
    return eng, tok, prof, stream


def _asked(tiny):
    """An engine that has read 300 words, then QUESTION as a question, its layers' selections
    recorded: (engine, tok, profile, stream, question ids, votes, stream as a tensor)."""
    eng, tok, prof, stream = _read_into_engine(tiny, 7, 300)
    rec = SelectionRecorder(eng)
    q_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
    eng.begin_question()
    eng.feed(q_ids)
    rec.detach()
    return eng, tok, prof, stream, q_ids, rec.votes(), torch.tensor(stream)


def test_the_passages_read_are_ordered_by_the_questions_words(tiny):
    """The passages chosen are read by their BM25 for the question's ids, the best last, ties by
    the votes' rank (the worst first); without a question, by rank alone; where every passage
    fits, the stream in its order."""
    from emllm.app.reread import context_from_votes, word_ids
    from emllm.memory.passages import lexical_scores
    eng, tok, prof, stream, q_ids, votes, st = _asked(tiny)
    room = 3 * len(stream) // 4
    lex = context_from_votes(st, votes, tok, prof.n_init, room, q_ids)
    assert lex == reread_context(eng, votes, tok, len(stream), room, q_ids)
    spans = passage_spans(tok, st, prof.n_init, room)
    words_of = lexical_scores(word_ids(tok, st, q_ids)[0], spans, word_ids(tok, st, q_ids)[1])
    got = [float(words_of[spans.index(p)]) for p in lex.passages]
    assert len(lex.passages) > 2 and got == sorted(got) and got[-1] > got[0]  # the question's words found, the best last
    rank = context_from_votes(st, votes, tok, prof.n_init, room)  # no question: the worst-ranked first
    assert len(rank.passages) > 2 and rank.passages != sorted(rank.passages)  # not stream order by chance
    ties = [p for p, w in zip(lex.passages, got) if w == got[0]]
    assert ties == [p for p in rank.passages if p in ties]
    for c in (lex, rank):
        assert c.ids == stream[: prof.n_init] + [t for s, e in c.passages for t in stream[s:e]]
    assert context_from_votes(st, votes, tok, prof.n_init, len(stream), q_ids).ids == stream  # all of it fits


def test_a_passage_inside_a_named_document_is_read_after_the_line_naming_it(tiny):
    """Documents whose text opens with a line naming them (a folder's files): each passage that
    starts inside one, after that line, is read after the line, unless it goes on from the
    passage read before it; the lines count against the room."""
    from emllm.app.reread import context_from_votes
    eng, tok, prof, stream, q_ids, votes, st = _asked(tiny)
    n = len(stream)
    named = [(prof.n_init + 5, n // 3, [11, 12, 13]), (n // 3, 2 * n // 3, [21, 22]), (2 * n // 3 + 7, n, [31])]
    room = n // 2
    got = context_from_votes(st, votes, tok, prof.n_init, room, q_ids, named)
    plain = context_from_votes(st, votes, tok, prof.n_init, room, q_ids)
    assert got.passages and got.ids != plain.ids
    ids, lines = named_context(stream, prof.n_init, got.passages, named)
    assert got.ids == ids and lines >= 2
    assert len(got.ids) - prof.n_init <= room
    assert context_from_votes(st, votes, tok, prof.n_init, n, q_ids, named).ids == stream  # all fits: in order, no lines


def test_sentence_ends_per_token(smollm2):
    _, tok, _ = smollm2
    ids = tok("One. Two! Three?\nFour five", add_special_tokens=False)["input_ids"]
    got = sentence_ends(tok, ids).tolist()
    want = [tok.decode([t]).rstrip(" ").endswith((".", "!", "?", "\n")) for t in ids]
    assert got == want and sum(got) >= 3 and not got[-1]


@pytest.mark.parametrize("words_in,fits", [(300, False), (3, True)])
def test_a_reread_answer_is_the_plain_models_on_its_context(tiny, tmp_path, words_in, fits):
    """A store longer than emllm's span (300 words a document) and one within it (3 words: every
    passage is read again, so the context is the whole stream). The reader's logits are the plain model's on
    the initial tokens, the chosen passages and the question; the store is not changed."""
    folder, prof, _, _ = tiny
    path = tmp_path / "s"
    ingest_store(path, folder, prof, [("a", words(1, words_in)), ("b", "The pass key is 71432. " + words(2, words_in))])
    model, tok = load_tiny(folder)
    before = store_files(path)
    with Store.open(path) as st:
        s = Session(st, model, tok, reread=True)
        q = s.question_ids(QUESTION)
        rec = SelectionRecorder(s.engine)
        reader = s._reread(q, 6)
        rec.detach()
        pr = s.engine.profile
        stream = s.engine.ids.view()[: s.engine.n_tokens - len(q)].tolist()
        n_init = pr.n_init
        span = pr.n_init + pr.n_mem + pr.n_local
        rr = reread_context(s.engine, rec.votes(), tok, len(stream), span - n_init - len(q), question=q)
        assert rr.passages == s.passages and len(rec.last) == len(s.engine.windows)
        ctx = rr.ids
        assert ctx[:n_init] == stream[:n_init]
        ordered = sorted(rr.passages)
        assert all(a < b <= c for (a, b), (c, _) in zip(ordered, ordered[1:]))  # disjoint
        if fits:  # (otherwise ordered by the question's words: test_the_passages_read_are_ordered_by_the_questions_words)
            assert rr.passages == ordered
        assert ctx[n_init:] == [t for a, b in rr.passages for t in stream[a:b]]
        assert len(ctx) - n_init <= span - n_init - len(q)
        assert (len(stream) <= span - len(q)) == fits
        if fits:
            assert ctx == stream  # all of it fits: all of it is read
        else:
            assert rr.passages and len(ctx) < len(stream) and event_votes(list(rec.last.values()), s.engine.n_events).max() > 0
        ids = torch.tensor(ctx + q)
        ref = vanilla_logits(model, ids)[-1]
        assert torch.allclose(reader.last_logits, ref, atol=TOL, rtol=0)
        answer = list(reader.generate_iter(6))
        full = vanilla_logits(model, torch.tensor(ctx + q + answer))
        picks = full[len(ctx) + len(q) - 1 : -1]
        top2 = picks.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3
        assert (picks.argmax(-1)[clear] == torch.tensor(answer)[clear]).all()
    with Store.open(path) as st:
        again = list(Session(st, model, tok, reread=True).answer(QUESTION, 6))
    assert again == answer  # deterministic
    assert store_files(path) == before


def test_ask_rereads_by_default_from_the_command_line_and_the_library(tiny, tmp_path, monkeypatch):
    """`emllm ask --json` answers as the library's re-read session does (the default,
    `emllm.REREAD_QUESTIONS`), says which passages it read, and leaves the store as it was; `--no-reread` gives
    emllm's own answer and no passages. `emllm.open(...).ask` has the same default."""
    import json

    import emllm

    from .helpers import run_in_process

    folder, prof, _, _ = tiny
    path = tmp_path / "stores" / "s"
    ingest_store(path, folder, prof, [("a", words(1, 300)), ("b", "The pass key is 71432. " + words(2, 300))])
    before = store_files(path)
    r = run_in_process("ask", QUESTION, "--store", "s", "-n", "5", "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    r = run_in_process("ask", QUESTION, "--store", "s", "-n", "5", "--no-reread", "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    own = json.loads(r.stdout)
    model, tok = load_tiny(folder)
    with Store.open(path) as st:
        s = Session(st, model, tok, reread=True)
        want = "".join(s.answer_text(QUESTION, 5)).strip()
        passages = s.passages
    with Store.open(path) as st:
        want_own = "".join(Session(st, model, tok).answer_text(QUESTION, 5)).strip()
    assert doc["answer"] == want and doc["reread"]["passages"] == [list(p) for p in passages]
    assert doc["reread"]["tokens"] == sum(e - a for a, e in passages) > 0
    assert own["answer"] == want_own and "reread" not in own
    with emllm.open(path) as mem:  # the tiny model may answer alike both ways: the answers say how they read
        a = mem.answer(QUESTION, 5)
        assert a.text == want and a.reread and a.passages == passages
        b = mem.answer(QUESTION, 5, reread=False)
        assert b.text == want_own and not b.reread and b.passages == []
        assert mem.ask(QUESTION, 5) == want  # asked again, from the same memory: the same answer
    assert store_files(path) == before


def _lse_brute(raw: list[list[float]], t: float = 0.5) -> list[float]:
    """Each event's soft maximum over tokens of its z-score among all events, one number at a time."""
    import math
    zs = []
    for row in raw:
        m = sum(row) / len(row)
        sd = math.sqrt(sum((x - m) ** 2 for x in row) / len(row))
        zs.append([(x - m) / sd if sd > 0 else 0.0 for x in row])
    return [t * math.log(sum(math.exp(z[e] / t) for z in zs)) for e in range(len(raw[0]))]


def test_the_tail_is_selected_as_if_its_pieces_were_events():
    """tail_selection against a brute force: mean keys of unit length per KV head for the pieces,
    every event and piece scored by each token's query, z-scores over all of them, the soft
    maximum, best first while the budget holds (stopping at the first that does not fit)."""
    from emllm.app.reread import tail_selection
    from emllm.memory.events import EventMemory
    from emllm.memory.selection import unit_keys
    g = torch.Generator().manual_seed(3)
    h_kv, d, t_q = 2, 8, 5
    for trial in range(6):
        mem = EventMemory(h_kv, h_kv, d, torch.float32, torch.device("cpu"))
        ev_len = torch.randint(1, 6, (7 + trial,), generator=g)
        n = int(ev_len.sum())
        ev_keys = torch.randn(h_kv, n, d, generator=g)
        starts = torch.cumsum(ev_len, 0) - ev_len
        reprs = torch.stack([unit_keys(ev_keys[:, s : s + l].mean(1)) for s, l in zip(starts.tolist(), ev_len.tolist())])
        mem.append(ev_keys, torch.zeros_like(ev_keys), ev_len, reprs)
        tail = torch.randint(1, 6, (4,), generator=g)
        tail_keys = torch.randn(h_kv, int(tail.sum()), d, generator=g)
        query = torch.randn(t_q, h_kv, d, generator=g)
        budget = int(torch.randint(3, 25, (1,), generator=g))

        class W:
            events = mem

        got = tail_selection(W(), query, tail_keys, tail, budget, "lse", True).ids.tolist()
        offs = (torch.cumsum(tail, 0) - tail).tolist()
        pieces = [unit_keys(tail_keys[:, s : s + l].mean(1)) for s, l in zip(offs, tail.tolist())]
        keys = [r.double() for r in reprs] + [r.double() for r in pieces]  # each [H, D]
        raw = [[float((q.double() * k).sum()) for k in keys] for q in query]
        score = _lse_brute(raw)
        lengths = ev_len.tolist() + tail.tolist()
        want, used = [], 0
        for i in sorted(range(len(keys)), key=lambda i: (-score[i], i)):
            if used + lengths[i] > budget:
                break
            want.append(i)
            used += lengths[i]
        assert got == sorted(want) and any(i >= len(ev_len) for i in range(len(keys)))


def test_the_tail_is_cut_and_keyed_as_its_events_are_later(tiny):
    """The tail's pieces at the question (tokens in no event yet) are the events the stream later
    closes there, the last, still open, excepted: the same spans, and the mean keys scored for them
    the representative keys those events get."""
    import emllm.app.reread as rr_mod
    from emllm.memory.selection import mean_keys, unit_keys
    eng, tok, prof, stream = _read_into_engine(tiny, 5, 120)
    seen = {}
    real = rr_mod.tail_selection

    def spy(window, query, tail_keys, tail, *a):
        seen[window.layer_idx] = (tail_keys.clone(), tail.clone())
        return real(window, query, tail_keys, tail, *a)

    rr_mod.tail_selection = spy
    try:
        rec = SelectionRecorder(eng)
        eng.begin_question()
        eng.feed(tok(QUESTION, add_special_tokens=False)["input_ids"])
        rec.detach()
    finally:
        rr_mod.tail_selection = real
    votes = rec.votes()
    n_ev = len(votes.spans) - len(seen[0][1])
    tail_spans = votes.spans[n_ev:]
    assert len(seen) == len(eng.windows) and len(tail_spans) >= 3
    assert int(tail_spans[0, 0]) == int(votes.spans[n_ev - 1, 1]) and int(tail_spans[-1, 1]) == len(stream)
    assert all(int(ids.max()) >= n_ev for ids in votes.selections.values())  # the window takes part
    eng.feed(tok(words(6, 200), add_special_tokens=False)["input_ids"])  # the tail leaves the window
    later = {tuple(s) for s in event_spans(eng.windows[0].events.event_lengths(), prof.n_init).tolist()}
    closed = [i for i, s in enumerate(tail_spans[:-1].tolist()) if tuple(s) in later]
    assert len(closed) == len(tail_spans) - 1
    starts = event_spans(eng.windows[0].events.event_lengths(), prof.n_init)[:, 0].tolist()
    for layer, (keys, tail) in seen.items():
        mine = unit_keys(mean_keys(keys, tail, eng.windows[layer].events.repr_heads))
        theirs = eng.windows[layer].events.repr_keys()
        for i in closed:
            assert torch.equal(mine[i], theirs[starts.index(int(tail_spans[i, 0]))])


def test_the_tail_scores_the_events_once_with_the_retrievals_bits(tiny):
    """At a question's step each layer's listener is given every event's score for each of the
    question's tokens (`Selection.token_scores`: the bits `events.token_scores` gives); the
    recorder's selections and scores from them are those it gets by scoring the events again."""
    import emllm.app.reread as rr_mod
    real = rr_mod.tail_selection
    runs = {}
    for reuse in (True, False):
        eng, tok, prof, stream = _read_into_engine(tiny, 5, 120)
        q_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
        given = {}

        def spy(window, query, tail_keys, tail, budget, scoring, normalise, event_scores=None, groups=None):
            given[window.layer_idx] = event_scores
            if event_scores is not None:
                assert torch.equal(event_scores, window.events.token_scores(query))
            return real(window, query, tail_keys, tail, budget, scoring, normalise, event_scores if reuse else None, groups)

        rr_mod.tail_selection = spy
        try:
            rec = SelectionRecorder(eng)
            eng.begin_question()
            eng.feed(q_ids)
            rec.detach()
        finally:
            rr_mod.tail_selection = real
        assert len(given) == len(eng.windows) and all(s is not None and s.shape[0] == len(q_ids) for s in given.values())
        runs[reuse] = (rec.votes(), rec.scores)
    (a, a_scores), (b, b_scores) = runs[True], runs[False]
    assert torch.equal(a.spans, b.spans)
    for layer in a.selections:
        assert torch.equal(a.selections[layer], b.selections[layer]) and torch.equal(a_scores[layer], b_scores[layer])


def test_listeners_nest_and_detach_in_any_order(tiny):
    """A trace attached inside a recall probe and a recorder: each hears every retrieval while
    attached, and detaching one leaves the others listening."""
    from emllm.app.trace import Trace
    from emllm.evals.recall import RecallProbe
    eng, tok, _, _ = _read_into_engine(tiny, 5, 120)
    probe, rec, trace = RecallProbe(eng), SelectionRecorder(eng, tail=False), Trace.attach(eng)
    eng.feed(tok(QUESTION, add_special_tokens=False)["input_ids"])
    trace.detach()
    first = dict(rec.last)
    assert trace.steps == 1 and len(trace.records) == len(eng.windows) == len(first) == len(probe.last)
    assert all(torch.equal(first[r.layer], r.ids) and torch.equal(probe.last[r.layer][0].ids, r.ids) for r in trace.records)
    eng.feed(tok(" and then", add_special_tokens=False)["input_ids"])
    assert trace.steps == 1 and not all(torch.equal(first[i], rec.last[i]) for i in first)  # the others still hear
    rec.detach()
    probe.detach()
    assert eng.on_retrieval is None
