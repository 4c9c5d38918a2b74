"""Needle recall (core/evals/recall.py): what the question's retrieval did with each needle, checked
against the layers' own selections and a brute-force ranking; a chunk retriever's recall at a budget."""

from __future__ import annotations

import pytest
import torch

from emllm.engine.stream import Engine
from emllm.evals.recall import RecallProbe, chunk_recall, needle_recall
from emllm.memory.selection import event_scores, fold_query, select_events
from tests.conftest import tiny_model, tiny_profile


@pytest.mark.parametrize("seed", [0, 1])
def test_needles_in_memory_window_and_initial_tokens(seed):
    model = tiny_model("llama3.1")
    prof = tiny_profile(segmentation="F", max_block=8, min_block=8, n_mem=16)  # fixed events of 8 tokens from 4
    eng = Engine(model, prof)
    g = torch.Generator().manual_seed(seed)
    eng.feed(torch.randint(0, 300, (200,), generator=g))
    selected: dict[int, list[int]] = {}
    def outer(layer, sel, query):  # a listener set before the probe still hears every retrieval
        selected[layer] = sel.ids.tolist()
    eng.on_retrieval = outer
    probe = RecallProbe(eng)
    eng.feed(torch.randint(0, 300, (5,), generator=g))
    probe.detach()
    assert eng.on_retrieval is outer and set(selected) == {0, 1}
    needles = [(1, 3), (21, 25), (30, 38), (eng.n_tokens - 10, eng.n_tokens - 8)]
    got = needle_recall(eng, probe, needles)
    assert got[0].where == "init" and got[0].layers == got[0].whole == 2 and got[0].ranks == []
    assert got[3].where == "window" and got[3].share == 1.0 and got[3].whole == 2
    lengths = eng.windows[0].events.event_lengths()
    assert bool((lengths == 8).all())
    for r, (s, e) in zip(got[1:3], needles[1:3]):
        ev = list(range((s - 4) // 8, (e - 1 - 4) // 8 + 1))  # events [4 + 8i, 12 + 8i)
        assert r.where == "memory" and r.events == len(ev)
        assert r.layers == sum(any(i in selected[layer] for i in ev) for layer in (0, 1))
        assert r.whole == sum(all(i in selected[layer] for i in ev) for layer in (0, 1))
        for layer in (0, 1):  # brute force: 1 + events scoring higher, ties to the lower id
            sel, q, n = probe.last[layer]  # (ranked among the events there were at the retrieval)
            sc = event_scores(eng.windows[layer].events.repr_keys()[:n], q).tolist()
            rank = min(1 + sum(x > sc[i] or (x == sc[i] and j < i) for j, x in enumerate(sc)) for i in ev)
            assert r.ranks[layer] == rank
            if any(i in selected[layer] for i in ev):  # held: within the selection's size
                assert rank <= len(selected[layer])
    if seed == 1:  # the needle over two events reaches one layer in part: held, not whole
        assert (got[2].events, got[2].layers, got[2].whole) == (2, 1, 0)


@pytest.mark.parametrize("scoring", ["max", "lse"])
def test_needle_ranks_of_a_question_follow_its_scoring(scoring):
    """A question's chunk scored token by token: `needle_recall` ranks each needle as the layer's
    own selection did (brute force from the captured queries, the profile's combination)."""
    import numpy as np

    from emllm.memory.selection import LSE_TEMPERATURE as T

    model = tiny_model("llama3.1")
    prof = tiny_profile(segmentation="F", max_block=8, min_block=8, n_mem=16, question_centering=1.0,
                        question_scoring=scoring)
    eng = Engine(model, prof)
    g = torch.Generator().manual_seed(5)
    eng.feed(torch.randint(0, 300, (200,), generator=g))
    selected: dict[int, list[int]] = {}
    eng.on_retrieval = lambda layer, sel, q: selected.__setitem__(layer, sel.ids.tolist())
    probe = RecallProbe(eng)
    eng.begin_question()
    eng.feed(torch.randint(0, 300, (6,), generator=g))
    probe.detach()
    needles = [(4 + 8 * i, 12 + 8 * i) for i in range(12)]  # events 0-11, one each
    got = needle_recall(eng, probe, needles)
    for i, r in enumerate(got):
        assert r.where == "memory" and r.events == 1
        for layer in (0, 1):
            _, q, n = probe.last[layer]
            assert q.dim() == 3  # the question's tokens
            x = q.double().reshape(q.shape[0], -1).numpy() @ eng.windows[layer].events.repr_keys()[:n].double().reshape(n, -1).numpy().T
            z = (x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True)
            sc = z.max(0) if scoring == "max" else T * np.log(np.exp(z / T).sum(0))
            assert r.ranks[layer] == 1 + sum(v > sc[i] or (v == sc[i] and j < i) for j, v in enumerate(sc))
        assert r.layers == sum(i in selected[layer] for layer in (0, 1))


def test_chunk_recall_at_a_budget():
    spans = [(0, 10), (10, 20), (20, 25), (25, 40)]
    ranked = [3, 0, 2, 1]  # best first
    assert chunk_recall(ranked, spans, (22, 24), budget=40) == (3, True)  # 15 + 10 + 5 tokens fit
    assert chunk_recall(ranked, spans, (22, 24), budget=29) == (3, False)  # the prefix stops at chunk 0
    assert chunk_recall(ranked, spans, (12, 14), budget=100) == (4, True)
    assert chunk_recall(ranked, spans, (50, 52), budget=100) == (0, False)


def test_query_centering_scores_against_the_query_less_the_mean_of_those_before(monkeypatch):
    from emllm.engine.window import LayerWindow

    calls = []  # layer 0: (raw query, sum and count before it, the query retrieval used)
    centred_fn = LayerWindow._centred
    def spy(self, query, share):
        out = centred_fn(self, query, share)
        if self.layer_idx == 0:
            calls.append((query.float().clone(), self.query_sum.clone(), self.query_n, out.clone()))
        return out
    monkeypatch.setattr(LayerWindow, "_centred", spy)
    model = tiny_model("llama3.1")
    plain = Engine(model, tiny_profile(question_centering=0.0))  # the paper's scoring throughout
    centred = Engine(model, tiny_profile(query_centering=1.0))
    picked = []
    centred.on_retrieval = lambda layer, sel, q: layer == 0 and picked.append((sel, len(centred.windows[0].events)))
    ids = torch.randint(0, 300, (160,), generator=torch.Generator().manual_seed(1))
    plain.feed(ids)
    calls_plain = len(calls)
    assert plain.windows[0].query_n == 0 and bool((plain.windows[0].query_sum == 0).all())  # kept only when used
    calls.clear()
    centred.feed(ids)
    assert len(calls) == calls_plain >= 5
    for i, (q, total, n, used) in enumerate(calls):
        assert n > 0 or i == 0
        want_q = q - total / n if n else q  # less the mean of those before (none yet: as it is)
        torch.testing.assert_close(used.float(), want_q, rtol=0, atol=1e-6)
        if i:  # every step retrieves once events exist: the sum grew by the previous step's query
            torch.testing.assert_close(total - calls[i - 1][1], calls[i - 1][0], rtol=1e-5, atol=1e-5)
        sel, n_events = picked[i]
        ev = centred.windows[0].events
        want = select_events(event_scores(ev.repr_keys()[:n_events], fold_query(used, ev.repr_heads)), ev.event_lengths()[:n_events],
                             centred.profile.n_mem)
        assert sel.ids.tolist() == want.ids.tolist()
    st = centred.windows[0].state()  # the state carries the mean: a stream continued from it centres alike
    assert int(st["query_n"]) == centred.windows[0].query_n >= len(calls) and st["query_sum"].abs().sum() > 0


def test_repr_normalise_keeps_unit_keys_per_head_and_the_same_events():
    model = tiny_model("llama3.1")
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(2))
    fixed = dict(segmentation="F", min_block=8, max_block=8)  # events cut alike whatever the logits
    plain, unit = Engine(model, tiny_profile(repr_normalise=False, **fixed)), Engine(model, tiny_profile(repr_normalise=True, **fixed))
    plain.step(ids[:8]), unit.step(ids[:8])
    for off in range(8, 200, 8):
        plain.step(ids[off:off + 8])
        unit.step(ids[off:off + 8])
    a, b = plain.windows[0].events, unit.windows[0].events
    assert torch.equal(a.event_lengths(), b.event_lengths()) and len(b) > 10
    r = b.repr_keys()  # [E, H_q, D]
    torch.testing.assert_close(r.norm(dim=-1), torch.ones(r.shape[:2]), rtol=0, atol=1e-5)
    # the first event's keys and attention mass came before any retrieval: the plain ones, scaled per head
    ra = a.repr_keys()[:1]
    torch.testing.assert_close(r[:1], ra / ra.norm(dim=-1, keepdim=True), rtol=1e-5, atol=1e-6)


def test_mean_representatives_need_no_attention_mass():
    """representative: mean: every event's key is the mean of its tokens' keys, no attention mass
    is kept; the attention itself is the paper's (the same logits as long as retrieval has not
    chosen differently: here, while no event has closed)."""
    model = tiny_model("llama3.1")
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(3))
    fixed = dict(segmentation="F", min_block=8, max_block=8, repr_normalise=False)  # (unit length: the test above)
    plain = Engine(model, tiny_profile(representative="attention", **fixed))
    mean = Engine(model, tiny_profile(representative="mean", **fixed))
    for off in range(0, 200, 8):
        a, b = plain.step(ids[off:off + 8]), mean.step(ids[off:off + 8])
        if not len(plain.windows[0].events):
            assert torch.equal(a, b)
    for w in mean.windows:
        e = w.events
        assert len(e) > 10 and float(w.local_mass.abs().sum()) == 0.0 and float(w.rem_mass.abs().sum()) == 0.0
        k = e.keys.view()  # [H_kv, T, D], events in order
        assert e.repr_keys().shape[1] == k.shape[0] == e.repr_heads  # one key per KV head: a group's heads share it
        want = torch.stack([k[:, s:s + n].mean(1) for s, n in zip(e.starts.view().tolist(), e.event_lengths().tolist())])
        torch.testing.assert_close(e.repr_keys(), want, rtol=1e-5, atol=1e-6)
    assert any(float(w.local_mass.abs().sum()) > 0 for w in plain.windows)


def test_question_centering_reads_the_document_plainly_and_centres_the_question():
    """question_centering: the document's retrievals are the plain profile's (same events, same
    selections), the running mean query is kept meanwhile; from `begin_question` each query is
    centred by the mean of all queries before it, the document's included."""
    model = tiny_model("llama3.1")
    ids = torch.randint(0, 300, (160,), generator=torch.Generator().manual_seed(3))
    question = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(4))
    plain, asked = Engine(model, tiny_profile(question_centering=0.0)), Engine(model, tiny_profile(question_centering=1.0, question_scoring="mean"))
    seen: dict[str, list] = {"plain": [], "asked": []}
    for name, eng in (("plain", plain), ("asked", asked)):
        eng.on_retrieval = lambda layer, sel, q, name=name: layer == 0 and seen[name].append((sel.ids.tolist(), q.float().clone()))
        eng.feed(ids)
    assert seen["plain"] == [] or [s for s, _ in seen["plain"]] == [s for s, _ in seen["asked"]]
    assert len(seen["asked"]) >= 5
    for (a, qa), (b, qb) in zip(seen["plain"], seen["asked"]):
        assert a == b and torch.equal(qa, qb)  # the document read with the paper's scoring
    w = asked.windows[0]
    assert w.query_n >= len(seen["asked"]) and plain.windows[0].query_n == 0  # the mean kept for the question
    total, n = w.query_sum.clone(), w.query_n
    before = len(seen["asked"])
    asked.begin_question()
    asked.feed(question)
    sel, used = seen["asked"][before]
    raw = w.query_sum - total  # the question chunk's own query, added after its retrieval
    torch.testing.assert_close(used, fold_query(raw - total / n, w.events.repr_heads), rtol=0, atol=1e-5)
    ev = w.events
    want = select_events(event_scores(ev.repr_keys(), used), ev.event_lengths(), asked.profile.n_mem)
    assert sel == want.ids.tolist()


def test_question_centering_answer_false_centres_the_question_alone():
    model = tiny_model("llama3.1")
    ids = torch.randint(0, 300, (160,), generator=torch.Generator().manual_seed(5))
    for centre_answer in (True, False):
        eng = Engine(model, tiny_profile(question_centering=1.0, question_centering_answer=centre_answer,
                                         answer_retrieval="token"))  # (the answer's tokens retrieve)
        got: list = []
        eng.on_retrieval = lambda layer, sel, q: layer == 0 and got.append(q.float().clone())
        eng.feed(ids)
        eng.begin_question()
        eng.feed(ids[:5])
        w = eng.windows[0]
        total, n = w.query_sum.clone(), w.query_n
        k = len(got)
        next(iter(eng.generate_iter(2)))  # the first token is chosen from the question's logits
        list(eng.generate_iter(1))  # one step of the answer
        raw = w.query_sum - total
        want = raw - total / n if centre_answer else raw
        torch.testing.assert_close(got[k], fold_query(want, w.events.repr_heads), rtol=0, atol=1e-5)


def test_mean_keys_per_kv_head_select_as_per_query_head():
    """A memory keeping one mean key per KV head (store version 7) scores a query summed over each
    group of query heads: mathematically the score of the same key repeated for every query head
    (the layout before). Same selections at every step and layer, hence the same logits, on a GQA
    model (4 query heads, 2 KV heads); the keys themselves are the repeated ones, de-duplicated."""
    from emllm.memory.events import EventMemory

    model = tiny_model("llama3.1")
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ids = torch.randint(0, 300, (240,), generator=torch.Generator().manual_seed(5))
    prof = tiny_profile(representative="mean")
    new = Engine(model, prof)
    old = Engine(model, prof, memory=lambda i: EventMemory(cfg.num_key_value_heads, cfg.num_attention_heads, head_dim,
                                                             torch.float32, torch.device("cpu")))
    seen: dict[str, list] = {"new": [], "old": []}
    for name, eng in (("new", new), ("old", old)):
        eng.on_retrieval = lambda layer, sel, q, name=name: seen[name].append((layer, sel.ids.tolist(), q.shape[0]))
    for off in range(0, 240, 16):
        a, b = new.step(ids[off:off + 16]), old.step(ids[off:off + 16])
        assert torch.equal(a, b)
    assert [x[:2] for x in seen["new"]] == [x[:2] for x in seen["old"]] and len(seen["new"]) > 20
    assert {x[2] for x in seen["new"]} == {cfg.num_key_value_heads} and {x[2] for x in seen["old"]} == {cfg.num_attention_heads}
    for wn, wo in zip(new.windows, old.windows):
        g = cfg.num_attention_heads // cfg.num_key_value_heads
        assert torch.equal(wo.events.repr_keys(), wn.events.repr_keys().repeat_interleave(g, 1))


def test_token_max_is_each_events_best_standardised_token_score():
    import numpy as np

    from emllm.memory.selection import token_max

    g = torch.Generator().manual_seed(7)
    s = torch.randn(5, 40, generator=g)
    s[3] = 2.5  # a token whose scores are all equal decides nothing: 0 for every event
    got = token_max(s)
    x = s.double().numpy()
    sd = x.std(1, keepdims=True)
    z = np.where(sd > 0, (x - x.mean(1, keepdims=True)) / np.where(sd > 0, sd, 1), 0.0)
    np.testing.assert_allclose(got.numpy(), z.max(0), rtol=0, atol=1e-12)
    assert got.dtype == torch.float64
    # one token: its z-score ranks the events as its score does (a generated token's retrieval)
    one = s[:1]
    assert torch.equal(torch.sort(token_max(one), descending=True, stable=True).indices,
                       torch.sort(one[0], descending=True, stable=True).indices)


def test_token_lse_is_a_soft_maximum_of_the_z_scores():
    import numpy as np

    from emllm.memory.selection import LSE_TEMPERATURE as T
    from emllm.memory.selection import token_lse, token_max

    g = torch.Generator().manual_seed(8)
    s = torch.randn(6, 50, generator=g)
    s[2] = -1.0  # a token whose scores are all equal: z 0 for every event, still counted in the sum
    got = token_lse(s)
    x = s.double().numpy()
    sd = x.std(1, keepdims=True)
    z = np.where(sd > 0, (x - x.mean(1, keepdims=True)) / np.where(sd > 0, sd, 1), 0.0)
    np.testing.assert_allclose(got.numpy(), T * np.log(np.exp(z / T).sum(0)), rtol=0, atol=1e-12)
    best = token_max(s)
    assert got.dtype == torch.float64 and bool((got >= best).all()) and bool((got <= best + T * np.log(6) + 1e-12).all())
    # an event two tokens find beats one that only one token finds as well
    two = torch.tensor([[3.0, 0, 0, 0, 0], [0, 3.0, 0, 0, 0], [3.0, 0, 0, 0, 0]])  # event 0 found by two tokens, 1 by one
    assert float(token_max(two)[0]) == float(token_max(two)[1]) and float(token_lse(two)[0]) > float(token_lse(two)[1])
    one = s[:1]  # one token: its z-score
    torch.testing.assert_close(token_lse(one), token_max(one), rtol=0, atol=1e-12)


@pytest.mark.parametrize("scoring", ["max", "lse"])
def test_question_scoring_selects_by_each_tokens_z_score(scoring):
    """question_scoring "max" and "lse": a question's chunk retrieves with every token's centred
    query, each event scoring its best token's z-score, or their soft maximum (brute force here);
    the document's chunks and a generated token retrieve with one query, as with "mean"."""
    import numpy as np

    from emllm.memory.selection import LSE_TEMPERATURE as T

    model = tiny_model("llama3.1")
    ids = torch.randint(0, 300, (160,), generator=torch.Generator().manual_seed(3))
    question = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(4))
    # (the answer's tokens retrieve, each with its own query: answer_retrieval "token")
    eng = Engine(model, tiny_profile(question_centering=1.0, question_scoring=scoring, answer_retrieval="token"))
    seen: list = []
    w = eng.windows[0]
    # (the events there are at the retrieval: the step closes more after it)
    eng.on_retrieval = lambda layer, sel, q: layer == 0 and seen.append((sel.ids.tolist(), q.float().clone(), len(w.events)))
    eng.feed(ids)
    assert seen and all(q.dim() == 2 for _, q, _ in seen)  # the document: one mean query a chunk
    total, n = w.query_sum.clone(), w.query_n
    before = len(seen)
    eng.begin_question()
    eng.feed(question)
    sel, used, e = seen[before]
    assert used.shape == (6, w.events.repr_heads, w.head_dim)  # one query per token
    raw = w.query_sum - total  # the chunk's mean query (added after its retrieval)
    torch.testing.assert_close(used.mean(0), fold_query(raw - total / n, w.events.repr_heads), rtol=0, atol=1e-5)
    ev = w.events
    reprs = ev.repr_keys()[:e].double().reshape(e, -1).numpy()
    s = used.double().reshape(6, -1).numpy() @ reprs.T  # [T, E]
    zs = (s - s.mean(1, keepdims=True)) / s.std(1, keepdims=True)
    z = zs.max(0) if scoring == "max" else T * np.log(np.exp(zs / T).sum(0))
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    lengths = ev.event_lengths()[:e].tolist()
    want, used_tokens = [], 0
    for i in order:  # best first while they fit in the budget
        if used_tokens + lengths[i] > eng.profile.n_mem:
            break
        want.append(i)
        used_tokens += lengths[i]
    assert sel == sorted(want) and len(sel) >= 2
    k = len(seen)
    eng.generate(2)
    assert len(seen) > k and all(q.dim() == 2 for _, q, _ in seen[k:])  # a generated token: one query


def test_question_scoring_rejects_unknown_values():
    import pytest

    from emllm.config import ProfileError

    with pytest.raises(ProfileError, match="question_scoring: must be one of mean, max, lse"):
        tiny_profile(question_scoring="median")


def test_a_trace_says_what_its_scores_are():
    """`inspect --query` shows a question's z-scores (question_scoring "max") and a generated
    token's inner products: each recorded step says which, and the table marks them."""
    from rich.console import Console

    from emllm.app.trace import Trace
    from emllm_cli.render import retrieval_view

    model = tiny_model("llama3.1")
    eng = Engine(model, tiny_profile(question_centering=1.0, question_scoring="max", answer_retrieval="token"))
    eng.feed(torch.randint(0, 300, (160,), generator=torch.Generator().manual_seed(3)))
    trace = Trace.attach(eng)
    eng.begin_question()
    eng.feed(torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(4)))
    eng.generate(1)
    trace.detach()
    by_step = {(r.step, r.scoring) for r in trace.records}
    assert by_step == {(0, "z"), (1, "dot")}
    q = [r for r in trace.records if r.step == 0 and r.layer == 0][0]
    assert q.scores.numel() and float(q.scores.abs().max()) < 10  # z-scores, not inner products
    # the table: a question's scores marked z, with a caption saying so; a token's plain
    ev = lambda e, sc: {"event": e, "tokens": [0, 4], "layers": 1, "preview": "text", "score": sc}  # noqa: E731
    doc = {"query": "q?", "layers": 1, "bins": 2, "coverage": [[0.5, 0.0]], "top_events": [],
           "layer": {"index": 0, "steps": [{"step": 0, "scoring": "z", "events": [ev(3, 2.5)]},
                                          {"step": 1, "scoring": "dot", "events": [ev(4, 17.25)]}]}}
    con = Console(record=True, width=200)
    con.print(retrieval_view(doc, 8))
    out = con.export_text()
    assert "2.500 z" in out and "17.250 " in out and "17.250 z" not in out
    assert "z: the event's z-scores over the question's tokens, their best" in out


def test_token_z_and_lse_keep_the_bits_of_their_out_of_place_formulas():
    # token_z works in place on its float64 copy (fresh memory is costly at 1M tokens); the bits
    # must stay those of the formulas the stores' selections were made with.
    from emllm.memory.selection import token_lse, token_z
    g = torch.Generator().manual_seed(9)
    for t, e in ((1, 7), (5, 1000), (21, 4000)):
        x = torch.randn(t, e, generator=g) * 3
        x[t // 2] = 1.25  # a token whose scores are all equal: z 0
        x0 = x.clone()
        s = x.double()
        mean, sd = s.mean(1, keepdim=True), s.std(1, correction=0, keepdim=True)
        z = torch.where(sd > 0, (s - mean) / torch.where(sd > 0, sd, 1.0), 0.0)
        assert torch.equal(token_z(x), z)
        assert torch.equal(token_lse(x), 0.5 * torch.logsumexp(z / 0.5, 0))
        assert torch.equal(x, x0)  # the scores themselves untouched
        xd = x.double()
        token_z(xd)
        assert torch.equal(xd, x0.double())  # float64 scores too
