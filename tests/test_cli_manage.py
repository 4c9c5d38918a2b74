"""Store management (list, show, rm, mv) and the rough edges a new user hits, through the executable."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from emllm.store.manifest import checksum

from .helpers import EMLLM, QUESTION, cli_env, ingest_store, run, run_in_process, words


def _store(tiny, home, name="s"):
    folder, prof, _, _ = tiny
    ingest_store(home / "stores" / name, folder, prof, [("doc", words(3, 300))])
    return home / "stores" / name


def _light(argv: list[str], env: dict | None = None) -> list[str]:
    """Run the CLI in a fresh interpreter with argv; the heavy modules it imported."""
    code = ("import sys\nfrom emllm_cli.main import cli\nsys.argv = " + repr(argv) + "\ntry:\n    cli()\n"
            "except SystemExit:\n    pass\nprint([m for m in ('torch', 'transformers', 'numpy') if m in sys.modules], file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **(env or {})})
    return r.stderr.strip().splitlines()[-1]


def test_help_and_completion_import_no_torch(tiny, tmp_path):
    for argv in (["emllm", "--help"], ["emllm", "ingest", "--help"], ["emllm", "ask", "--help"], ["emllm", "list", "--help"]):
        assert _light(argv) == "[]", argv
    _store(tiny, tmp_path)
    env = {"_EMLLM_COMPLETE": "complete_bash", "COMP_WORDS": "emllm ask q --store ", "COMP_CWORD": "4",
           "EMLLM_HOME": str(tmp_path)}
    assert _light(["emllm"], env) == "[]"
    r = subprocess.run([EMLLM], capture_output=True, text=True, env={**os.environ, **env})
    assert r.stdout.split() == ["s"]  # store names complete
    env = {**env, "COMP_WORDS": "emllm segment x --method S", "COMP_CWORD": "4"}
    r = subprocess.run([EMLLM], capture_output=True, text=True, env={**os.environ, **env})
    assert r.stdout.split() == ["S", "SM", "SC"]


def test_completion_methods_are_the_library_s():
    from emllm.app.document import METHODS
    from emllm_cli.segment import METHOD_NAMES

    assert METHOD_NAMES == (*METHODS, "all")


def test_list_show_mv_rm(tiny, tmp_path):
    # the entry point in this process: 14 commands, ~3 s of start-up each saved (flock conflicts
    # between two descriptors of one process as between two processes)
    s = _store(tiny, tmp_path)
    inc = _store(tiny, tmp_path, "partial")
    m = json.loads((inc / "manifest.json").read_text())
    m["job"]["complete"] = False
    m["checksum"] = checksum(m)
    (inc / "manifest.json").write_text(json.dumps(m))
    r = run_in_process("list", "--json", home=tmp_path)
    rows = {x["name"]: x for x in json.loads(r.stdout)["stores"]}
    assert rows["s"]["status"] == "complete" and rows["partial"]["status"] == "incomplete"
    assert rows["s"]["format"] == "float32" and rows["s"]["model"] == str(tiny[0]) and rows["s"]["bytes"] > 0
    assert run_in_process("ls", home=tmp_path).stdout.count("incomplete") == 1
    # an ingest under way (its writer's lock held) is told from one that stopped; seeing it never
    # refuses a writer that starts meanwhile
    fd = os.open(inc / "lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        rows = {x["name"]: x for x in json.loads(run_in_process("list", "--json", home=tmp_path).stdout)["stores"]}
        assert rows["partial"]["status"] == "writing" and rows["s"]["status"] == "complete"
        assert "an ingest is writing it now" in run_in_process("show", "partial", home=tmp_path).stdout
        assert json.loads(run_in_process("show", "partial", "--json", home=tmp_path).stdout)["writing"] is True
    finally:
        os.close(fd)
    assert json.loads(run_in_process("show", "partial", "--json", home=tmp_path).stdout)["writing"] is False
    assert "ingest unfinished: --resume" in run_in_process("show", "partial", home=tmp_path).stdout
    r = run_in_process("show", "s", "--json", home=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)["tokens"] > 0
    ppl = json.loads(r.stdout)["perplexity"]
    assert ppl > 1 and f"perplexity  {ppl:.2f} (the documents as read" in run_in_process("show", "s", home=tmp_path).stdout
    # rm asks; without a terminal and without --yes it refuses, and removes nothing
    r = run_in_process("rm", "s", home=tmp_path)
    assert r.returncode == 1 and "add --yes" in r.stderr and s.exists()
    # a store being written is refused
    fd = os.open(s / "lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        for args in (["rm", "s", "--yes"], ["mv", "s", "t"]):
            r = run_in_process(*args, home=tmp_path)
            assert r.returncode == 1 and "being written" in r.stderr and s.exists(), args
    finally:
        os.close(fd)
    r = run_in_process("mv", "s", "t", "--json", home=tmp_path)
    assert r.returncode == 0 and not s.exists() and (tmp_path / "stores" / "t" / "manifest.json").is_file()
    assert json.loads(r.stdout)["to"] == str(tmp_path / "stores" / "t")
    r = run_in_process("mv", "t", "partial", home=tmp_path)
    assert r.returncode == 1 and "exists already" in r.stderr
    r = run_in_process("rm", "t", "partial", "--yes", home=tmp_path)
    assert r.returncode == 0 and not (tmp_path / "stores" / "t").exists() and not inc.exists()
    r = run_in_process("rm", "nope", "--yes", home=tmp_path)
    assert r.returncode == 1 and "no store 'nope'" in r.stderr
    not_a_store = tmp_path / "plain"
    not_a_store.mkdir()
    r = run_in_process("rm", str(not_a_store), "--yes", home=tmp_path)
    assert r.returncode == 1 and "not an emllm store" in r.stderr and not_a_store.exists()


@pytest.mark.slow
def test_ask_without_store_says_which_and_a_closed_pipe_is_no_error(tiny, tmp_path):
    _store(tiny, tmp_path)
    r = run("ask", QUESTION, "-n", "2", home=tmp_path)
    assert r.returncode == 0 and "store s (the most recently updated; choose with --store)" in r.stderr
    env = {**os.environ, **cli_env(tmp_path)}
    p = subprocess.Popen([EMLLM, "ask", QUESTION, "-n", "2", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # the reader leaves at once, as `| head -1` does after its line
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0 and b"error" not in err, err


def test_usage_lines_and_short_flags(tmp_path):
    r = run("ask", "--help", home=tmp_path)
    assert r.stdout.startswith("Usage: emllm ask [OPTIONS] QUESTION\n")
    r = run("inspect", "s", "-q", "x", "-l", "1", home=tmp_path)  # -l is passkey's --lengths, not --layer
    assert r.returncode == 2 and "No such option: -l" in r.stderr


@pytest.mark.slow
def test_retrieval_view_marks_the_window_and_the_initial_tokens(tiny, tmp_path):
    _store(tiny, tmp_path)
    r = run("inspect", "s", "--query", QUESTION, home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "local window: attended always, never retrieved" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line[:4].strip().isdigit()]
    doc = json.loads(run("inspect", "s", "--query", QUESTION, "--json", home=tmp_path).stdout)["retrieval"]
    assert doc["initial_tokens"] == 4 and 0 < doc["window_start"] < doc["window_start"] + 32
    # the first stretch holds the initial tokens: marked "i" in every layer that did not retrieve
    # the event sharing that stretch, shaded in those that did; the last is the local window's
    assert len(rows) == len(doc["coverage"]) and all(line.rstrip().endswith("w") for line in rows)
    assert all((line[4] == "i") == (cov[0] == 0) and (line[4] == "i" or line[4] in "░▒▓█")
               for line, cov in zip(rows, doc["coverage"]))


def test_segment_metrics_are_printed(tiny, tmp_path):
    folder, prof, _, _ = tiny
    doc = tmp_path / "d.txt"
    doc.write_text(words(8, 300))
    r = run("segment", str(doc), "-m", str(folder), "--profile", str(prof), "--metrics", home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "difference to random" in r.stdout and "modularity" in r.stdout


@pytest.mark.slow
def test_slow_steps_say_what_they_do(tiny, tmp_path):
    _store(tiny, tmp_path)
    env = {**os.environ, **cli_env(tmp_path, EMLLM_PROGRESS="1")}
    r = subprocess.run([EMLLM, "ask", QUESTION, "-n", "1", "--store", "s"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "loading the model of s and opening it" in r.stderr, r.stderr


@pytest.mark.slow
def test_names_with_escape_sequences_and_markup_reach_no_terminal_raw(tiny, tmp_path):
    """A store or document named with control characters (ESC sequences that clear or retitle a
    terminal, C1 controls, a bidi override) or Rich markup is shown escaped by every command."""
    import re

    folder, prof, _, _ = tiny
    hostile = "\x1b[2J\x1b]0;owned\x07\x9b31m\u202e[red]x[/red]"
    doc = tmp_path / f"doc{hostile.replace('/', '')}.txt"
    doc.write_text(words(5, 300))
    controls = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
    r = run("ingest", str(doc), "-m", str(folder), "--profile", str(prof), home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not controls.search(r.stderr) and not controls.search(r.stdout), r.stderr
    (name,) = os.listdir(tmp_path / "stores")  # named after the document: safe characters only
    assert name.isprintable() and not controls.search(name) and "[" not in name, name
    r = run("ingest", str(doc), "-m", str(folder), "--profile", str(prof), "--store", "s" + hostile.replace("/", ""),
            home=tmp_path)  # a name the user typed is kept as typed, and shown escaped
    assert r.returncode == 0, r.stderr
    assert not controls.search(r.stderr) and "\\x1b[2J" in r.stderr, r.stderr
    for args in (("list",), ("show", "s" + hostile.replace("/", "")), ("list", "--json"), ("inspect",)):
        r = run(*args, home=tmp_path)
        assert r.returncode == 0, (args, r.stderr)
        assert not controls.search(r.stdout) and not controls.search(r.stderr), (args, r.stdout)
    shown = run("show", "s" + hostile.replace("/", ""), home=tmp_path, env={"COLUMNS": "400"}).stdout
    assert "\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\u202e[red]x[red]" in shown, shown  # markup shown, not applied


def test_a_bare_name_is_a_store_under_the_home_unless_a_store_here_has_it(tiny, tmp_path, monkeypatch):
    """`emllm ingest proj` run beside the folder it reads makes the store proj under the home (the
    folder's name was taken for a path: "proj exists and is not an empty folder"), and `--store
    proj` then finds it there; a store in the current folder is still found by its bare name."""
    import emllm

    folder, prof, _, _ = tiny
    work = tmp_path / "work"
    (work / "proj" / "src").mkdir(parents=True)
    (work / "proj" / "src" / "a.py").write_text("def f():\n    return 41\n")
    local = _store(tiny, work, "here")  # work/stores/here: a store in a folder of the current one
    monkeypatch.chdir(work)
    monkeypatch.setenv("EMLLM_HOME", str(tmp_path / "home"))
    home = tmp_path / "home" / "stores"
    assert emllm.store_path("proj") == home / "proj" and emllm.store_path("./proj") == Path("./proj")
    assert emllm.store_path("stores") == home / "stores" and emllm.store_path("stores/here") == Path("stores/here")
    monkeypatch.chdir(local.parent)
    assert emllm.store_path("here") == Path("here")  # (a store here: its path)
    monkeypatch.chdir(work)
    before = sorted(p.relative_to(work) for p in (work / "proj").rglob("*"))
    r = run_in_process("ingest", "proj", "-m", str(folder), "--profile", str(prof), "--json", home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["store"] == str(home / "proj") and (home / "proj" / "manifest.json").is_file()
    assert sorted(p.relative_to(work) for p in (work / "proj").rglob("*")) == before  # the folder read, not written
    r = run_in_process("show", "proj", "--json", home=tmp_path / "home")
    assert r.returncode == 0 and json.loads(r.stdout)["documents"][0]["name"].endswith("a.py"), r.stdout


def test_a_writer_waits_out_a_look_at_its_lock(tmp_path):
    import threading

    from emllm.store.files import FolderLocked, folder_written, lock_folder

    assert not folder_written(tmp_path)  # no lock file: nothing is created to look
    assert not (tmp_path / "lock").exists()
    (tmp_path / "lock").touch()
    look = os.open(tmp_path / "lock", os.O_RDONLY)
    fcntl.flock(look, fcntl.LOCK_SH)  # `list` looking, held far longer than it is
    threading.Timer(0.05, os.close, (look,)).start()
    w = lock_folder(tmp_path)  # waits for the look to end instead of refusing
    try:
        assert folder_written(tmp_path)
        with pytest.raises(FolderLocked, match="being written by another emllm process"):
            lock_folder(tmp_path)
    finally:
        os.close(w)
    assert not folder_written(tmp_path)


def test_a_stores_moved_model_is_named_where_it_is_now(tiny, tmp_path):
    import shutil

    folder, prof, other, _ = tiny
    model = tmp_path / "my-model"
    shutil.copytree(folder, model)
    ingest_store(tmp_path / "stores" / "book", model, prof, [("doc", words(11, 300))])
    model.rename(tmp_path / "moved")
    for cmd in (["ask", QUESTION, "-n", "3"], ["inspect", "book", "--query", QUESTION]):
        r = run_in_process(*cmd, *(["--store", "book"] if cmd[0] == "ask" else []), home=tmp_path)
        # (it said: unknown model '...': give a profile alias (...), and ask had no way to name it)
        assert r.returncode == 1 and f"the store's model {model} is not there (moved or deleted)" in r.stderr, r.stderr
        r = run_in_process(*cmd, *(["--store", "book"] if cmd[0] == "ask" else []), "-m", str(tmp_path / "moved"),
                           home=tmp_path)
        assert r.returncode == 0, r.stderr
    r = run_in_process("ask", QUESTION, "--store", "book", "-m", str(other), home=tmp_path)  # other weights: refused
    assert r.returncode == 1 and "config differs" in r.stderr


def test_a_stores_hub_model_missing_from_the_cache_is_not_called_moved(tiny, tmp_path):
    # A hub id holds a "/" as a path does: its absence was told as a folder "moved or deleted".
    folder, prof, _, _ = tiny
    path = tmp_path / "stores" / "book"
    ingest_store(path, folder, prof, [("doc", words(11, 100))])
    m = json.loads((path / "manifest.json").read_text())
    m["model"] = "someone/not-in-the-cache"
    m["identity"]["model"] = m["model"]
    m["checksum"] = checksum(m)
    (path / "manifest.json").write_text(json.dumps(m))
    r = run_in_process("ask", QUESTION, "--store", "book", "-n", "2", home=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1 and "the store's model: model 'someone/not-in-the-cache' is not in the Hugging Face cache" in r.stderr, r.stderr
    assert "moved or deleted" not in r.stderr
