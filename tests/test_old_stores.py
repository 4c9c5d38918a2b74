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
        assert list(Session(st, model, tok).answer(QUESTION, 8)) == old_answer
    # and today's writer continues it: the same as today's code writing the whole stream
    more = words(22, 120)
    with Store.open(store, writable=True) as st:
        eng = stream.open_engine(st, model)
        add_documents(st, tok, [("more", more)])
        run_job(st, eng, 2)
    ingest_store(tmp_path / "new", folder, prof, [("doc", text), ("more", more)])
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
