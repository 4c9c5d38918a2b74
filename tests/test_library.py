"""The library's functions outside a store, called as a program calls them."""

from __future__ import annotations

import pytest

import emllm

from .helpers import words


def test_segment_takes_a_model_by_name_and_one_method_as_a_string(tiny):
    # A model's name failed ("'str' object has no attribute 'tokenizer'"), and "SM" was read as
    # the methods "S" and "M".
    folder, prof, _, _ = tiny
    text = words(11, 300)
    loaded = emllm.load(str(folder), profile=str(prof))
    want = emllm.segment(text, loaded, ["SM"])
    assert emllm.segment(text, loaded, "SM") == want
    with pytest.raises(emllm.UsageError, match="'XX': choose one of"):
        emllm.segment(text, "no-such-model-is-loaded-before-the-check", "XX")
    got = emllm.segment(text, str(folder), "F")  # by name: the profile guessed for the folder
    assert got["F"]["tokens"] == want["SM"]["tokens"] and got["F"]["events"]


def test_a_bad_dtype_is_an_error_the_user_can_fix():
    with pytest.raises(emllm.EmllmError, match="unknown dtype 'float8': use one of auto, float32, bfloat16"):
        emllm.load("smollm2", dtype="float8")  # (refused before any weights are read)


def test_opening_a_bare_name_points_to_the_homes_store_of_that_name(tiny, tmp_path, monkeypatch):
    from .helpers import ingest_store

    folder, prof, _, _ = tiny
    monkeypatch.setenv("EMLLM_HOME", str(tmp_path / "home"))
    ingest_store(emllm.store_path("book"), folder, prof, [("doc", words(11, 200))])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(emllm.StoreError, match=r"no store at book here; the store 'book' under the emllm home is "
                                               r"emllm.open\(emllm.store_path\('book'\)\)"):
        emllm.open("book")
    with pytest.raises(emllm.StoreError, match="^no store at other$"):
        emllm.open("other")
    with emllm.open(emllm.store_path("book")) as mem:
        assert mem.info.rows.tokens + mem.info.pending > 0
