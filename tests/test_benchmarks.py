"""The benchmarks still run as the docs say: docs/benchmarks.md's figures come from their
commands, and a script whose arguments or library calls moved would be found broken only at the
next measurement (it happened: a report type, a helper deleted with its neighbour, a server
started with the default model)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks

from .helpers import cli_env, run

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "reference.md"]
MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__))
_COMMAND = re.compile(r"python3? (?:-m benchmarks\.(\w+)|benchmarks/(\w+)\.py)([^`|\n]*)")


def documented() -> list[tuple[str, list[str]]]:
    """(benchmark, its arguments) of every benchmark command the docs give, optional parts in
    [brackets] and "..." left out."""
    found = set()
    for doc in DOCS:
        text = doc.read_text().replace("\\\n", " ")
        for m in _COMMAND.finditer(text):
            args = re.sub(r"\[[^\]]*\]", "", m.group(3)).replace("...", "")
            found.add((m.group(1) or m.group(2), tuple(shlex.split(args))))
    return sorted((name, list(args)) for name, args in found)


class _Parsed(Exception):
    pass


def test_the_docs_name_benchmarks_that_exist():
    commands = documented()
    assert len(commands) > 20  # (the pattern still finds them)
    assert {name for name, _ in commands} <= set(MODULES)


@pytest.mark.parametrize("name,args", documented(), ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_a_documented_command_parses(name, args, monkeypatch):
    """Each command the docs give is accepted by its script's parser as written (nothing run)."""
    parse = argparse.ArgumentParser.parse_args

    def parsed(self, a=None, namespace=None):
        parse(self, a, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed)
    monkeypatch.setattr(sys, "argv", [name, *args])
    with pytest.raises(_Parsed):
        importlib.import_module(f"benchmarks.{name}").main()


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_has_help(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"benchmarks.{name}").main()
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def _run(tmp_path: Path, *args: str, timeout: int = 600) -> str:
    env = {**os.environ, **cli_env(tmp_path / "home"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _json_lines(out: str) -> list[dict]:
    """The one-line JSON objects a benchmark printed (a summary printed over several lines is not one)."""
    return [json.loads(line) for line in out.splitlines() if line.startswith("{") and line.endswith("}")]


@pytest.mark.slow
def test_speed_grid_runs(tmp_path):
    rows = _json_lines(_run(tmp_path, "-m", "benchmarks.speed_grid", "-m", "smollm2", "--lengths", "2k",
                            "--chunks", "1", "--decode", "1", "--out", str(tmp_path / "grid.jsonl")))
    assert [r["length"] for r in rows] == [2048]
    assert all(rows[0][k] > 0 for k in ("emllm_chunk_s", "window_chunk_s", "full_chunk_s", "emllm_answer_token_s"))
    run = json.loads((tmp_path / "grid.jsonl").read_text().splitlines()[0])["run"]
    assert run["model"] == "smollm2" and "threads" in run["machine"]


@pytest.mark.slow
def test_default_model_runs(tmp_path):
    out = tmp_path / "models.jsonl"
    _run(tmp_path, "-m", "benchmarks.default_model", "--models", "smollm2", "-n", "2", "--out", str(out))
    (r,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert r["model"] == "smollm2" and r["readme_tokens"] > 4000 and r["licence_ingest_tok_s"] > 0
    assert len(r["licence_own"]) == len(r["licence_reread"]) == 6


@pytest.mark.slow
def test_answer_retrieval_runs(tmp_path):
    (row,) = _json_lines(_run(tmp_path, "-m", "benchmarks.answer_retrieval", "-m", "smollm2", "passkey:4k:0.5"))
    assert row["item"] == "passkey:4k:0.5" and set(row["score"]) == set(row["answer"]) == {"question", "token"}


@pytest.mark.slow
def test_first_token_and_server_latency_run_on_a_store(tmp_path):
    """first_token alternating two frozen copies of the code; server_latency serving the store's
    own model (not the default)."""
    home = tmp_path / "home"
    r = run("ingest", str(ROOT / "docs" / "store-format.md"), "-m", "smollm2", "--store", "format", home=home)
    assert r.returncode == 0, r.stderr
    store = home / "stores" / "format"
    out = _run(tmp_path, "-m", "benchmarks.first_token", "--stores", str(store), "--runs", "1", "--revs", ".,HEAD")
    runs = [r for r in _json_lines(out) if "rev" in r]
    assert sorted(r["rev"] for r in runs) == [".", "HEAD"] and all(r["first_token_s"] > 0 for r in runs)
    out = _run(tmp_path, "-m", "benchmarks.server_latency", "--store", "format", "--runs", "1", "--clients", "1",
               "--tokens", "2")
    assert "0 errors" in out and "store unchanged byte for byte: True" in out, out
    out = _run(tmp_path, "-m", "benchmarks.server_latency", "--store", "format", "--stores", "6")
    assert "6 stores, each asked twice in turn, at a limit of 1024 open files: 12 answered, 0 errors" in out, out


@pytest.mark.slow
def test_code_base_runs_on_a_folders_store(tiny, tmp_path):
    """An answer a question each way (by default today's re-read, its words unstemmed, own reading;
    `--ways` names others), each scored; the summary counts them; an unknown way is refused."""
    from benchmarks.code_base import DEFAULT_WAYS
    folder, prof, _, _ = tiny
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "a.py").write_text("PASSAGE = 128\n" * 40)
    (proj / "b.py").write_text("def f():\n    return 1\n" * 40)
    r = run("ingest", str(proj), "-m", str(folder), "--profile", str(prof), home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    qs = tmp_path / "qs.tsv"
    qs.write_text("Which file defines f?\tb.py\nWhat is PASSAGE?\t128\n")
    rows = _json_lines(_run(tmp_path, "-m", "benchmarks.code_base", "--store", "proj", "--questions", str(qs), "-n", "3"))
    assert [r["question"] for r in rows[:2]] == ["Which file defines f?", "What is PASSAGE?"]
    ways = DEFAULT_WAYS.split(",")
    assert ways == ["reread", "reread_unstemmed", "own"]
    assert all(isinstance(r[w]["right"], bool) and isinstance(r[w]["answer"], str) for r in rows[:2] for w in ways)
    summary = rows[2]
    assert summary["questions"] == 2 and summary["documents"] == 2 and summary["tokens"] > 400
    assert summary["right"] == {w: sum(r[w]["right"] for r in rows[:2]) for w in ways}
    rows = _json_lines(_run(tmp_path, "-m", "benchmarks.code_base", "--store", "proj", "--questions", str(qs), "-n", "3",
                            "--ways", "reread_tokens,reread_ids,reread_unnamed"))
    assert list(rows[2]["right"]) == ["reread_tokens", "reread_ids", "reread_unnamed"]
    from benchmarks.code_base import parse_ways
    with pytest.raises(SystemExit, match="unknown way 'nope'"):
        parse_ways("reread,nope")


def test_words_rank_ranks_each_target_each_way(tiny):
    """benchmarks.words_rank: a target's best passage rank by the question's token ids alone, with
    their pairs, and by words and their pairs, on a stream where only the pairs tell a passage from
    a look-alike's, and only the words find another."""
    import torch
    from transformers import AutoTokenizer

    from benchmarks.words_rank import ranks, summary
    tok = AutoTokenizer.from_pretrained(tiny[0])
    (cls, apple), (Cls, Apple) = tok.encode(" class apple"), tok.encode("Class Apple")  # one word each, two ids
    assert len({cls, apple, Cls, Apple}) == 4
    filler = tok.encode(" the")[0]
    stream = torch.tensor([cls, filler, filler, apple, filler, filler] + [filler, filler, cls, apple, filler, filler]
                          + [filler] * 6 + [filler, Cls, Apple, filler, filler, filler])  # apart, in a row, neither, other ids
    spans = [(0, 6), (6, 12), (12, 18), (18, 24)]
    got = ranks(tok, stream, spans, [cls, apple], [[1], [0], [], [3]])
    # (ties: the stable sort keeps stream order)
    assert got == {"ids": [1, 0, None, 3], "ids_and_pairs": [0, 1, None, 3], "words_and_pairs": [0, 2, None, 1],
                   "stems_and_pairs": [0, 2, None, 1]}  # (no word here has another form)
    assert summary(got) == {"ids": {"top4": 3, "first": 1, "mean_rank": 1.3, "of": 3},
                            "ids_and_pairs": {"top4": 3, "first": 1, "mean_rank": 1.3, "of": 3},
                            "words_and_pairs": {"top4": 3, "first": 1, "mean_rank": 1.0, "of": 3},
                            "stems_and_pairs": {"top4": 3, "first": 1, "mean_rank": 1.0, "of": 3}, "in_initial_tokens": 1}


@pytest.mark.slow
def test_words_rank_runs(tmp_path):
    """One short prompt of each task and a folder's question: JSON lines with both ways counted
    over every target (each task's prompt has 1, 1, 4 and 5 of them, some perhaps in the initial
    tokens; the folder's question 1)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "a.py").write_text("x = Foo()\n" * 300)  # (past the initial tokens: b.py's lines are in passages)
    (proj / "b.py").write_text("class Foo:\n    pass\n")
    qs = tmp_path / "qs.tsv"
    qs.write_text("Which file defines the class Foo?\tb.py\nWhat is X?\t1\n")
    rows = _json_lines(_run(tmp_path, "-m", "benchmarks.words_rank", "--lengths", "4k", "--haystacks", "essay",
                            "--samples", "1", "--folder", str(proj), "--questions", str(qs)))
    assert [r.get("haystack", r.get("folder")) for r in rows] == ["essay", str(proj)]
    for r, targets in zip(rows, (11, 1)):
        for way in ("ids", "ids_and_pairs", "words_and_pairs", "stems_and_pairs"):
            assert r[way]["of"] + r["in_initial_tokens"] == targets and 0 <= r[way]["first"] <= r[way]["top4"] <= targets
    assert rows[1]["words_and_pairs"]["first"] == 1  # (b.py's one passage holds "class Foo")


def test_code_base_scores_a_file_by_path_or_module_whole_parts_only():
    from benchmarks.code_base import right

    assert right("It is in `core/math/rope.py`.", "rope.py") and right("the emllm.memory.buffers module", "buffers.py")
    assert right("emllm/engine/stream.py", "engine/stream.py") and not right("emllm.app.stream", "engine/stream.py")
    assert not right("`rotated_window.py`", "rotated.py") and not right("core/app/api.py", "serve/api.py")
    assert not right("The file `manifest.json` defines it.", "manifest.py") and right("in manifest.py.", "manifest.py")
    assert right("The value is 128.", "128") and not right("1024", "128") and not right("it is 128", "8")


@pytest.mark.slow
def test_perplexity_runs_and_emllm_reads_the_first_window_as_the_engine_without_memory(tmp_path):
    """Within the first window nothing is retrieved: emllm and no memory give the same tokens the
    same log-likelihoods there, and the plain model's too (all within SmolLM2's context)."""
    out = tmp_path / "ppl.jsonl"
    _run(tmp_path, "-m", "benchmarks.perplexity", "-m", "smollm2", "--tokens", "1k", "--texts", "code", "--dtype", "float32",
         "--out", str(out), "--variant", "n_mem=1,query_centering=0")
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["tokens"] == 1024 and row["warm"] > 1024 and row["emllm_past_warm"] is None
    assert row["emllm"] == row["no_memory"] == pytest.approx(row["full"], rel=1e-3)
    assert row["emllm n_mem=1,query_centering=0"] == row["no_memory"]  # (a variant: the profile so changed)
