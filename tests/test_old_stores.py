"""Stores written by earlier emllm still open and answer the same: the code of an earlier commit
(from this repository's history) writes a store and answers; today's code opens that store and
must give the same answer, token for token, and the same arrays when it appends."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

from emllm.app import stream
from emllm.app.ask import Session
from emllm.app.ingest import add_documents, run_job
from emllm.store import Store
from emllm.store.manifest import FORMAT_VERSION

from .helpers import QUESTION, ingest_store, load_tiny, store_arrays, words

REPO = Path(__file__).resolve().parent.parent
# the last commit before the package became `emllm` (store format 4, named files, no job.documents)
OLD = "901865e"

WRITE = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
from core import ingest as ing
from core.ask import Session
from core.config import load_profile_file
from core.store import Store
folder, prof, path, text = sys.argv[1:5]
model, tok = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
with ing.create_store(path, folder, model, tok, load_profile_file(prof)) as st:
    eng = ing.open_engine(st, model)
    ing.add_documents(st, tok, [("doc", text)])
    ing.run_job(st, eng, 2)
with Store.open(path) as st:
    print(json.dumps(list(Session(st, model, tok).answer(sys.argv[5], 8))))
"""


@pytest.fixture(scope="module")
def old_code(tmp_path_factory) -> Path:
    r = subprocess.run(["git", "-C", str(REPO), "archive", OLD, "core", "profiles"], capture_output=True)
    if r.returncode:
        pytest.skip(f"commit {OLD} is not in this clone's history (a shallow clone?)")
    out = tmp_path_factory.mktemp("old")
    with tarfile.open(fileobj=BytesIO(r.stdout)) as tar:
        tar.extractall(out, filter="data")
    return out


@pytest.mark.slow
def test_a_store_written_by_the_old_layout_opens_and_answers_the_same(tiny, old_code, tmp_path):
    folder, prof, _, _ = tiny
    text = words(21, 400)
    store = tmp_path / "old-store"
    r = subprocess.run([sys.executable, "-c", WRITE, str(folder), str(prof), str(store), text, QUESTION],
                       capture_output=True, text=True, cwd=old_code, env={"PYTHONPATH": str(old_code), "PATH": "/usr/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    old_answer = json.loads(r.stdout.strip().splitlines()[-1])
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["version"] == 4 and "documents" not in manifest["job"]  # really the old writer's
    model, tok = load_tiny(folder)
    with Store.open(store) as st:
        # (read with the scoring it was made with: the question's mean query, not centred)
        prof_then = stream.store_profile(st)
        assert prof_then.question_scoring == "mean" and prof_then.question_centering == 0.0
        assert list(Session(st, model, tok).answer(QUESTION, 8)) == old_answer
    # and today's writer continues it: the same as today's code writing the whole stream
    more = words(22, 120)
    with Store.open(store, writable=True) as st:
        eng = stream.open_engine(st, model)
        add_documents(st, tok, [("more", more)])
        run_job(st, eng, 2)
    # (the old store goes on with the representatives it was made with: the paper's, not scaled
    # to unit length, today's default being the mean key of unit length; the whole stream is
    # written with them too)
    paper = tmp_path / "paper.yaml"
    paper.write_text(Path(prof).read_text() + "\nrepresentative: attention\nrepr_normalise: false\n")
    ingest_store(tmp_path / "new", folder, paper, [("doc", text), ("more", more)])
    old, new = store_arrays(store), store_arrays(tmp_path / "new")
    assert old.keys() == new.keys()
    assert {k: v for k, v in old.items() if k[-2:] not in (".k", ".v")} == {k: v for k, v in new.items() if k[-2:] not in (".k", ".v")}
    # the old layout goes on: its layer files hold the events' tokens; a new store's hold every
    # token from the first (version 5), the events' from the initial tokens' end
    m_old, m_new = (json.loads((p / "manifest.json").read_text()) for p in (store, tmp_path / "new"))
    assert "kv_tokens" not in m_old["rows"] and m_new["rows"]["kv_tokens"] == m_new["rows"]["tokens"]
    row = len(old["layers/00.k"]) // m_old["rows"]["event_tokens"]
    n_init = m_new["profile"]["n_init"]
    for k in (k for k in old if k[-2:] in (".k", ".v")):
        assert old[k] == new[k][n_init * row : (n_init + m_old["rows"]["event_tokens"]) * row], k


# the last commit whose integer stores quantise keys per token alone (store format 5, no key equaliser)
OLD_INT = "787438b"

WRITE_INT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from emllm.app import ingest as ing, stream
from emllm.app.ask import Session
from emllm.config import load_profile_file
from emllm.store import Store
folder, prof, path, text, question, more = sys.argv[1:7]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(folder)
def write(p, docs):
    with stream.create_store(p, folder, model, tok, load_profile_file(prof), kv_format="int4") as st:
        eng = stream.open_engine(st, model)
        ing.add_documents(st, tok, docs)
        ing.run_job(st, eng, 2)
write(path, [("doc", text)])
write(path + "-whole", [("doc", text), ("more", more)])
with Store.open(path) as st:
    print(json.dumps(list(Session(st, model, tok).answer(question, 8))))
"""


def _old_package(tmp_path_factory, commit: str, name: str, profiles: bool = False) -> Path:
    """The package `emllm` as `commit` installed it (core/ named emllm, its profiles inside)."""
    r = subprocess.run(["git", "-C", str(REPO), "archive", commit, "core", *(["profiles"] if profiles else [])],
                       capture_output=True)
    if r.returncode:
        pytest.skip(f"commit {commit} is not in this clone's history (a shallow clone?)")
    out = tmp_path_factory.mktemp(name)
    with tarfile.open(fileobj=BytesIO(r.stdout)) as tar:
        tar.extractall(out, filter="data")
    (out / "core").rename(out / "emllm")
    if profiles:
        (out / "profiles").rename(out / "emllm" / "profiles")
    return out


def _write_with(code: Path, script: str, folder, prof, store: Path, text: str, more: str) -> list:
    """Run `script` (WRITE_INT's form) with the old package at `code`: its answer's tokens."""
    r = subprocess.run([sys.executable, "-c", script, str(folder), str(prof), str(store), text, QUESTION, more],
                       capture_output=True, text=True, cwd=code, env={"PYTHONPATH": str(code), "PATH": "/usr/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def old_int_code(tmp_path_factory) -> Path:
    return _old_package(tmp_path_factory, OLD_INT, "old-int")


@pytest.mark.slow
def test_an_int4_store_of_version_5_opens_answers_and_goes_on_without_an_equaliser(tiny, old_int_code, tmp_path):
    """An int4 store written before key equalisers (per token alone) decodes as it was written: the
    same answer; today's writer continues it in its own way, byte for byte what the old code
    writes for the whole stream; a new int4 store equalises its keys (version 6)."""
    folder, prof, _, _ = tiny
    text, more = words(23, 400), words(24, 120)
    store = tmp_path / "old-int4"
    old_answer = _write_with(old_int_code, WRITE_INT, folder, prof, store, text, more)
    m = json.loads((store / "manifest.json").read_text())
    assert m["version"] == 5 and m["kv_format"] == "int4" and "key_equaliser" not in m
    model, tok = load_tiny(folder)
    with Store.open(store) as st:
        assert not st.key_equalised
        old_prof = stream.store_profile(st)  # written before the keys: the paper's scoring, as written
        assert old_prof.question_centering == 0.0 and old_prof.question_centering_answer is True
        assert old_prof.representative == "attention"
        assert list(Session(st, model, tok).answer(QUESTION, 8)) == old_answer
    with Store.open(store, writable=True) as st:
        eng = stream.open_engine(st, model)
        add_documents(st, tok, [("more", more)])
        run_job(st, eng, 2)
    assert store_arrays(store) == store_arrays(tmp_path / "old-int4-whole")
    assert not list((store / "layers").glob("*.e"))
    new = tmp_path / "new-int4"
    ingest_store(new, folder, prof, [("doc", text)], kv_format="int4")
    m = json.loads((new / "manifest.json").read_text())
    assert m["version"] == FORMAT_VERSION and m["key_equaliser"] is True and (new / "layers/00.e").stat().st_size > 0
    assert m["repr_heads"] == m["geometry"]["kv_heads"] < m["geometry"]["q_heads"]  # mean keys per KV head
    assert m["profile"]["question_centering"] == 1.0 and m["profile"]["question_centering_answer"] is False
    assert m["profile"]["representative"] == "mean"
    assert store_arrays(new)["layers/00.k"] != store_arrays(tmp_path / "old-int4")["layers/00.k"][: (new / "layers/00.k").stat().st_size]


# the last commit whose mean representative keys are kept per query head (store format 5: each KV
# head's mean repeated for its group)
OLD_MEAN = "a7a2306"

WRITE_MEAN = WRITE_INT.replace(', kv_format="int4"', "")


@pytest.fixture(scope="module")
def old_mean_code(tmp_path_factory) -> Path:
    return _old_package(tmp_path_factory, OLD_MEAN, "old-mean", profiles=True)


@pytest.mark.slow
def test_a_mean_store_with_a_key_per_query_head_opens_answers_and_goes_on_alike(tiny, old_mean_code, tmp_path):
    """A store of mean keys kept per query head (before version 7) is scored as it was written: the
    same answer, and today's writer continues it byte for byte as the old code writes the whole
    stream (its keys still repeated per query head); a new store keeps one per KV head."""
    folder, prof, _, _ = tiny
    text, more = words(25, 400), words(26, 120)
    store = tmp_path / "old-mean"
    old_answer = _write_with(old_mean_code, WRITE_MEAN, folder, prof, store, text, more)
    m = json.loads((store / "manifest.json").read_text())
    assert m["version"] == 5 and "repr_heads" not in m and m["profile"]["representative"] == "mean"
    model, tok = load_tiny(folder)
    with Store.open(store) as st:
        assert st.repr_heads == st.geometry.q_heads > st.geometry.kv_heads
        assert list(Session(st, model, tok).answer(QUESTION, 8)) == old_answer
    with Store.open(store, writable=True) as st:
        eng = stream.open_engine(st, model)
        add_documents(st, tok, [("more", more)])
        run_job(st, eng, 2)
    assert store_arrays(store) == store_arrays(tmp_path / "old-mean-whole")
    new = tmp_path / "new"
    ingest_store(new, folder, prof, [("doc", text)])
    m_new = json.loads((new / "manifest.json").read_text())
    assert m_new["version"] == FORMAT_VERSION and m_new["repr_heads"] == m_new["geometry"]["kv_heads"]
    g = m_new["geometry"]["q_heads"] // m_new["geometry"]["kv_heads"]
    whole = tmp_path / "old-mean-whole"
    old_row = (whole / "layers/00.r").stat().st_size // json.loads((whole / "manifest.json").read_text())["rows"]["events"]
    assert (new / "layers/00.r").stat().st_size == m_new["rows"]["events"] * old_row // g  # a row a group's size
    with Store.open(new) as st:
        assert list(Session(st, model, tok).answer(QUESTION, 8)) == old_answer  # the same selections here
