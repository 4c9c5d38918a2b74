"""The on-disk store: ask after ingest (same and new process), append, crash safety, validation.

A tiny random Llama with SmolLM2's tokenizer keeps every ingest to seconds; the store code does
not know the difference.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from emllm.app import ingest as ing

from emllm.app import stream
from emllm.app.ask import Session
from emllm.config import load_profile_file
from emllm.engine.stream import Engine
from emllm.store import Store, StoreError
from .helpers import EMLLM, QUESTION, assert_same_state, cli_env, ingest_now_and_later, ingest_store, load_tiny, run, run_in_process, store_arrays, store_files, store_state, words


















def _sketching(prof: Path, tmp_path: Path) -> Path:
    """The tiny profile with a sketch from 40 events on (the stores below reach more)."""
    out = tmp_path / "tiny-sketch.yaml"
    out.write_text(prof.read_text() + "sketch_threshold: 40\n")
    return out






@pytest.mark.slow
def test_ask_equals_the_in_ram_engine_in_this_and_a_new_process(tiny, tmp_path):
    folder, prof, _, _ = tiny
    doc = words(0, 700)
    store = tmp_path / "s"
    ingest_store(store, folder, prof, [("doc", doc)])
    model, tok = load_tiny(folder)

    # Reference: the plain in-RAM engine over the same stream, chunked the same way.
    with Store.open(store) as st:
        job = st.job.read().long()
        tail = stream.pending_tokens(st)
        session = Session(st, model, tok)
        q_ids = session.question_ids(QUESTION)
        got = session.read_question(QUESTION)
        got_answer = list(session.engine.generate_iter(8))
        assert st.manifest["rows"]["events"] > 10  # the question reads retrieved memory, not just a window
    assert 0 < len(tail) < 16 and job[-len(tail) :].tolist() == tail
    # The question is a chunk of its own (spec §4), as when the in-RAM engine reads the document,
    # then the question: the tail short of a chunk is one chunk, the question the next.
    ref = Engine(model, load_profile_file(prof))
    ref.feed(job)
    ref.begin_question()  # as `ask` does: the question's retrieval with the profile's question_centering
    ref_logits = ref.feed(torch.tensor(q_ids))
    ref_answer = ref.generate(8)
    torch.testing.assert_close(got, ref_logits, atol=1e-5, rtol=0)
    assert got_answer == ref_answer

    # A new process maps the store and computes the same question logits.
    out = tmp_path / "logits.npy"
    code = (
        "import sys, numpy as np, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from emllm.store import Store\nfrom emllm.app.ask import Session\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, dtype=torch.float32).eval()\n"
        f"t = AutoTokenizer.from_pretrained({str(folder)!r})\n"
        f"s = Session(Store.open({str(store)!r}), m, t)\n"
        f"np.save({str(out)!r}, s.read_question({QUESTION!r}).numpy())\n"
        "print(list(s.engine.generate_iter(8)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300)
    assert r.returncode == 0, r.stderr
    torch.testing.assert_close(torch.from_numpy(np.load(out)), got, atol=1e-5, rtol=0)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == got_answer


def test_asking_leaves_the_store_unchanged(tiny, tmp_path):
    folder, prof, _, _ = tiny
    store = tmp_path / "s"
    ingest_store(store, folder, prof, [("doc", words(1, 300))])
    before = store_files(store)
    model, tok = load_tiny(folder)
    for _ in range(2):
        with Store.open(store) as st:
            answer = list(Session(st, model, tok).answer(QUESTION, 40))  # long enough to close events
    assert len(answer) > 0
    assert store_files(store) == before


@pytest.mark.parametrize("fit_block", [None, 16])
def test_append_equals_one_call(tiny, tmp_path, monkeypatch, fit_block):
    from emllm.memory import sketch
    if fit_block:  # the sketch fitted and projected in blocks of 16 events: bytes that do not depend on the blocks
        monkeypatch.setattr(sketch, "FIT_BLOCK_ROWS", fit_block)
    folder, prof, _, _ = tiny
    prof = _sketching(prof, tmp_path)
    ingest_now_and_later(tmp_path, folder, prof, [("a", words(2, 300))], [("b", words(3, 250))])
    assert store_arrays(tmp_path / "one") == store_arrays(tmp_path / "two")
    # fitted (and refitted as the store doubled) during the second document in one, at its append in two
    sk = json.loads((tmp_path / "one" / "manifest.json").read_text())["sketch"]
    assert sk["trained_on"] >= 80 and f"layers/01.{sk['trained_on']}.p" in store_arrays(tmp_path / "one")
    assert_same_state(tmp_path / "one", tmp_path / "two")
    m1, m2 = (json.loads((tmp_path / n / "manifest.json").read_text()) for n in ("one", "two"))
    assert m1["documents"] == m2["documents"] and m1["rows"] == m2["rows"]


def test_a_reader_keeps_its_commit_while_a_writer_commits(tiny, tmp_path):
    # A commit deletes the state file the previous manifest named; a reader opened before it
    # still loads that state (it opened the file with the manifest).
    folder, prof, _, _ = tiny
    store = tmp_path / "s"
    ingest_store(store, folder, prof, [("a", words(11, 200))])
    model, tok = load_tiny(folder)
    want = store_state(store)
    with Store.open(store) as reader:
        with Store.open(store, writable=True) as st:
            engine = stream.open_engine(st, model)
            ing.add_documents(st, tok, [("b", words(12, 200))])
            ing.run_job(st, engine, 2)
        assert not (store / reader.manifest["state"]["file"]).exists()
        got = reader.load_state()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        session = Session(reader, model, tok)  # and it can still be asked, at its commit
        assert session.engine.n_tokens == reader.manifest["rows"]["tokens"]


def _wait_for_commit(store: Path, proc: subprocess.Popen, at_least: int) -> bool:
    """Until the store has committed `at_least` tokens; False if the process ended first."""
    while proc.poll() is None:
        try:
            if json.loads((store / "manifest.json").read_text())["rows"]["tokens"] >= at_least:
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    return False


@pytest.mark.slow
# int4: codes and scales, rows of bytes; query centering: the running mean query is state too
@pytest.mark.parametrize("kv_format,centering", [("auto", 0.0), ("int4", 1.0)])
def test_kill_9_then_resume_equals_an_uninterrupted_ingest(tiny, tmp_path, kv_format, centering):
    folder, prof, _, _ = tiny
    prof = _sketching(prof, tmp_path)
    prof.write_text(prof.read_text() + f"query_centering: {centering}\n")
    doc = tmp_path / "doc.txt"
    doc.write_text(words(4, 3000))
    ref = tmp_path / "ref"
    r = run("ingest", str(doc), "-m", str(folder), "--profile", str(prof), "--store", str(ref), "--commit-every", "1",
            "--format", kv_format, home=tmp_path)
    assert r.returncode == 0, r.stderr
    total = json.loads((ref / "manifest.json").read_text())["rows"]["tokens"]

    store = tmp_path / "crashed"
    rng = random.Random(0)
    env = {**os.environ, **cli_env(tmp_path)}

    kills = 0
    first = [EMLLM, "ingest", str(doc), "-m", str(folder), "--profile", str(prof), "--store", str(store), "--commit-every", "1",
             "--format", kv_format]
    resume = [EMLLM, "ingest", "--resume", "--store", str(store), "--commit-every", "1"]
    args = first
    committed = 0
    for _ in range(3):
        p = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if _wait_for_commit(store, p, committed + 1):
            time.sleep(rng.uniform(0, 0.3))
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
        with Store.open(store) as st:  # the last commit is readable after each kill
            committed = st.manifest["rows"]["tokens"]
        args = resume
    assert kills >= 2, "the ingest finished before it could be killed: make the document longer"
    assert committed < total
    r = subprocess.run(resume, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got, want = store_arrays(store), store_arrays(ref)
    assert sorted(got) == sorted(want) and any(k.startswith("sketch") for k in want)
    assert [k for k in want if got[k] != want[k]] == []
    assert_same_state(store, ref)


# -- errors: one line, exit 1, store untouched ----------------------------------------------------
@pytest.fixture(scope="module")
def stored_once(tiny, tmp_path_factory):
    """One store, ingested by the executable once for all the cases below (each gets a copy)."""
    folder, prof, _, _ = tiny
    home = tmp_path_factory.mktemp("stored")
    doc = home / "doc.txt"
    doc.write_text(words(5, 200))
    r = run("ingest", str(doc), "-m", str(folder), "--profile", str(prof), "--store", "s", home=home)
    assert r.returncode == 0, r.stderr
    return home


@pytest.fixture
def stored(stored_once, tmp_path):
    shutil.copy(stored_once / "doc.txt", tmp_path / "doc.txt")
    shutil.copytree(stored_once / "stores", tmp_path / "stores")
    return tmp_path / "stores" / "s"


def _edit_manifest(store: Path, change, fix_checksum: bool) -> None:
    from emllm.store.manifest import checksum as _checksum

    m = json.loads((store / "manifest.json").read_text())
    change(m)
    if fix_checksum:
        m["checksum"] = _checksum(m)
    (store / "manifest.json").write_text(json.dumps(m))


def _truncate(store: Path) -> None:
    p = store / "layers" / "01.k"
    p.write_bytes(p.read_bytes()[:-10])


CASES = {
    "truncated array": (lambda s, t: _truncate(s), ["ask", "hi", "--store", "s"], "truncated"),
    "edited manifest": (lambda s, t: _edit_manifest(s, lambda m: m["rows"].update(tokens=5), False),
                        ["ask", "hi", "--store", "s"], "checksum"),
    "newer format": (lambda s, t: _edit_manifest(s, lambda m: m.update(version=99), True),
                     ["ask", "hi", "--store", "s"], "upgrade emllm"),
    "representative heads of neither kind": (lambda s, t: _edit_manifest(s, lambda m: m.update(repr_heads=3), True),
                                             ["ask", "hi", "--store", "s"], "neither the KV heads nor the query heads"),
    "a key per KV head from attention": (
        lambda s, t: _edit_manifest(s, lambda m: m["profile"].update(representative="attention"), True),
        ["ask", "hi", "--store", "s"], "representative keys per KV head with representative 'attention'"),
    "wrong model": (lambda s, t: None, ["ingest", "{doc}", "--append", "--store", "s", "-m", "{other_model}"], "differs"),
    "fine-tuned model": (lambda s, t: None, ["ingest", "{doc}", "--append", "--store", "s", "-m", "{tuned}"],
                         "weights differ from those the store was written with"),
    "wrong tokenizer": (lambda s, t: None, ["ingest", "{doc}", "--append", "--store", "s", "-m", "{other_tok}"], "tokenizer differs"),
    "second writer": (None, ["ingest", "{doc}", "--append", "--store", "s"], "being written by another"),
    "not a store": (lambda s, t: (t / "plain").mkdir(), ["ask", "hi", "--store", "{plain}"], "not an emllm store"),
    "store exists": (lambda s, t: None, ["ingest", "{doc}", "--store", "s"], "already exists"),
    "append to nothing": (lambda s, t: None, ["ingest", "{doc}", "--append", "--store", "nope"], "no store"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_store_errors(case, tiny, tuned, stored, tmp_path):
    damage, args, needle = CASES[case]
    _, _, other_model, other_tok = tiny
    lock = None
    if damage is None:  # hold the writer lock, as a running ingest does
        lock = os.open(stored / "lock", os.O_RDWR)
        fcntl.flock(lock, fcntl.LOCK_EX)
    else:
        damage(stored, tmp_path)
    before = store_files(stored)
    fill = {"doc": str(tmp_path / "doc.txt"), "other_model": str(other_model), "other_tok": str(other_tok),
            "plain": str(tmp_path / "plain"), "tuned": str(tuned)}
    # in this process (the entry point, as the executable: ~5 s of imports saved a case); `stored_once`
    # and the tests above run the executable itself
    r = run_in_process(*[a.format(**fill) for a in args], home=tmp_path)
    if lock is not None:
        os.close(lock)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert store_files(stored) == before


def test_weights_sample_tells_a_fine_tune_and_passes_what_it_cannot_compare(tiny, tuned, tmp_path):
    """The metadata hash cannot tell a fine-tune of the same shape; the sampled values do. A store
    written before the sample (no key) and weights offloaded to meta ("") are not compared."""
    from emllm.store import Geometry, Identity, weights_sample

    base, tok = load_tiny(tiny[0])
    ft, _ = load_tiny(tuned)
    mine, theirs = stream.identity_of("m", base, tok), stream.identity_of("m", ft, tok)
    assert mine.weights_hash == theirs.weights_hash and mine.config_hash == theirs.config_hash
    assert mine.weights_sample != theirs.weights_sample and len(mine.weights_sample) == 16
    assert mine == stream.identity_of("m", load_tiny(tiny[0])[0], tok)  # the same weights loaded again: equal
    st = Store.create(tmp_path / "s", mine, {"name": "t"}, Geometry(2, 2, 4, 16, len(tok), "float32"))
    st.check_identity(mine)
    with pytest.raises(StoreError, match="weights differ from those the store was written with .'m': same shapes"):
        st.check_identity(theirs)
    st.check_identity(Identity(**{**theirs.as_dict(), "weights_sample": ""}))
    del st.manifest["identity"]["weights_sample"]  # as a store of an older emllm reads
    st.check_identity(theirs)
    st.close()
    with torch.device("meta"):
        offloaded = AutoModelForCausalLM.from_config(base.config)
    assert weights_sample(offloaded) == ""


def test_ask_without_any_store(tmp_path):
    r = run("ask", "anything", home=tmp_path)
    assert r.returncode == 1 and "no store yet" in r.stderr


def test_library_refuses_a_truncated_file_before_writing(tiny, tmp_path):
    folder, prof, _, _ = tiny
    store = tmp_path / "s"
    ingest_store(store, folder, prof, [("doc", words(6, 200))])
    _truncate(store)
    before = store_files(store)
    with pytest.raises(StoreError, match="truncated"):
        Store.open(store, writable=True)
    assert store_files(store) == before


# -- the commands' normal paths, JSON schemas (README), stdin, Ctrl-C -----------------------------
INSPECT_KEYS = {"store": str, "format_version": int, "model": str, "identity": dict, "profile": dict, "created": str,
                "updated": str, "tokens": int, "processed_tokens": int, "events": int, "event_tokens": int,
                "event_sizes": dict, "documents": list, "complete": bool, "bytes": dict, "representative": str,
                "representative_heads": int}
RETRIEVAL_KEYS = {"query": str, "layers": int, "bins": int, "steps": int, "coverage": list, "top_events": list}


def _check(doc: dict, schema: dict) -> None:
    for k, t in schema.items():
        assert isinstance(doc[k], t), (k, doc[k])


@pytest.mark.slow
def test_ingest_ask_inspect_through_the_executable(tiny, tmp_path):
    folder, prof, _, _ = tiny
    doc = tmp_path / "a.txt"
    doc.write_text(words(7, 400))
    r = run("ingest", str(doc), "-m", str(folder), "--profile", str(prof), "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["store"] == str(tmp_path / "stores" / "a") and s["events"] > 0 and s["tokens"] == s["ingested_tokens"]
    # stdin, appended
    r = subprocess.run([*_cmd(), "ingest", "-", "--append", "--store", "a", "--json"], input=words(8, 100),
                       capture_output=True, text=True, env=_env(tmp_path))
    assert r.returncode == 0, r.stderr
    s2 = json.loads(r.stdout)
    assert s2["documents"] == [str(doc), "stdin"] and s2["tokens"] > s["tokens"]
    # this run's tokens: the stdin text and its separator, not the tail it carried from the first run
    assert s2["ingested_tokens"] == s2["tokens"] - s["tokens"] and s["pending_tokens"] > 0
    with Store.open(tmp_path / "stores" / "a") as st:
        assert s2["pending_tokens"] == len(stream.pending_tokens(st)) < st.manifest["profile"]["chunk_size"]
    # --raw cannot change the layout of a store in the chat template; the same text again is noted
    r = run("ingest", str(doc), "--append", "--store", "a", "--raw", home=tmp_path)
    assert r.returncode == 2 and "omit --raw" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    with Store.open(tmp_path / "stores" / "a") as st:
        assert st.manifest["stream"]["chat"] and len(st.manifest["documents"]) == 2
    # a regular file is not a store
    r = run("ask", QUESTION, "--store", str(doc), home=tmp_path)
    assert r.returncode == 1 and "is a file, not a store" in r.stderr
    # what the commands do (in this process: each executable run costs ~5 s of imports)
    # ask: without --store the most recent store; streaming text, or one JSON document
    r = run_in_process("ask", QUESTION, "-n", "5", home=tmp_path)
    assert r.returncode == 0 and r.stdout.endswith("\n"), r.stderr  # a random model may answer in blanks
    r = run_in_process("ask", QUESTION, "-n", "5", "--json", "--store", "a", home=tmp_path)
    a = json.loads(r.stdout)
    assert set(a) >= {"store", "question", "answer", "tokens", "seconds_to_first_token", "seconds"} and a["tokens"] <= 5
    # inspect: the list, one store, a query
    r = run_in_process("inspect", "--json", home=tmp_path)
    (row,) = json.loads(r.stdout)["stores"]
    assert row["name"] == "a" and row["tokens"] == s2["tokens"]
    r = run_in_process("inspect", "a", "--json", home=tmp_path)
    summary = json.loads(r.stdout)
    _check(summary, INSPECT_KEYS)
    assert sum(summary["event_sizes"].values()) == summary["events"]
    assert summary["representative"] == "mean" and summary["representative_heads"] == 2  # the tiny model's KV heads
    r = run_in_process("inspect", "a", home=tmp_path)  # the Rich view says how events are found
    assert r.returncode == 0 and "each event found by the mean key of its tokens (2 heads)" in r.stdout, r.stdout
    r = run_in_process("inspect", "a", "--query", QUESTION, "--layer", "1", "--json", home=tmp_path)
    ret = json.loads(r.stdout)["retrieval"]
    _check(ret, RETRIEVAL_KEYS)
    assert len(ret["coverage"]) == 2 and all(len(row) == ret["bins"] for row in ret["coverage"])
    assert all(0 <= x <= 1 for row in ret["coverage"] for x in row) and any(x > 0 for row in ret["coverage"] for x in row)
    assert ret["layer"]["index"] == 1 and ret["layer"]["steps"]
    r = run_in_process("ask", QUESTION, "-n", "2", "--show-retrieval", home=tmp_path)
    assert r.returncode == 0 and "most retrieved events" in r.stderr, r.stderr
    r = run_in_process("inspect", "a", "--query", QUESTION, home=tmp_path)  # the Rich view renders
    assert r.returncode == 0 and "most retrieved events" in r.stdout
    # the same text again: added, with a note naming where the store has it
    r = run_in_process("ingest", str(doc), "--append", "--store", "a", home=tmp_path)
    assert r.returncode == 0 and f"the store held this text already (as {doc})" in r.stderr, r.stderr


def test_a_store_without_events_is_shown_and_inspected_as_such(tiny, tmp_path):
    """A text that never left the window: `show` has no empty table of event sizes, and a query's
    view says that nothing is retrieved instead of drawing an empty heatmap."""
    folder, prof, _, _ = tiny
    ingest_store(tmp_path / "stores" / "short", folder, prof, [("doc", words(3, 5))])
    r = run_in_process("show", "short", home=tmp_path)
    assert r.returncode == 0 and "events     0" in r.stdout and "event sizes" not in r.stdout, r.stdout
    r = run_in_process("inspect", "short", "--query", QUESTION, home=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == (f"retrieval for {QUESTION!r}: "
                                                      "no events yet: every token read is attended at each step, "
                                                      "and nothing is retrieved"), r.stdout
    r = run_in_process("inspect", "short", "--query", QUESTION, "--json", home=tmp_path)  # (JSON: the retrieval as it is)
    assert r.returncode == 0 and json.loads(r.stdout)["retrieval"]["top_events"] == []


def test_trace_is_deterministic(tiny, tmp_path):
    from emllm.app.trace import Trace

    folder, prof, _, _ = tiny
    store = tmp_path / "s"
    ingest_store(store, folder, prof, [("doc", words(9, 400))])
    model, tok = load_tiny(folder)
    runs = []
    for _ in range(2):
        with Store.open(store) as st:
            session = Session(st, model, tok)
            trace = Trace.attach(session.engine)
            session.read_question(QUESTION)
            list(session.engine.generate_iter(3))
            runs.append([(r.step, r.layer, r.ids.tolist(), r.scores.tolist()) for r in trace.records])
            tail = 1 if stream.pending_tokens(st) else 0
            # tail, question chunks (the answer's tokens attend to the question's memory: no retrieval)
            steps = tail + -(-len(session.question_ids(QUESTION)) // 16)
            assert session.engine.profile.answer_retrieval == "question"
    assert runs[0] == runs[1] and len(runs[0]) == 2 * steps  # one record per layer per step
    assert [r[0] for r in runs[0]] == [s for s in range(steps) for _ in range(2)]


def _cmd() -> list[str]:

    return [EMLLM]


def _env(home: Path) -> dict:
    return {**os.environ, **cli_env(home)}


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_stops_cleanly_and_resume_completes(tiny, tmp_path, sig, code, said):
    """Ctrl-C, and SIGTERM (a service stopped), end an ingest with a line saying how to finish it."""
    folder, prof, _, _ = tiny
    doc = tmp_path / "doc.txt"
    doc.write_text(words(10, 8000))  # long enough that the interrupt lands mid-job on a loaded machine (3000 once finished first)
    store = tmp_path / "s"
    p = subprocess.Popen([*_cmd(), "ingest", str(doc), "-m", str(folder), "--profile", str(prof), "--store", str(store),
                          "--commit-every", "1"], env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         # a job started in the background by a shell inherits SIGINT ignored (as CI may be):
                         # the child gets Ctrl-C as from a terminal
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert _wait_for_commit(store, p, 1), "finished before the interrupt"
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == code, err
    assert f"emllm: {said}: the store keeps" in err and "--resume" in err and "Traceback" not in err
    with Store.open(store) as st:
        assert not st.manifest["job"]["complete"]
        done0 = st.manifest["job"]["done"]
    r = subprocess.run([*_cmd(), "ingest", "--resume", "--store", str(store), "--json"], capture_output=True, text=True,
                       env=_env(tmp_path))
    assert r.returncode == 0, r.stderr
    with Store.open(store) as st:
        assert st.manifest["job"]["complete"] and len(stream.pending_tokens(st)) < 16
        done, total = st.manifest["job"]["done"], st.manifest["job"]["tokens"]
    assert json.loads(r.stdout)["ingested_tokens"] == total - done0 > 0
    # Resuming a complete job ingests nothing: its tail short of a chunk stays pending.
    r = subprocess.run([*_cmd(), "ingest", "--resume", "--store", str(store), "--json"], capture_output=True, text=True,
                       env=_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ingested_tokens"] == 0
    with Store.open(store) as st:
        assert st.manifest["job"]["done"] == done


def test_store_scan_equals_the_in_ram_exact_path(tmp_path, monkeypatch):
    """A store scores representative keys from its files (read into RAM block by block):
    the selection and its scores are bit for bit the in-RAM exact path's, for a writer, for a
    reader, and for a reader's own events in RAM, including a block that straddles file and RAM."""
    from emllm.memory import selection as memory
    from emllm.memory.index import EventIndex
    from emllm.store import Geometry, Identity, StoredEvents

    monkeypatch.setattr(memory, "SCORE_BLOCK_BYTES", 64 * 6 * 4)  # 64 events per block: several blocks
    from emllm.store import events as stored_events
    monkeypatch.setattr(stored_events, "RESIDENT_BLOCK", 16)  # resident keys read in over several blocks
    g = Geometry(layers=1, kv_heads=1, q_heads=3, head_dim=2, vocab=10, dtype="float32")
    ident = Identity("m", "c", "w", "t")
    gen = torch.Generator().manual_seed(0)
    batches = [int(n) for n in torch.randint(1, 60, (9,), generator=gen)]
    ref = EventIndex(3, 2, threshold=None)
    all_lengths = [torch.zeros(0, dtype=torch.long)]

    def add(ev: StoredEvents, e: int) -> None:
        lengths = torch.randint(1, 9, (e,), generator=gen)
        reprs = torch.randn(e, 3, 2, generator=gen)
        reprs[: e // 3] = reprs[0]  # ties: broken by event id on every path
        kv = torch.randn(1, int(lengths.sum()), 2, generator=gen)
        ev.append(kv, kv, lengths, reprs)
        if ev.store.writable:  # the engine's sink writes the event table once for all layers
            ev.store.events.append(lengths.to(torch.int32))
        ref.add(reprs)
        all_lengths.append(lengths)

    def check(ev: StoredEvents) -> None:
        lengths = torch.cat(all_lengths)
        assert torch.equal(ev.event_lengths(), lengths)
        for budget in (0, 5, 40, 300, 10_000):
            q = torch.randn(3, 2, generator=gen)
            got, want = ev.select(q, budget), ref.select(q, lengths, budget)
            assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores), budget

    st = Store.create(tmp_path / "s", ident, {"name": "t"}, g)
    ev = StoredEvents(st, 0)
    check(ev)  # empty
    for e in batches[:6]:
        add(ev, e)
        check(ev)
    assert ev.r._map is None  # scanned by pread: the representative keys were never mapped
    st.commit({}, {})
    st.close()
    with Store.open(tmp_path / "s") as rd:
        ev = StoredEvents(rd, 0)
        check(ev)
        for e in batches[6:]:  # a reader's own events stay in RAM; blocks straddle file and RAM
            add(ev, e)
            check(ev)
    assert sum(batches[:6]) % 64 != 0  # the straddling block exists


@pytest.mark.parametrize("centering", [0.0, 1.0])
def test_scratch_stores_equal_the_in_ram_engine_and_leave_nothing(tiny, tmp_path, centering):
    """`passkey --memory-dir`: an engine over a throwaway store computes what the in-RAM engine
    does (same logits, bit for bit, and the same greedy tokens), and its folder is removed."""
    from emllm.evals.passkey import Prompt, run_emllm
    from emllm.evals.scratch import ScratchStores

    folder, prof, _, _ = tiny
    model, tok = load_tiny(folder)
    profile = load_profile_file(prof).replace(query_centering=centering)
    ids = tok(words(3, 400), add_special_tokens=False)["input_ids"]
    ram = Engine(model, profile)
    want = ram.feed(ids)
    with ScratchStores(model, tok, profile, tmp_path / "mem") as make:
        eng = make()
        got = eng.feed(ids)
        assert eng.n_events > 10 and len(list((tmp_path / "mem").iterdir())) == 1
        assert torch.equal(got, want)
        assert eng.generate(6) == ram.generate(6)
        p = Prompt(ids[:300], ids[300:], "12345", 0)
        assert run_emllm(make, tok, p) == run_emllm(lambda: Engine(model, profile), tok, p)
    assert list((tmp_path / "mem").iterdir()) == []


@pytest.mark.slow
def test_trunk_stores_share_the_prefix_and_equal_separate_engines(tiny, tmp_path, monkeypatch):
    """`passkey --memory-dir` reads the filler a grid's haystacks share once: each engine continues
    a copy of the trunk, and its logits and greedy tokens are those of an engine that read the whole
    prompt itself, bit for bit; a prefix that does not continue the trunk starts a new one; without
    the disk for a copy it takes the trunk, as the last engine does, and its store is cut back to
    the trunk afterwards (nothing read twice); without the disk for its document, it refuses;
    nothing is left behind."""
    import shutil as sh

    from emllm.evals.passkey import build_prompt, run_grid
    from emllm.evals.scratch import TrunkStores

    folder, prof, _, _ = tiny
    model, tok = load_tiny(folder)
    profile = load_profile_file(prof)
    prompts = sorted((build_prompt(tok, n, d, random.Random(f"{n}/{d}")) for n in (300, 520) for d in (0.3, 0.7, 1.0)),
                     key=lambda p: p.needle_at)
    other = tok(words(5, 200), add_special_tokens=False)["input_ids"]
    cs = profile.chunk_size
    with TrunkStores(model, tok, profile, tmp_path / "mem") as make:
        for doc, shared, q in [(p.document, p.needle_at, p.question) for p in prompts] + [(other, 100, other[:9])]:
            eng, n = make.engine_for(doc, shared)
            assert n == len(doc) // cs * cs and eng.n_tokens == n
            ram = Engine(model, profile)
            rest = eng.feed(doc[n:]) if n < len(doc) else eng.last_logits
            assert torch.equal(rest, ram.feed(doc))
            assert torch.equal(eng.feed(q), ram.feed(q))
            assert eng.generate(4) == ram.generate(4)
            assert make._trunk_engine.n_tokens == shared // cs * cs  # the trunk read up to here, once
        assert sorted(d.name[:6] for d in next((tmp_path / "mem").iterdir()).iterdir()) == ["branch", "trunk"]
        # Read once: the longest prefix's whole chunks, then the other stream's.
        assert make.shared_tokens == sum(p.needle_at // cs * cs for p in prompts) + 100 // cs * cs
        p = prompts[-1]
        disk = lambda free: monkeypatch.setattr(sh, "disk_usage", lambda _p: sh._ntuple_diskusage(1 << 40, 1 << 40, free))  # noqa: E731
        disk(0)
        with pytest.raises(StoreError, match="not enough free disk"):  # refused before reading anything
            make.engine_for(p.document, p.needle_at)
        assert make._trunk_engine.n_tokens == p.needle_at // cs * cs
        # Room for what the prompt adds but not for a copy too: it takes the trunk, with a mark.
        store_bytes = sum(f.stat().st_size for f in (make._base / "trunk").rglob("*") if f.is_file())
        disk(store_bytes)
        shared = make.shared_tokens
        steps = [0]
        step = Engine.step
        monkeypatch.setattr(Engine, "step", lambda self, *a, **kw: (steps.__setitem__(0, steps[0] + 1), step(self, *a, **kw))[1])
        eng, n = make.engine_for(p.document, p.needle_at)
        assert make._trunk is None and make.shared_tokens == shared + p.needle_at // cs * cs
        assert sorted(d.name[:6] for d in make._base.iterdir()) == ["branch", "trunk-"]
        assert steps[0] == (n - p.needle_at // cs * cs) // cs  # only what follows the trunk
        assert torch.equal(eng.feed(p.document[n:]), Engine(model, profile).feed(p.document))
        eng.generate(4)  # the engine's store grows past the trunk: the cut drops it
        disk(1 << 40)
        steps[0] = 0
        # The store is cut back to the trunk, which the last engine takes: read once, no copy.
        eng, n = make.engine_for(p.document, p.needle_at, last=True)
        assert steps[0] == (n - p.needle_at // cs * cs) // cs
        assert make._trunk is None and make.shared_tokens == shared + 2 * (p.needle_at // cs * cs)
        assert [d.name[:6] for d in make._base.iterdir()] == ["branch"]
        assert not (make._dir / "store" / "branch").exists()  # the mark's own note stays out of the store
        assert torch.equal(eng.feed(p.document[n:]), Engine(model, profile).feed(p.document))
        monkeypatch.undo()
        grid = lambda f: [(r.length, r.depth, r.answer) for r in  # noqa: E731
                          sorted(run_grid(model, tok, f, [300, 520], [0.0, 0.5, 1.0], 1, 0), key=lambda r: (r.length, r.depth))]
        assert grid(make) == grid(lambda: Engine(model, profile))
    assert list((tmp_path / "mem").iterdir()) == []


def test_kept_trunk_stores_resume_where_a_killed_process_stopped(tiny, tmp_path, monkeypatch):
    """A grid at 1M tokens outlasts a session: with keep, the trunk and an engine's store, stopped
    at any step (here by an exception from a step, inside `with`), are carried on by a new
    TrunkStores on the same folder, and the answers are bit for bit those of an engine that read
    the prompt without stopping; a store of another text starts again; close removes them all."""
    from emllm.evals.passkey import build_prompt
    from emllm.evals.scratch import TrunkStores

    folder, prof, _, _ = tiny
    model, tok = load_tiny(folder)
    profile = load_profile_file(prof)
    cs = profile.chunk_size
    p = build_prompt(tok, 700, 0.6, random.Random("resume"))
    ram = Engine(model, profile)
    want = (ram.feed(p.document), ram.feed(p.question), ram.generate(4))
    step = Engine.step

    def stop_after(k):
        calls = [0]

        def stepping(self, *a, **kw):
            calls[0] += 1
            if calls[0] > k:
                raise KeyboardInterrupt
            return step(self, *a, **kw)
        monkeypatch.setattr(Engine, "step", stepping)

    root = tmp_path / "mem"
    (root / "trunk").mkdir(parents=True)  # the user's own, beside ours: never touched
    (root / "branch-1.txt").write_text("mine")
    mine = sorted(root.iterdir())
    k = p.needle_at // cs  # the trunk's chunks
    assert len(p.document) // cs > k + 12

    def stopped(steps: int, doc=p.document) -> dict[str, int]:
        """Run until the step after `steps`; the rows each kept store has committed."""
        stop_after(steps)
        with pytest.raises(KeyboardInterrupt), TrunkStores(model, tok, profile, root, keep=True, commit_every=2) as make:
            make.engine_for(doc, p.needle_at)
        monkeypatch.setattr(Engine, "step", step)
        kept = {d.name[:6]: Store.open(d / "store") for d in (root / TrunkStores.KEPT).iterdir() if d.is_dir()}
        rows = {name: s.tokens.rows for name, s in kept.items()}
        [s.close() for s in kept.values()]
        return rows

    assert stopped(7) == {"trunk": 6 * cs}  # stopped in the trunk: its last commit (every 2 chunks)
    # The trunk carries on from there (k - 6 steps), so the engine's own part gets 11: 10 committed.
    assert stopped(k + 5) == {"trunk": k * cs, "branch": (k + 10) * cs}
    logs: list[str] = []
    with TrunkStores(model, tok, profile, root, keep=True, commit_every=2, log=logs.append) as make:
        with pytest.raises(StoreError, match="another emllm process"):  # one run at a time on a folder
            TrunkStores(model, tok, profile, root, keep=True)
        eng, n = make.engine_for(p.document, p.needle_at)
        assert make.resumed_tokens == (k + 10) * cs and make.shared_tokens == 0 and not logs
        assert torch.equal(eng.feed(p.document[n:]), want[0]) and torch.equal(eng.feed(p.question), want[1])
        assert eng.generate(4) == want[2]
    assert sorted(root.iterdir()) == mine
    # A kept trunk of another model or text is not continued: it starts again.
    assert stopped(3) == {"trunk": 2 * cs}
    with TrunkStores(model, tok, profile, root, name="other", keep=True, log=logs.append) as make:
        make.engine_for(p.document, p.needle_at)
        assert make.resumed_tokens == 0 and len(logs) == 1 and "not what this run needs" in logs.pop()
    other = tok(words(6, 300), add_special_tokens=False)["input_ids"]
    assert stopped(3) == {"trunk": 2 * cs}
    with TrunkStores(model, tok, profile, root, keep=True, log=logs.append) as make:
        eng, n = make.engine_for(other, 200)
        assert make.resumed_tokens == 0 and make.shared_tokens == 200 // cs * cs
        assert len(logs) == 1 and "trunk" in logs[0] and "starting it again" in logs[0]
        assert torch.equal(eng.feed(other[n:]), Engine(model, profile).feed(other))
    assert sorted(root.iterdir()) == mine


def _no_space(*_args, **_kw):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _interrupt(*_args, **_kw):
    raise KeyboardInterrupt


@pytest.mark.slow
def test_a_marked_trunk_is_cut_back_after_a_killed_process(tiny, tmp_path, monkeypatch):
    """At 1M tokens the disk holds no copy of a 768k trunk beside the engine that continues it:
    that engine takes the trunk with a mark. Killed while it reads, it carries on in the next
    process; killed after its answer, the next process cuts its store back to the trunk and the
    next needle continues it; resumed, then done, its own process cuts it back, and a text that
    does not continue the trunk starts a new one: the trunk is read once, and every answer is bit
    for bit that of an engine that read its prompt alone. A mark is refused by another store; a
    full disk during a cut, or a kill before a mark names its branch, throws no trunk away."""
    import shutil as sh

    from emllm.evals.passkey import build_prompt
    from emllm.evals.scratch import TrunkStores, _size
    from emllm.store import cut_back

    folder, prof, _, _ = tiny
    model, tok = load_tiny(folder)
    profile = load_profile_file(prof)
    cs = profile.chunk_size
    a, b = (build_prompt(tok, 700, d, random.Random(f"mark{d}")) for d in (0.3, 0.8))
    assert a.document[: a.needle_at] == b.document[: a.needle_at]
    text = tok(words(7, 400), add_special_tokens=False)["input_ids"]
    c = SimpleNamespace(document=text[:-9], needle_at=200, question=text[-9:], key="c")  # another text
    want = {}
    for p in (a, b, c):
        ram = Engine(model, profile)
        want[p.key] = (ram.feed(p.document), ram.feed(p.question))
    ka, na, nb = a.needle_at // cs, len(a.document) // cs, len(b.document) // cs
    kept = tmp_path / "mem" / TrunkStores.KEPT

    def disk(_path):  # room for what a's prompt adds to the trunk (and a mark), not for a copy of it too
        trunk = kept / "trunk"
        if not trunk.exists():
            return sh._ntuple_diskusage(1 << 40, 1 << 40, 1 << 40)
        spare = 2 * sum(f.stat().st_size for f in trunk.glob("store/*") if f.name.startswith(("state-", "job-")))
        return sh._ntuple_diskusage(1 << 40, 1 << 40, int(_size(trunk) * (na / ka - 0.5)) + spare)
    monkeypatch.setattr(sh, "disk_usage", disk)
    steps, stop_at, step, read, logs = [0], [0], Engine.step, [], []  # read: chunks an engine_for read

    def counting(self, *args, **kw):
        steps[0] += 1
        if steps[0] == stop_at[0]:
            raise KeyboardInterrupt
        return step(self, *args, **kw)
    monkeypatch.setattr(Engine, "step", counting)

    def run(prompts, stop: int = 0, stop_after: bool = False) -> None:
        steps[0], stop_at[0] = 0, stop
        with TrunkStores(model, tok, profile, tmp_path / "mem", keep=True, commit_every=2, log=logs.append) as make:
            for p in prompts:
                before = steps[0]
                eng, n = make.engine_for(p.document, p.needle_at, last=p is b)
                read.append(steps[0] - before)
                assert torch.equal(eng.feed(p.document[n:]) if n < len(p.document) else eng.last_logits, want[p.key][0])
                assert torch.equal(eng.feed(p.question), want[p.key][1])
            if stop_after:
                raise KeyboardInterrupt

    def left() -> list[str]:
        return sorted(d.name if d.name.startswith("trunk") else "branch" for d in kept.iterdir() if d.is_dir())

    with pytest.raises(KeyboardInterrupt):  # killed in a's own part, past the trunk
        run([a], stop=ka + 5)
    assert left() == ["branch", "trunk-mark"]  # a took the trunk
    with pytest.raises(KeyboardInterrupt):  # a carries on and answers; killed before b
        run([a], stop_after=True)
    assert left() == ["branch", "trunk-mark"]
    other = tmp_path / "other"
    ingest_store(other, folder, prof, [("x", words(1, 100))])
    with pytest.raises(StoreError, match="was not saved from"):
        cut_back(other, kept / "trunk-mark")
    for fail in ("os.link", "emllm.store.marks.write_atomic"):  # the disk fills while the state, then the manifest, is put back
        with monkeypatch.context() as m:
            m.setattr(fail, _no_space)
            with pytest.raises(StoreError, match="cannot cut .*No space left"):
                run([b])
        assert left() == ["branch", "trunk-mark"]  # nothing thrown away: the next run finishes the cut
    run([b])
    assert read[-1] == nb - ka  # a's store was cut back to the trunk: not read again
    assert not kept.exists()
    with pytest.raises(KeyboardInterrupt):
        run([a], stop=ka + 5)
    with monkeypatch.context() as m:  # the same, in the process that answered a
        m.setattr("os.link", _no_space)
        with pytest.raises(StoreError, match="cannot cut .*No space left"):
            run([a, b])
    assert left() == ["branch", "trunk-mark"]
    read.clear()
    run([a, b])  # resumes a, cuts it back in this process, continues the trunk for b
    assert read[-1] == nb - ka
    with pytest.raises(KeyboardInterrupt):
        run([a], stop=ka + 5)
    read.clear()
    run([a, c])  # c does not continue the trunk: a new one (wrong logits if it continued a's)
    assert read[-1] == len(c.document) // cs
    assert not kept.exists()
    with pytest.raises(KeyboardInterrupt):
        run([a], stop=ka + 5)
    next((kept / "trunk-mark").glob("state-*")).unlink()  # a damaged mark: the trunk is read again
    logs.clear()
    run([b])
    assert read[-1] == nb and len(logs) == 1 and "incomplete or damaged" in logs[0]
    assert not kept.exists()
    with monkeypatch.context() as m:  # killed between the mark and the note naming its branch
        m.setattr("emllm.evals.scratch.write_atomic", _interrupt)
        with pytest.raises(KeyboardInterrupt):
            run([a])
    assert left() == ["trunk", "trunk-mark"]
    read.clear()
    run([a, b])  # the half mark is dropped, the trunk kept: nothing read twice
    assert read == [na - ka, nb - ka]
    assert not kept.exists()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rowfile_take_reads_any_rows_in_any_order(tmp_path, dtype):
    from emllm.store.files import Folder
    from emllm.store import RowFile

    x = torch.randn(5000, 3, 8).to(dtype)
    w = RowFile(Folder(tmp_path), "x", (3, 8), dtype, 0, writable=True)
    w.append(x)
    w.sync()
    r = RowFile(Folder(tmp_path), "x", (3, 8), dtype, 5000, writable=False)
    g = torch.Generator().manual_seed(0)
    cases = [torch.arange(5000), torch.tensor([4999]), torch.tensor([7, 7, 3, 4999, 0, 3]),
             torch.arange(0, 5000, 97), torch.arange(0, 5000, 2), torch.randint(0, 5000, (800,), generator=g),
             torch.randperm(5000, generator=g)[:1500].sort().values]  # gaps below, at and above READ_GAP
    for idx in cases:
        assert torch.equal(r.take(idx), x[idx])
        assert torch.equal(r.rows_at(idx), x[idx])  # a reader's gather through the map: the same rows
    r.close()
    w.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_rowfile_rows_at_asks_for_a_chunks_pages_first(tmp_path, monkeypatch):
    """A chunk's gather through the map (prefetch) tells the kernel of its runs first, so a cold
    store reads them together, not one fault at a time; a generated token's (no prefetch) makes
    no calls."""
    from emllm.store import rows as rows_mod
    from emllm.store.files import Folder

    x = torch.randn(5000, 3, 8)
    w = rows_mod.RowFile(Folder(tmp_path), "x", (3, 8), torch.float32, 0, writable=True)
    w.append(x)
    w.sync()
    r = rows_mod.RowFile(Folder(tmp_path), "x", (3, 8), torch.float32, 5000, writable=False)
    hints: list[tuple[int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, adv: (hints.append((off, n)), real(fd, off, n, adv))[1])
    rb = 3 * 8 * 4
    # two runs of events, out of order and repeated, far more than READ_GAP apart
    big = torch.cat((torch.arange(3000, 3200), torch.arange(100, 300), torch.arange(150, 160)))
    assert torch.equal(r.rows_at(big), x[big]) and hints == []
    assert torch.equal(r.rows_at(big, prefetch=True), x[big])
    assert sorted(hints) == [(100 * rb, 200 * rb), (3000 * rb, 200 * rb)]
    r.close()
    w.close()


def test_packed_parts_view_back_as_their_dtypes_in_place():
    """store.packed, how a device step's deferred rows come back in one read: parts of mixed
    dtypes and odd sizes concatenated as bytes, each at a multiple of 16 bytes, view back from the
    one buffer as themselves, bit for bit, without a copy."""
    from emllm.store.store import packed

    rng = torch.Generator().manual_seed(0)
    parts = [torch.randn(7, generator=rng).to(torch.bfloat16), torch.randint(0, 255, (13,), dtype=torch.uint8),
             torch.randn(5, generator=rng), torch.randint(-9, 9, (3,)), torch.zeros(0, dtype=torch.float16),
             torch.randn(9, generator=rng).to(torch.float16)]
    pieces, offsets = packed(parts)
    back = torch.cat(pieces)
    assert all(o % 16 == 0 for o in offsets) and back.numel() == offsets[-1] + parts[-1].nbytes
    for p, o in zip(parts, offsets):
        view = back[o : o + p.nbytes].view(p.dtype)
        assert view.dtype == p.dtype and torch.equal(view.view(torch.uint8), p.view(torch.uint8))
        assert view.data_ptr() == back.data_ptr() + o or not p.numel()  # (a view of the buffer: no copy)
