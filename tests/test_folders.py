"""A folder read as a code base (`emllm ingest FOLDER`): the files git would list, in its order,
each named in the stream; the files no text comes from left out and said so; a job of thousands
of files holds one open at a time."""

from __future__ import annotations

import codecs
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from emllm.app.folders import folder_files, header, open_documents
from emllm.app.textinput import InputError, TextSource
from emllm.store import Store

from .helpers import CPU_ONLY, assert_same_state, ingest_store, interrupted_ingest, named_context, run, store_arrays, words


def _tree(root: Path) -> Path:
    """A work tree with the cases git's ignore rules have: nested .gitignore files, negation, folder
    patterns, anchored ones, an ignored folder whose files a deeper rule cannot bring back, a
    .gitignore above the folder read, .git/info/exclude below every .gitignore; hidden files; names
    that sort differently by bytes."""
    files = {
        ".gitignore": "*.log\n!keep.log\nbuild/\n/top.txt\nsrc/gen/\n!README.md\n",  # (README: back from info/exclude)
        "README.md": "read me\n",
        "top.txt": "ignored at the top only\n",
        "a.txt": "a\n", "a/b.txt": "under a\n", "a-b.txt": "dash\n", "Z.txt": "capital\n", "ü.txt": "umlaut\n",
        "x.log": "ignored\n", "keep.log": "kept by negation\n",
        "build/out.txt": "ignored folder\n",
        "src/main.py": "print('hi')\n", "src/top.txt": "not the anchored one\n",
        "src/.gitignore": "*.tmp\n!important.log\n", "src/x.tmp": "ignored below\n", "src/important.log": "kept below\n",
        "src/gen/code.py": "generated\n", "src/gen/.gitignore": "!code.py\n",  # (git: no re-include under an ignored folder)
        "src/pkg/__init__.py": "\n", "src/pkg/mod.py": "x = 1\n", "src/pkg/build/x.py": "ignored folder, deeper\n",
        ".hidden.txt": "hidden\n", ".cfg/settings.txt": "hidden folder\n", "src/.env": "hidden below\n",
        "src/notes.md": "excluded by info/exclude\n", "local.txt": "excluded by info/exclude\n",
    }
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    env = {**os.environ, "HOME": str(root), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    subprocess.run(["git", "init", "-q", str(root)], check=True, env=env)
    (root / ".git" / "info").mkdir(parents=True, exist_ok=True)
    (root / ".git" / "info" / "exclude").write_text("*.md\n/local.txt\n")  # git's weakest rules
    return root


def _git_lists(root: Path, sub: str = ".") -> list[str]:
    """What git lists in the work tree `root` under `sub`, as paths from `sub`, hidden ones left out
    (a leading dot in any part: ripgrep's default, and emllm's)."""
    env = {**os.environ, "HOME": str(root), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    out = subprocess.run(["git", "-c", "core.excludesFile=", "-c", "core.quotePath=off", "ls-files", "-z", "--others",
                          "--cached", "--exclude-standard", "--", sub], cwd=root, capture_output=True, check=True,
                         env=env).stdout
    paths = [p for p in out.decode().split("\0") if p]
    prefix = "" if sub == "." else sub.rstrip("/") + "/"
    return [p[len(prefix):] for p in paths if not any(part.startswith(".") for part in p.split("/"))]


@pytest.mark.parametrize("sub", [".", "src"])
def test_a_folders_files_are_those_git_lists_in_its_order(tmp_path, sub):
    root = _tree(tmp_path / "proj")
    expected = _git_lists(root, sub)
    assert "a-b.txt" in expected or sub != "."  # (the reference lists what the tree holds)
    got = folder_files(root / sub)
    label = (root / sub).resolve().name
    assert [name for name, _ in got] == [f"{label}/{p}" for p in expected]
    assert all(path == root / sub / p for (_, path), p in zip(got, expected))
    if sub == "src":  # the .gitignore above it is read: its anchored and folder rules hold below
        assert "src/gen/code.py" not in [n for n, _ in got] and "src/top.txt" in [n for n, _ in got]


def test_links_are_not_followed_and_other_files_are_not_read(tmp_path):
    root = tmp_path / "proj"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f.txt").write_text("f\n")
    (root / "d" / "loop").symlink_to(root)  # a cycle, were links followed
    (root / "link.txt").symlink_to(root / "d" / "f.txt")
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (root / "key.txt").symlink_to(secret)  # out of the folder: it was read into the store
    (root / "ignored.txt").symlink_to(secret)
    (root / ".gitignore").write_text("ignored.txt\n")
    os.mkfifo(root / "pipe")  # would block a reader
    told = []
    assert [n for n, _ in folder_files(root, lambda name, why: told.append((name, why)))] == ["proj/d/f.txt"]
    assert sorted(told) == [("proj/d/loop", "link"), ("proj/key.txt", "link"), ("proj/link.txt", "link")]


def test_a_folder_opens_its_files_named_and_leaves_out_what_holds_no_text(tmp_path):
    root = tmp_path / "proj"
    root.mkdir()
    (root / "a.py").write_text("def f():\n    return 1\n")
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (root / "empty.txt").write_text("")
    (root / "blank.txt").write_text("\n\n   \n")
    (root / "notes.md").write_text("# notes\nsee a.py\n")
    single = tmp_path / "single.txt"
    single.write_text("on its own\n")
    left: list[tuple[str, str]] = []
    docs = open_documents([str(single), str(root)], skipped=lambda n, why: left.append((n, why)))
    assert [n for n, _ in docs] == [str(single), "proj/a.py", "proj/notes.md"]
    assert sorted(left) == [("proj/blank.txt", "empty"), ("proj/empty.txt", "empty"), ("proj/logo.png", "binary")]
    texts = ["".join(src.pieces()) for _, src in docs]
    assert texts == ["on its own\n", "==> proj/a.py <==\ndef f():\n    return 1\n", "==> proj/notes.md <==\n# notes\nsee a.py\n"]
    assert header("proj/a.py") == "==> proj/a.py <==\n"
    # the text's own digest and length, the header left out (an interrupted job is known by its files')
    import hashlib
    assert docs[1][1].sha256 == hashlib.sha256(b"def f():\n    return 1\n").hexdigest() and docs[1][1].chars == 22
    with pytest.raises(InputError, match="no text files to read"):
        (tmp_path / "bare").mkdir()
        (tmp_path / "bare" / "x.bin").write_bytes(b"\x00\x01")
        open_documents([str(tmp_path / "bare")])
    with pytest.raises(InputError, match="binary") as e:  # a file named by the user is refused, not left out
        open_documents([str(root / "logo.png")])
    assert e.value.kind == "binary"


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be"])
def test_utf16_text_with_its_byte_order_mark_is_read_as_text(tmp_path, codec):
    # Windows tools write UTF-16: its NUL bytes made it "a binary file", left out of a folder.
    text = "Café notes\nThe key is under the mat. 日本語\n" * 3000  # pieces of 64 KiB cut characters
    f = tmp_path / "notes.txt"
    f.write_bytes("\ufeff".encode(codec) + text.encode(codec))
    src = TextSource.open(str(f))
    assert "".join(src.pieces()) == text and src.chars == len(text)
    plain = tmp_path / "plain.txt"
    plain.write_text(text, encoding="utf-8")
    same = TextSource.open(str(plain))
    list(same.pieces())
    assert src.sha256 == same.sha256  # the text's, whatever its encoding
    for blank in ("", " \n\t\n"):
        (tmp_path / "blank.txt").write_bytes(("\ufeff" + blank).encode(codec))
        with pytest.raises(InputError, match="is empty"):
            TextSource.open(str(tmp_path / "blank.txt"))
    bom8 = tmp_path / "bom8.txt"  # UTF-8's mark is no part of the text either
    bom8.write_bytes(codecs.BOM_UTF8 + text.encode())
    src8 = TextSource.open(str(bom8))
    assert "".join(src8.pieces()) == text and src8.sha256 == same.sha256
    (tmp_path / "bom8-only.txt").write_bytes(codecs.BOM_UTF8 + b"\n ")
    with pytest.raises(InputError, match="is empty"):
        TextSource.open(str(tmp_path / "bom8-only.txt"))
    (tmp_path / "nul.bin").write_bytes(b"ab\x00cd")  # NUL bytes without a mark: still binary
    with pytest.raises(InputError, match="binary"):
        TextSource.open(str(tmp_path / "nul.bin"))


def test_a_file_named_twice_is_read_once(tmp_path, monkeypatch):
    # `emllm ingest *.md README.md`: the file was read twice into the stream, without a word
    root = tmp_path / "proj"
    root.mkdir()
    (root / "a.md").write_text("alpha\n")
    (root / "b.md").write_text("beta\n")
    monkeypatch.chdir(tmp_path)
    told = []
    docs = open_documents(["proj/a.md", "./proj/a.md", "proj", "proj/b.md", "proj"],
                          skipped=lambda name, why: told.append((name, why)))
    assert [n for n, _ in docs] == ["proj/a.md", "proj/b.md"]
    assert told == [("./proj/a.md", "named twice"), ("proj/a.md", "named twice"), ("proj/b.md", "named twice"),
                    ("proj/a.md", "named twice"), ("proj/b.md", "named twice")]
    for _, src in docs:
        src.close()


def test_a_regular_file_is_not_held_open_until_read(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("x " * 100000)
    src = TextSource.open(str(f))
    assert src.stream is None and src.first == b""  # checked, closed
    f.write_bytes(b"changed\x00")  # what is read is checked again
    with pytest.raises(InputError, match="NUL bytes at byte 7"):
        list(src.pieces())


def test_thousands_of_files_read_with_few_descriptors(tmp_path):
    """Every file is checked before any is read, yet none stays open: a code base of more files than
    the process may open at once reads."""
    root = tmp_path / "many"
    root.mkdir()
    for i in range(600):
        (root / f"f{i:04d}.txt").write_text(f"file {i}\n")
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
        "from emllm.app.folders import open_documents\n"
        f"docs = open_documents([{str(root)!r}])\n"
        "texts = [''.join(s.pieces()) for _, s in docs]\n"
        "print(len(texts), texts[-1].splitlines()[-1])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["600", "file", "599"], r.stderr


@pytest.mark.slow
def test_ingest_a_folder_is_its_files_named_in_one_job_and_the_same_command_continues_it(tiny, tmp_path):
    folder, prof, _, _ = tiny
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)
    (root / ".gitignore").write_text("*.bin\n")
    (root / "src" / "b.py").write_text(words(1, 120))
    (root / "a.md").write_text(words(2, 150))
    for i in range(13):  # more than `emllm show` names
        (root / "src" / f"m{i:02d}.py").write_text(words(10 + i, 8))
    (root / "data.bin").write_bytes(b"\x00" * 10)
    (root / "logo.png").write_bytes(b"\x89PNG\x00")
    (root / "empty.txt").write_text("")
    r = run("ingest", str(root), "-m", str(folder), "--profile", str(prof), "--json", home=tmp_path, env=CPU_ONLY)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    names = ["proj/a.md", "proj/src/b.py", *(f"proj/src/m{i:02d}.py" for i in range(13))]
    assert out["documents"] == names and out["store"] == str(tmp_path / "stores" / "proj")
    assert out["left_out"] == [{"name": "proj/empty.txt", "why": "empty"}, {"name": "proj/logo.png", "why": "binary"}]
    assert "left out: 1 empty (proj/empty.txt); 1 binary (proj/logo.png)" in r.stderr, r.stderr
    # the stream: each file's text after its header, as if the two were given as texts
    docs = [(n, header(n) + (root / n.removeprefix("proj/")).read_text()) for n in out["documents"]]
    ingest_store(tmp_path / "ref", folder, prof, docs)
    assert store_arrays(tmp_path / "stores" / "proj") == store_arrays(tmp_path / "ref")
    assert_same_state(tmp_path / "stores" / "proj", tmp_path / "ref")
    with Store.open(tmp_path / "stores" / "proj") as st:
        assert [d.name for d in st.info.documents] == out["documents"]
    shown = run("show", "proj", home=tmp_path, env={"COLUMNS": "400"}).stdout
    assert "proj/src/m09.py, … 15 in all (--json lists them)" in shown and "m10" not in shown, shown
    # interrupted after its first commit, the same command continues it
    interrupted_ingest(tmp_path / "stores" / "again", folder, prof, open_documents([str(root)]))
    r = run("ingest", str(root), "--store", "again", home=tmp_path, env=CPU_ONLY)
    assert r.returncode == 0 and "continuing the interrupted ingest" in r.stderr, r.stderr
    assert store_arrays(tmp_path / "stores" / "again") == store_arrays(tmp_path / "ref")


def _folder_store(tiny, tmp_path: Path, seed: int, n_words: int) -> tuple[Path, Path]:
    """A folder `proj` of three files (f0-f2.py, `n_words` words each from `seed` on), ingested by
    the tiny model into the store `tmp_path/s`: (the model's folder, the folder read)."""
    folder, prof, _, _ = tiny
    root = tmp_path / "proj"
    root.mkdir()
    for i in range(3):
        (root / f"f{i}.py").write_text(words(seed + i, n_words))
    ingest_store(tmp_path / "s", folder, prof, open_documents([str(root)]))
    return folder, root


def test_a_reread_reads_each_passage_of_a_folders_file_after_the_line_naming_it(tiny, tmp_path):
    """The store keeps each folder file's naming line; a re-read answer reads it before every
    passage that starts inside that file after it (unless it goes on from the one before)."""
    from emllm.app.ask import Session
    from emllm.app.stream import encode

    from .helpers import QUESTION, load_tiny

    folder, _ = _folder_store(tiny, tmp_path, 20, 300)
    model, tok = load_tiny(folder)
    with Store.open(tmp_path / "s") as st:
        assert [d.header for d in st.info.documents] == [header(f"proj/f{i}.py") for i in range(3)]
        s = Session(st, model, tok, reread=True)
        q = s.question_ids(QUESTION)
        reader = s._reread(q, 4)
        context = reader.ids.view()[: reader.n_tokens - len(q)].tolist()
        stream = s.engine.ids.view()[: s.engine.n_tokens - len(q)].tolist()
        n_init = s.engine.profile.n_init
        named = [(d.start, d.start + d.tokens, encode(tok, d.header)) for d in st.info.documents]
        want, lines = named_context(stream, n_init, s.passages, named)
        assert context == want and lines >= 1 and len(s.passages) > 2


@pytest.mark.slow
def test_an_append_of_a_folder_read_before_adds_its_new_and_changed_files_only(tiny, tmp_path):
    folder, prof, _, _ = tiny
    root = tmp_path / "proj"
    root.mkdir()
    for i in range(3):
        (root / f"f{i}.py").write_text(words(30 + i, 40))
    r = run("ingest", str(root), "-m", str(folder), "--profile", str(prof), home=tmp_path, env=CPU_ONLY)
    assert r.returncode == 0, r.stderr
    (root / "f1.py").write_text(words(40, 40))  # changed
    (root / "f3.py").write_text(words(41, 40))  # new
    r = run("ingest", str(root), "--store", "proj", "--append", "--json", home=tmp_path, env=CPU_ONLY)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["unchanged"] == ["proj/f0.py", "proj/f2.py"] and "2 files unchanged since the store read them" in r.stderr
    assert out["documents"] == ["proj/f0.py", "proj/f1.py", "proj/f2.py", "proj/f1.py", "proj/f3.py"]
    r = run("ingest", str(root), "--store", "proj", "--append", "--json", home=tmp_path, env=CPU_ONLY)
    assert r.returncode == 0 and "nothing to add: the store holds each of these 4 files as it is" in r.stderr, r.stderr
    assert json.loads(r.stdout)["unchanged"] == ["proj/f0.py", "proj/f1.py", "proj/f2.py", "proj/f3.py"]
    with Store.open(tmp_path / "stores" / "proj") as st:
        assert len(st.info.documents) == 5
    single = tmp_path / "one.txt"  # a file named by the user is added again, as before (with a note)
    single.write_text(words(42, 20))
    for _ in range(2):
        r = run("ingest", str(single), "--store", "proj", "--append", "--json", home=tmp_path, env=CPU_ONLY)
        assert r.returncode == 0 and json.loads(r.stdout)["unchanged"] == [], r.stderr
    assert "the store held this text already" in r.stderr


def test_retrieval_names_the_document_of_each_event(tiny, tmp_path):
    from emllm.app.report import retrieval_report

    from .helpers import QUESTION, load_tiny

    folder, _ = _folder_store(tiny, tmp_path, 50, 200)
    model, tok = load_tiny(folder)
    with Store.open(tmp_path / "s") as st:
        r = retrieval_report(st, model, tok, QUESTION, layer=0, top=50)
        docs = st.info.documents
    events = r["top_events"] + [e for s in r["layer"]["steps"] for e in s["events"]]
    for e in events:  # brute force: the document whose tokens hold the event's first
        want = [d.name for d in docs if d.start <= e["tokens"][0] < d.start + d.tokens]
        assert e["document"] == (want[0] if want else None)
    assert len({e["document"] for e in events} - {None}) >= 2
