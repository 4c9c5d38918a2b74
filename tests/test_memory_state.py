"""A `Memory` keeps one prepared session: each answer is read before the next one starts, and a
reader sees what another writer committed meanwhile."""

from __future__ import annotations

import pytest

import emllm

from .helpers import QUESTION, ingest_store, words


@pytest.fixture()
def store(tiny, tmp_path):
    folder, prof, _, _ = tiny
    path = tmp_path / "s"
    ingest_store(path, folder, prof, [("doc", words(11, 300))])
    return path


def test_an_answer_is_read_before_the_next_one_starts(store):
    with emllm.open(store) as mem:
        want = mem.answer(QUESTION, 6, reread=False).text
        first, second = mem.answer(QUESTION, 6, reread=False), mem.answer(QUESTION, 6, reread=False)
        with pytest.raises(emllm.UsageError, match="later answer"):
            list(first)
        assert second.text == want
        # half read, then another answer: the first cannot go on from a state the second changed
        third = mem.answer(QUESTION, 6, reread=False)
        pieces = iter(third)
        next(pieces)
        assert mem.answer(QUESTION, 6, reread=False).text == want
        with pytest.raises(emllm.UsageError, match="later answer"):
            list(pieces)
        # an answer read whole keeps its text, but cannot be remembered once another has started
        done = mem.answer(QUESTION, 6, reread=False)
        assert done.text == want
        mem.answer(QUESTION, 6, reread=False).text
        assert done.text == want
        with pytest.raises(emllm.UsageError, match="remember an answer before asking the next"):
            done.exchange_ids()


def test_a_reader_sees_what_a_writer_committed_since_its_last_answer(store):
    with emllm.open(store) as reader:
        reader.answer(QUESTION, 6, reread=False).text
        tokens = reader.info.rows.tokens
        with emllm.open(store, writable=True) as writer:
            writer.ingest(("more", "The pass key is 55123. " + words(12, 200)))
        after = reader.answer(QUESTION, 6, reread=False).text
        assert reader.info.rows.tokens > tokens  # (its store opened again: the old one holds the old rows)
        with emllm.open(store) as fresh:  # what a reader opened now answers
            assert after == fresh.answer(QUESTION, 6, reread=False).text
