"""A store name made from a file name keeps only safe characters: nothing reaches a terminal or a path."""

from __future__ import annotations

import random
import re

from emllm.home import store_name_for

from .helpers import ingest_store, run_in_process, words

SAFE = re.compile(r"[\w-][\w.-]*")


def test_names_from_files_keep_letters_digits_and_dots():
    assert store_name_for("/home/me/books/moby-dick.txt") == "moby-dick"
    assert store_name_for("über café.txt") == "über-café"
    assert store_name_for(".bashrc") == "bashrc"  # a leading dot would make it a path
    assert store_name_for("\x1b[2J\x1b]0;owned\x07notes.md") == "2J-0-owned-notes"
    assert store_name_for("...") == "document"


def test_every_hostile_file_name_gives_a_safe_printable_name():
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0, 0x80)] + ["\u202e", "\u200b", "é", "日", "\ufeff", "\x9b", "[", "]"]
    for _ in range(2000):
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        if "\x00" in name:
            name = name.replace("\x00", "")
        got = store_name_for(name)
        assert SAFE.fullmatch(got) and got.isprintable() and "/" not in got, (name, got)


def test_a_store_name_under_the_home_that_is_a_link_is_refused_and_a_path_is_followed(tiny, tmp_path):
    """A name never leads out of the emllm home (a link under it is refused, its target untouched);
    a path the user types is theirs, and followed. Error lines print no raw escape sequence."""
    folder, prof, _, _ = tiny
    home = tmp_path / "home"
    elsewhere = tmp_path / "elsewhere"
    ingest_store(elsewhere / "real", folder, prof, [("doc", words(2, 80))])
    before = {p.name: p.stat().st_mtime_ns for p in (elsewhere / "real").iterdir()}
    r = run_in_process("list", home=home)  # (makes the home)
    stores = home / "stores"
    stores.mkdir(parents=True, exist_ok=True)
    (stores / "linked").symlink_to(elsewhere / "real")
    doc = tmp_path / "more.txt"
    doc.write_text(words(3, 20))
    for args in (("ask", "what?", "--store", "linked", "-n", "1"), ("ingest", str(doc), "--append", "--store", "linked"),
                 ("inspect", "linked")):
        r = run_in_process(*args, home=home)
        assert r.returncode == 1 and "symbolic link" in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    assert {p.name: p.stat().st_mtime_ns for p in (elsewhere / "real").iterdir()} == before
    link = tmp_path / "my-link"
    link.symlink_to(elsewhere / "real")
    r = run_in_process("inspect", str(link), home=home)
    assert r.returncode == 0, r.stderr
    r = run_in_process("ask", "what?", "--store", str(tmp_path / "no\x1b[2Jstore"), home=home)
    assert r.returncode == 1 and "\x1b" not in r.stderr and "\\x1b[2J" in r.stderr, r.stderr
