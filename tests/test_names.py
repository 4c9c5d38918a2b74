"""A store name made from a file name keeps only safe characters: nothing reaches a terminal or a path."""

from __future__ import annotations

import random
import re

from emllm.home import store_name_for

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
