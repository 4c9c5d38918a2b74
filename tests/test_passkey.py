"""The passkey prompt, and the first proof: SmolLM2 past its 8k context with emllm."""

from __future__ import annotations

import random

import pytest

from emllm.engine.stream import Engine
from emllm.evals.passkey import build_prompt, parse_length, read_plan, run_emllm, score


def test_parse_length():
    assert parse_length("4k") == 4096 and parse_length("1m") == 1 << 20 and parse_length("1500000") == 1500000
    for bad in ("foo", "-1k", "0", "", "inf", "nan"):
        with pytest.raises(ValueError):
            parse_length(bad)


def test_score_takes_first_integer():
    assert score(" 12345. Remember", "12345") and not score("1 12345", "12345") and not score("none", "12345")


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_places_needle(smollm2, depth):
    _, tok, _ = smollm2
    p = build_prompt(tok, 3000, depth, random.Random(3))
    assert abs(len(p.document) + len(p.question) - 3000) <= 8
    text = tok.decode(p.document)
    assert text.count(p.key) == 2
    frac = text.index(p.key) / len(text)
    assert abs(frac - depth) < 0.1
    (s, e), = p.needles  # the needle's span holds the key twice, as the sentence does
    assert tok.decode(p.document[s:e]).count(p.key) == 2 and tok.decode(p.document[:s]).count(p.key) == 0
    assert tok.decode(p.question).rstrip().endswith("The pass key is")


@pytest.mark.slow
def test_smollm2_passkey_beyond_its_context(smollm2):
    model, tok, prof = smollm2
    p = build_prompt(tok, 10_000, 0.5, random.Random(7))  # 8k context: the plain model cannot see it all
    found: list = []
    answer = run_emllm(lambda: Engine(model, prof), tok, p, recall=found)
    assert score(answer, p.key), answer
    # found, and retrieved: the needle lies in the memory and most layers held it at the question
    (r,) = found
    assert r.where == "memory" and r.share > 0.5 and min(r.ranks) == 1, r


def test_results_log_reads_back_its_grid_only(tmp_path):
    """Results come back for runs of the same grid only (other seeds, older headers without a grid
    are not ours); a line a killed run cut short is ended before the next run writes, and skipped."""
    from emllm.evals import results_log
    log, g0, g1 = tmp_path / "sub" / "r.jsonl", {"model": "m", "seed": 0, "sizes": (1, 2)}, {"model": "m", "seed": 1}
    results_log.start_run(log, g0, argv=["x"])
    results_log.append(log, {"length": 8, "depth": 0.5, "trial": 0})
    results_log.start_run(log, g1)
    results_log.append(log, {"length": 8, "depth": 0.5, "trial": 1})
    results_log.append(log, {"run": "old", "threads": 1})  # a header of an older format: no grid
    results_log.append(log, {"length": 8, "depth": 1.0, "trial": 9})
    with open(log, "a") as f:
        f.write('{"length": 8, "dep')  # killed while writing
    assert results_log.last_grid(log) is None  # the last header is of an older format
    results_log.start_run(log, g0)
    results_log.append(log, {"length": 16, "depth": 0.0, "trial": 0})
    assert results_log.results_of(log, g0) == [{"length": 8, "depth": 0.5, "trial": 0}, {"length": 16, "depth": 0.0, "trial": 0}]
    assert results_log.results_of(log, g1) == [{"length": 8, "depth": 0.5, "trial": 1}]
    assert results_log.results_of(tmp_path / "none.jsonl", g0) == [] and results_log.last_grid(tmp_path / "none.jsonl") is None
    assert results_log.last_grid(log) == results_log.normal(g0) == {"model": "m", "seed": 0, "sizes": [1, 2]}
    lines = log.read_text().splitlines()
    assert lines[-3] == '{"length": 8, "dep' and '"grid": {"model": "m", "seed": 0, "sizes": [1, 2]}' in lines[-2]


def test_runs_of_two_grids_appending_at_once_each_read_back_their_own(tmp_path):
    """Two runs writing one file at the same time interleave their lines: each result is its own
    run's (by the id it carries), not the last header's; results of older runs, without an id,
    still go by the header above them."""
    from emllm.evals import results_log
    log, ga, gb = tmp_path / "r.jsonl", {"model": "m", "haystack": "prose"}, {"model": "m"}
    results_log.start_run(log, gb)
    results_log.append(log, {"n": 0})  # an older run's result: no id
    a = results_log.start_run(log, ga)
    b = results_log.start_run(log, gb)
    assert a != b
    results_log.append(log, {"n": 1}, run=a)
    results_log.append(log, {"n": 2}, run=b)
    results_log.start_run(log, ga)  # a third run, of ga again: b's later results are still b's
    results_log.append(log, {"n": 3}, run=b)
    results_log.append(log, {"n": 4}, run=a)
    assert results_log.results_of(log, ga) == [{"n": 1}, {"n": 4}]
    assert results_log.results_of(log, gb) == [{"n": 0}, {"n": 2}, {"n": 3}]
    assert '"run_id": "%s"' % b in log.read_text().splitlines()[5]


def test_a_log_written_before_a_profile_key_existed_is_the_same_grid(tmp_path):
    """A run kept by code whose profiles had fewer keys is carried on by today's: a missing key
    meant what that code did (the default, or the store's BEFORE_THE_KEY value); another value
    of it is another grid."""
    import dataclasses

    from emllm.app.stream import profile_dict
    from emllm.config import load_profile
    from emllm.evals import results_log

    today = {"model": "m", "profile": profile_dict(load_profile("smollm2"))}
    old = {**today, "profile": {k: v for k, v in today["profile"].items() if k not in ("surprise_head", "distinct_events")}}
    old["profile"]["distinct_events"] = True  # (written with the key: it stays as it was)
    log = tmp_path / "r.jsonl"
    results_log.start_run(log, old)
    results_log.append(log, {"length": 8, "trial": 0})
    assert results_log.results_of(log, today) == [{"length": 8, "trial": 0}]
    assert results_log.last_grid(log) == results_log.normal(today)
    other = {**today, "profile": {**today["profile"], "surprise_head": "shortlist"}}
    assert results_log.results_of(log, other) == []
    gone = {**old, "profile": {k: v for k, v in old["profile"].items() if k != "distinct_events"}}
    results_log.start_run(log, gone)  # before distinct_events: the code of then kept every copy
    assert results_log.last_grid(log) != results_log.normal(today)
    assert results_log.last_grid(log)["profile"]["distinct_events"] is False
    assert {f.name for f in dataclasses.fields(type(load_profile("smollm2")))} == set(results_log.last_grid(log)["profile"])


def test_a_grid_with_reread_answers_as_reread_does_from_the_same_read(tiny):
    """run_grid(reread=True): a "reread" row per trial, answered as `app.reread.reread` answers on a
    fresh read of the prompt, saying whether the tokens read again held the whole needle; the
    emllm rows are those of a grid without it (recording the votes changes nothing)."""
    from emllm.app.reread import reread
    from emllm.config import load_profile_file
    from emllm.evals.passkey import _stop_ids, run_grid

    from .helpers import load_tiny
    folder, prof_path, _, _ = tiny
    model, tok = load_tiny(folder)
    prof = load_profile_file(prof_path)
    span = prof.n_init + prof.n_mem + prof.n_local
    args = (model, tok, lambda: Engine(model, prof), [300], [0.1, 0.5, 0.9], 1, 0)
    rows = run_grid(*args, reread=True)
    plain = run_grid(*args)
    assert [r.method for r in rows] == ["emllm", "reread"] * 3 and [r.method for r in plain] == ["emllm"] * 3
    assert [(r.depth, r.answer) for r in rows if r.method == "emllm"] == [(r.depth, r.answer) for r in plain]
    for r in rows[1::2]:
        p = build_prompt(tok, 300, r.depth, random.Random(f"0/300/{r.depth}/0"))
        assert r.key == p.key
        eng = Engine(model, prof)
        eng.feed(p.document)
        reader, rr = reread(eng, p.question, tok, 10)
        want = tok.decode(reader.generate(10, stop_ids=set(_stop_ids(tok, model))), skip_special_tokens=True)
        assert r.answer == want.strip() and r.correct == score(want, p.key)
        covered = set(range(prof.n_init)) | {t for s, e in rr.passages for t in range(s, e)}
        assert r.needle_read == (set(range(p.needle_at, p.needle_at + p.needle_len)) <= covered)
        assert r.reread_tokens == len(rr.ids) <= span - len(p.question) and r.needle_layers is not None


def test_the_read_plan_counts_the_shared_filler_once():
    """Trials in the order of their needle (at depth x length): each reads what follows its needle and
    what the shared filler grows by for it; without sharing, its whole document."""
    plan = read_plan([100, 200], [0.5, 1.0], 1, shared=True)
    # needles at 50 (100, 0.5), 100 (100, 1 and 200, 0.5), 200 (200, 1)
    assert plan == {(100, 0.5, 0): 100, (100, 1.0, 0): 50, (200, 0.5, 0): 100, (200, 1.0, 0): 100}
    assert sum(plan.values()) == 200 + (50 + 0 + 100 + 0)  # the longest filler once, and every document's rest
    assert read_plan([100, 200], [0.5, 1.0], 2, shared=False) == {
        (n, d, t): n for n in (100, 200) for d in (0.5, 1.0) for t in (0, 1)}
