"""The `emllm` executable: exit codes, one-line errors, JSON output (each through a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess


import pytest
from .helpers import EMLLM, cli_env, run





@pytest.mark.parametrize("args, code, needle", [
    (["passkey", "--lengths", "foo"], 2, "not a length"),
    (["passkey", "--depths", "2"], 2, "depths must lie in [0, 1]"),
    (["passkey", "-m", "nope"], 1, "unknown model 'nope'"),
    (["passkey", "-m", "llama3.1"], 1, "never downloads"),
    (["passkey", "--profile", "nope"], 1, "unknown profile 'nope'"),
    (["passkey", "--memory-dir", __file__], 2, "Invalid value for '--memory-dir'"),
    (["passkey", "--resume"], 2, "needs --memory-dir"),
    (["segment", "README.md", "--out", "/nonexistent/x.json"], 1, "no folder /nonexistent"),
    (["ingest", "README.md", "-m", "nope"], 1, "unknown model 'nope'"),
    (["ingest", "README.md", "--profile", "nope"], 1, "unknown profile 'nope'"),
    (["ingest"], 2, "give at least one file"),
    (["ingest", "--resume", "README.md"], 2, "continues the interrupted"),
    (["ingest", "-"], 2, "name the store"),
    (["ask", "hi", "--store", "/nonexistent/store"], 1, "no store"),
    (["ask", " "], 1, "the question is empty"),
    (["inspect", "nope"], 1, "no store 'nope'"),
])
@pytest.mark.slow
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
    for cmd, opt in (("ingest", "--resume"), ("ask", "--show-retrieval"), ("inspect", "--query"), ("segment", "--metrics")):
        r = run(cmd, "--help", home=tmp_path)
        assert r.returncode == 0 and opt in r.stdout and "Examples" in r.stdout, cmd
    r = run("ingest", "--help", home=tmp_path)  # an example and its comment stay on one line
    assert any("emllm ingest book.txt" in line and "# store 'book', the default model" in line for line in r.stdout.splitlines())
    r = run(home=tmp_path)  # bare: the help, and the usage error's code
    assert r.returncode == 2 and r.stdout.startswith("Usage: emllm") and "Commands:" in r.stdout and not r.stderr


def test_bad_profile_value(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_local: -3\n")
    r = run("ingest", "README.md", "--profile", str(bad), home=tmp_path)
    assert r.returncode == 1 and "n_local: must be an integer >= 1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "stores").exists()


@pytest.mark.slow
def test_passkey_json(tmp_path, smollm2):  # smollm2: the converted model exists before the subprocess
    r = run("passkey", "-l", "1k", "-d", "0,1", "-t", "1", "--baseline", "--reread", "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["lengths"] == [1024] and doc["depths"] == [0.0, 1.0]
    assert len(doc["results"]) == 6 and set(doc["accuracy"]) == {"emllm", "reread", "baseline"}
    assert {x["method"] for x in doc["results"]} == {"emllm", "reread", "baseline"}
    for x in doc["results"]:
        assert set(x) >= {"length", "depth", "trial", "key", "answer", "correct", "method", "seconds", "tokens"}
        assert len(x["key"]) == 5 and abs(x["tokens"] - 1024) <= 8
    # 1k fits the window: emllm is the plain model here, so both must agree.
    by = {(x["depth"], x["method"]): x["answer"] for x in doc["results"]}
    assert by[(0.0, "emllm")] == by[(0.0, "baseline")]
    # within emllm's span a re-read reads the whole prompt: the plain model's answer, the needle read
    assert all(by[(d, "reread")] == by[(d, "baseline")] for d in (0.0, 1.0))
    assert all(x["needle_read"] and x["reread_tokens"] > 1000 for x in doc["results"] if x["method"] == "reread")
    # 1k is all window: the needle was attended by every layer, nothing to retrieve
    for x in doc["results"]:
        if x["method"] in ("emllm", "reread"):
            assert x["needle_where"] in ("init", "window") and x["needle_layers"] == 1.0 and x["needle_ranks"] == []
        else:
            assert x["needle_where"] is None


@pytest.mark.slow
def test_passkey_cells_named_twice_and_lengths_without_haystack(tmp_path, smollm2):
    # A length or depth named twice ran its cells twice and scored both rows with 2/2 trials;
    # 10 tokens "found" the key in a 69-token prompt that had no filler.
    r = run("passkey", "-l", "0.5k,512", "-d", "1,1.0", "-t", "1", "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["lengths"] == [512] and doc["depths"] == [1.0] and len(doc["results"]) == 1
    r = run("passkey", "-l", "10,1k", "-t", "1", home=tmp_path)
    assert r.returncode == 2 and "10 tokens hold no haystack" in r.stderr and "is 69 tokens" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bin.dat").write_bytes(b"\x00\x01\x02binary\x00" * 10)
    return tmp_path


@pytest.mark.parametrize("name, needle", [
    ("missing.txt", "no such file"),
    ("dir", "is a directory"),
    ("empty.txt", "is empty"),
    ("bin.dat", "binary file"),
])
def test_segment_bad_files(bad_files, name, needle):
    r = run("segment", str(bad_files / name), home=bad_files)
    assert r.returncode == 1 and needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_segment_bad_method(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello world")
    r = run("segment", str(f), "--method", "XY", home=tmp_path)
    assert r.returncode == 2 and "choose one of" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["segment", "README.md", "--method", "XY"], "choose one of"),
    (["passkey", "-l", "4k,,16k"], "none empty: '4k,,16k'"),
    (["passkey", "-l", "inf"], "not a length: 'inf'"),
    (["passkey", "-d", "0,2"], "depths must lie in [0, 1]"),
    (["ingest", "README.md", "--store", ""], "an empty store name"),
    (["ask", "x", "--store", " "], "an empty store name"),
    (["inspect", ""], "an empty store name"),
    (["inspect", "--nope"], "No such option: --nope"),
    (["inspect", "--layer", "2"], "--layer: needs --query"),
    (["inspect", "some-store", "--top", "3"], "--top: needs --query"),
    (["inspect", "some-store", "--query", " "], "the query is empty"),
    (["segment", "README.md", "--method", "F", "--gamma", "1"], "--gamma applies to S, SM and SC"),
    (["segment", "README.md", "--gamma", "nan"], "nan is not a finite number"),
])
@pytest.mark.slow
def test_usage_errors_are_one_line(tmp_path, args, needle):
    r = run(*args, home=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("emllm: error: ") and needle in lines[0], r.stderr
    assert f"(see 'emllm {args[0]} --help')" in lines[0] and not (tmp_path / "stores").exists()


TEXT = ("The old lighthouse keeper climbed the stairs every night. Ünïcödé — “quotes” and émojis 🌊 too.\n"
        "def f(x):\n    return x * 2  # code in the middle\n") * 12


@pytest.mark.slow
@pytest.mark.parametrize("method", ["S", "SM", "F", "FM"])
def test_segment_json_round_trips_and_slices_text(tmp_path, smollm2, method):
    src = tmp_path / "doc.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "b.json"
    r = run("segment", str(src), "--method", method, "--out", str(out), home=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.load(open(out, encoding="utf-8"))
    assert doc["method"] == method and doc["characters"] == len(TEXT)
    ev = doc["events"]
    assert "".join(TEXT[a:b] for a, b in (e["chars"] for e in ev)) == TEXT
    assert ev[0]["tokens"][0] == 0 and ev[-1]["tokens"][1] == doc["tokens"]
    assert all(e1["tokens"][1] == e2["tokens"][0] for e1, e2 in zip(ev, ev[1:]))
    sizes = [e["tokens"][1] - e["tokens"][0] for e in ev]
    assert max(sizes) <= doc["parameters"]["max_event"] and min(sizes[:-1]) >= doc["parameters"]["min_block"]
    assert doc["parameters"]["max_event"] == doc["parameters"]["max_block"] * (2 if method == "FM" else 1)


@pytest.mark.slow
def test_segment_stdin_and_metrics_json(tmp_path, smollm2):
    env = {**os.environ, **cli_env(tmp_path)}
    r = subprocess.run([EMLLM, "segment", "-", "--metrics", "--method", "all", "--json"], input=TEXT,
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc["difference_to_random"]) == {"F", "S", "SM", "SC", "FM", "FC"}
    f, fm = doc["methods"]["F"], doc["methods"]["FM"]  # same number of events, boundaries moved
    assert fm["events"] == f["events"] and fm["modularity"] > f["modularity"]
    for m, d in doc["methods"].items():
        for k in ("modularity", "conductance", "intra_inter"):
            assert doc["difference_to_random"][m][k] == pytest.approx(d[k] - doc["random"][m][k])
    json.loads(r.stdout, parse_constant=_no_constants)


def _no_constants(name: str):
    raise AssertionError(f"{name} in JSON")


@pytest.mark.slow
def test_segment_metrics_of_a_text_too_short_for_them(tmp_path, smollm2):
    # One event: no stretch to score. The JSON said NaN (not JSON: jq and JSON.parse refuse it)
    # and the table "+nan".
    src = tmp_path / "short.txt"
    src.write_text("The cat sat on the mat. It was a sunny day.\n", encoding="utf-8")
    r = run("segment", str(src), "--method", "F", "--metrics", "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout, parse_constant=_no_constants)
    assert len(doc["events"]) == 1
    assert doc["metrics"] == doc["random_metrics"] == doc["difference_to_random"] == dict.fromkeys(
        ("modularity", "conductance", "intra_inter"))
    r = run("segment", str(src), "--method", "F", "--metrics", home=tmp_path)
    assert r.returncode == 0 and "nan" not in r.stdout and r.stdout.count("n/a") == 4, r.stdout  # 3 cells, the caption
    assert "1 event," in r.stdout and "too short" in r.stdout


@pytest.mark.slow
def test_passkey_memory_dir_reads_the_shared_filler_once(tmp_path, smollm2):
    """--memory-dir: trials run on stores under the folder, in the order of their needle, the second
    continuing the filler the first read (tests/test_store.py: same logits as reading it all); the
    folder is left empty."""
    mem = tmp_path / "mem"
    r = run("passkey", "-l", "1536", "-d", "1,0.5", "-t", "1", "--memory-dir", str(mem), "--json", home=tmp_path,
            env={"EMLLM_PROGRESS": "0"})
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)["results"]
    assert [x["depth"] for x in res] == [0.5, 1.0] and all(x["correct"] for x in res), res
    # progress counts the shared filler once (read_plan): 1536 tokens for the whole filler, and after it
    # half a document for depth 0.5 and none for depth 1; it ends at its total
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("passkey: ")]
    assert lines and lines[-1].startswith("passkey: 2,304/2,304 (100%)"), r.stderr
    # chunks of 512: the first trial's trunk is its filler's whole chunks, the second shares them and more
    assert 0 < res[0]["trunk_tokens"] < res[1]["trunk_tokens"] and res[1]["trunk_tokens"] % 512 == 0
    assert list(mem.iterdir()) == []


@pytest.mark.slow
def test_passkey_resume_carries_on_after_ctrl_c(tmp_path, smollm2, monkeypatch):
    """--resume: Ctrl-C before the second trial keeps the first answer and the filler's store in
    --memory-dir; the same command again asks only the second, continues that store, and gives the
    answers of a run never stopped; the folder is left empty."""
    from typer.testing import CliRunner

    import emllm.evals.passkey
    from emllm_cli.main import app

    real, asked, stop = emllm.evals.passkey.run_emllm, [], {"at": 2}

    def ctrl_c_at(factory, tok, prompt, **kw):
        asked.append(prompt.key)
        if len(asked) == stop["at"]:
            raise KeyboardInterrupt
        return real(factory, tok, prompt, **kw)

    monkeypatch.setattr(emllm.evals.passkey, "run_emllm", ctrl_c_at)
    mem = tmp_path / "mem"
    args = ["passkey", "-l", "1536", "-d", "1,0.5", "-t", "1", "--memory-dir", str(mem), "--resume", "--json"]
    r1 = CliRunner().invoke(app, args)
    assert r1.exit_code == 130, r1.output
    first = json.loads(r1.stdout)["results"]
    assert [x["depth"] for x in first] == [0.5]
    assert "run the same command again to carry on" in r1.stderr.strip().splitlines()[-1]
    kept = mem / "emllm-kept-stores"
    assert (kept / "passkey-results.jsonl").exists() and (kept / "trunk").is_dir()

    other = CliRunner().invoke(app, args + ["--seed", "1"])  # another grid on this folder: refused, nothing lost
    assert other.exit_code == 1 and other.stderr.strip().splitlines() == [
        f"emllm: error: {kept} holds the progress of another passkey grid (other seed): run that grid again with "
        "--resume to finish it, remove that folder, or use another --memory-dir"]
    assert len(asked) == 2 and (kept / "trunk").is_dir()

    stop["at"] = 0
    r2 = CliRunner().invoke(app, args)
    assert r2.exit_code == 0, r2.output
    doc = json.loads(r2.stdout)
    assert len(asked) == 3 and doc["resumed_trials"] == 1 and doc["complete"] is True  # 1 asked, 1 cut, 1 asked
    assert doc["results"][0] == first[0]  # taken from the kept answers, not asked again
    second = doc["results"][1]
    assert second["depth"] == 1.0 and 0 < second["resumed_tokens"] <= second["trunk_tokens"]  # the kept trunk, continued
    assert "resuming: 1 of 2 trials answered already" in r2.stderr
    assert list(mem.iterdir()) == []

    r3 = CliRunner().invoke(app, args[:-2] + ["--json"])  # the same grid, never stopped, without --resume
    assert r3.exit_code == 0, r3.output
    plain = json.loads(r3.stdout)["results"]
    assert [(x["key"], x["answer"], x["correct"]) for x in plain] == [(x["key"], x["answer"], x["correct"]) for x in doc["results"]]
    assert all(x["correct"] for x in plain) and plain[1]["resumed_tokens"] == 0


def test_passkey_kept_answers_one_per_trial_of_this_grid(tmp_path):
    """What --resume takes from the kept answers: the last one written per trial of this grid, none
    that is malformed or outside the grid; undecodable bytes do not stop it."""
    from emllm.evals import results_log
    from emllm_cli.passkey import _kept_answers

    grid = {"model": "m", "profile": {}, "seed": 0, "lengths": [1024], "depths": [0.0, 1.0], "trials": 1, "baseline": False}
    log = tmp_path / "k.jsonl"
    ok = lambda depth, answer: {"length": 1024, "depth": depth, "trial": 0, "method": "emllm", "answer": answer, "correct": True}  # noqa: E731
    results_log.start_run(log, grid)
    for r in (ok(0.0, "1"), ok(0.0, "2"), ok(0.5, "3"), {**ok(1.0, "4"), "correct": "yes"}, {**ok(1.0, "5"), "trial": 1},
              {**ok(1.0, "6"), "method": "baseline"}):
        results_log.append(log, r)
    with open(log, "ab") as f:
        f.write(b'\xff\xfe{"length": 1\n[1, 2]\n')
    results_log.append(log, ok(1.0, "7"))
    assert [(r["depth"], r["answer"]) for r in _kept_answers(log, grid)] == [(0.0, "2"), (1.0, "7")]
    assert _kept_answers(tmp_path / "none.jsonl", grid) == []


def test_passkey_interrupted_prints_what_finished(smollm2, monkeypatch):
    """Ctrl-C during the grid: the trials that finished are printed (JSON marked incomplete), one
    line on stderr says so, exit code 130."""
    from typer.testing import CliRunner

    import emllm.evals.passkey
    from emllm_cli.main import app

    def one_then_ctrl_c(model, tok, factory, lengths, depths, trials, seed, baseline, on_result, **kw):
        on_result(emllm.evals.passkey.TrialResult(lengths[0], depths[0], 0, "12345", "12345.", True, "emllm", 1.5, lengths[0]))
        raise KeyboardInterrupt

    monkeypatch.setattr(emllm.evals.passkey, "run_grid", one_then_ctrl_c)
    r = CliRunner().invoke(app, ["passkey", "-l", "1k,2k", "-d", "0,1", "-t", "1", "--json"])
    assert r.exit_code == 130
    doc = json.loads(r.stdout)
    assert doc["complete"] is False and len(doc["results"]) == 1 and doc["accuracy"]["emllm"] == {"1024": 1.0, "2048": None}
    assert r.stderr.strip().splitlines()[-1] == "emllm: interrupted after 1 of 4 trials; the results above are partial"
    assert "Traceback" not in r.stderr


def test_print_json_keeps_lists_of_numbers_on_one_line(capsys):
    from emllm_cli import render

    doc = {"coverage": [[0.1, 0.25, 0.0], [1, -3e-05]], "text": "a [ 1, 2 ] b [\n 3\n]", "top": [{"tokens": [3, 9]}],
           "names": ["1", "2"], "mixed": [1, None], "empty": []}
    render.print_json(doc)
    out = capsys.readouterr().out
    assert json.loads(out) == doc  # the string's brackets untouched
    assert '    [0.1, 0.25, 0.0],\n    [1, -3e-05]\n' in out and '"tokens": [3, 9]' in out
    assert '"names": [\n    "1",' in out and '"mixed": [\n    1,\n    null\n  ]' in out


def test_progress_off_a_terminal_is_silent_unless_asked(monkeypatch):
    import io

    from rich.console import Console

    from emllm_cli import render
    from emllm_cli.errors import UserError

    def log(env: str | None) -> str:
        if env is None:
            monkeypatch.delenv("EMLLM_PROGRESS", raising=False)
        else:
            monkeypatch.setenv("EMLLM_PROGRESS", env)
        buf = io.StringIO()
        with render.progress(console=Console(file=buf, force_terminal=False, width=80)) as bar:
            t = bar.add_task("ingesting", total=2048, completed=512, rate="")
            bar.update(t, completed=1024, rate="80 tok/s")
            bar.update(t, advance=1024, rate="81 tok/s")
        return buf.getvalue()

    assert log(None) == "" and log("") == ""
    lines = log("0").splitlines()  # every update, and nothing again at the end
    assert [line.split(", ")[0] for line in lines] == ["ingesting: 1,024/2,048 (50%) 80 tok/s", "ingesting: 2,048/2,048 (100%) 81 tok/s"]
    assert "elapsed" in lines[0] and "eta" in lines[0] and "eta" not in lines[1]
    assert len(log("3600").splitlines()) == 2  # the first update, then the end
    for bad in ("soon", "-5", "inf", "nan"):
        with pytest.raises(UserError, match="EMLLM_PROGRESS"):
            log(bad)


def test_chat_with_standard_input_closed_is_one_line(tmp_path):
    env = {**os.environ, **cli_env(tmp_path)}
    r = subprocess.run(f"{EMLLM} chat --store c <&-", shell=True, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "emllm: error: standard input is closed: chat reads its messages from it (a terminal, or a pipe)"], r.stderr
    assert not (tmp_path / "stores" / "c").exists()


def test_segment_refuses_devices_and_ends_an_endless_stream(tmp_path):
    r = run("segment", "/dev/zero", home=tmp_path)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["emllm: error: /dev/zero: is a device, not a text file"]
    env = {**os.environ, **cli_env(tmp_path)}
    r = subprocess.run(f"yes 'a line of text' | {EMLLM} segment -", shell=True, capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "emllm: error: stdin: longer than 64 Mi characters: segment a part of it (emllm ingest reads any length)"], r.stderr
