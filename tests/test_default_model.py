"""The default model answers the README's own question, as a fresh clone's quick start asks it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from emllm.models import DEFAULT_MODEL, resolve
from tests.helpers import run

REPO = Path(__file__).resolve().parent.parent


def quick_start() -> tuple[str, str]:
    """The README's first command: the document it ingests and the question it asks."""
    first = next(ln for ln in (REPO / "README.md").read_text().splitlines() if ln.startswith("bash scripts/install.sh"))
    doc = re.search(r"emllm ingest (\S+)", first).group(1)
    question = re.search(r'emllm ask "([^"]+)"', first).group(1)
    return doc, question


@pytest.mark.slow
def test_the_readme_quick_start_answers_its_question_with_the_default_model(tmp_path):
    resolve(DEFAULT_MODEL)  # converted here once, before the subprocesses (they share the models folder)
    doc, question = quick_start()
    env = {"EMLLM_MODEL": ""}  # the default itself, not the fast tests' model
    r = run("ingest", str(REPO / doc), "--store", "format", home=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    r = run("show", "format", "--json", home=tmp_path, env=env)
    assert DEFAULT_MODEL in r.stdout, r.stdout
    for way in ("--reread", "--no-reread"):
        r = run("ask", question, "--store", "format", "-n", "60", way, home=tmp_path, env=env)
        assert r.returncode == 0, r.stderr
        # docs/store-format.md: "A crash at any moment ... leaves the last commit readable"
        assert "last commit" in r.stdout.lower(), (way, r.stdout)
