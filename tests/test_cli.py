"""The `emllm` executable: exit codes, one-line errors, JSON output (each through a subprocess)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EMLLM = shutil.which("emllm", path=str(Path(sys.executable).parent)) or "emllm"


def run(*args: str, home: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    from core.home import models_dir

    env = {**os.environ, "EMLLM_HOME": str(home), "EMLLM_MODELS": str(models_dir()), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([EMLLM, *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("args, code, needle", [
    (["passkey", "--lengths", "foo"], 2, "not a length"),
    (["passkey", "--depths", "2"], 2, "depths must lie in [0, 1]"),
    (["passkey", "-m", "nope"], 1, "unknown model 'nope'"),
    (["passkey", "-m", "llama3.1"], 1, "never downloads"),
    (["passkey", "--profile", "nope"], 1, "unknown profile 'nope'"),
])
def test_bad_input(tmp_path, args, code, needle):
    r = run(*args, home=tmp_path)
    assert r.returncode == code
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    if code == 1:
        assert len(r.stderr.strip().splitlines()) == 1


def test_version_and_help(tmp_path):
    r = run("--version", home=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("emllm ")
    r = run("passkey", "--help", home=tmp_path)
    assert r.returncode == 0 and "--baseline" in r.stdout and "Examples" in r.stdout


def test_passkey_json(tmp_path, smollm2):  # smollm2: the converted model exists before the subprocess
    r = run("passkey", "-l", "1k", "-d", "0,1", "-t", "1", "--baseline", "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["lengths"] == [1024] and doc["depths"] == [0.0, 1.0]
    assert len(doc["results"]) == 4
    assert {x["method"] for x in doc["results"]} == {"emllm", "baseline"}
    for x in doc["results"]:
        assert set(x) >= {"length", "depth", "trial", "key", "answer", "correct", "method", "seconds", "tokens"}
        assert len(x["key"]) == 5 and abs(x["tokens"] - 1024) <= 8
    # 1k fits the window: emllm is the plain model here, so both must agree.
    by = {(x["depth"], x["method"]): x["answer"] for x in doc["results"]}
    assert by[(0.0, "emllm")] == by[(0.0, "baseline")]
