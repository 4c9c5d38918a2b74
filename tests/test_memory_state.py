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


def test_a_writer_answers_between_ingests_as_a_reader_would(store):
    # A writable memory's questions ran a writer's engine: every token a question read went into
    # the store's files, the next ingest's commit was refused ("keys and values written for a
    # stream of ...") and the store no longer opened.
    more = ("more", "The pass key is 55123. " + words(12, 200))
    with emllm.open(store) as reader:
        want_before = reader.answer(QUESTION, 6, reread=False).text
    with emllm.open(store, writable=True) as mem:
        assert mem.answer(QUESTION, 6, reread=False).text == want_before
        mem.retrieval(QUESTION)
        mem.ingest(more)
        after = mem.answer(QUESTION, 6, reread=False).text
        tokens = mem.info.rows.tokens
    assert emllm.verify_store(store)["problems"] == []
    with emllm.open(store) as reader:
        assert reader.info.rows.tokens == tokens
        assert reader.answer(QUESTION, 6, reread=False).text == after


def test_a_store_with_nothing_read_yet_is_not_asked(tiny, tmp_path):
    folder, prof, _, _ = tiny
    with emllm.create(tmp_path / "new", str(folder), profile=str(prof)) as mem:
        with pytest.raises(emllm.UsageError, match="holds nothing yet: ingest into it first"):
            mem.ask(QUESTION, max_new_tokens=4)
        mem.ingest(("doc", words(11, 300)))  # the store is as it was: the ingest commits
        mem.ask(QUESTION, max_new_tokens=4, reread=False)  # (the tiny model may answer nothing)
        assert mem.info.rows.tokens > 0
    assert emllm.verify_store(tmp_path / "new")["problems"] == []


def test_an_ingest_stopped_part_way_resumes_in_the_same_memory(tiny, tmp_path):
    # The stopped job's rows past its last commit stayed counted by the memory's store: resuming
    # through it was refused ("keys and values written for a stream of ..."). It now continues
    # from the commit, as a new process would, to the store an uninterrupted ingest writes.
    folder, prof, _, _ = tiny
    doc = ("doc", words(11, 1200))
    with emllm.create(tmp_path / "whole", str(folder), profile=str(prof)) as mem:
        mem.ingest(doc, commit_every=2)
        want = mem.ask(QUESTION, max_new_tokens=6, reread=False)
    calls = []

    def stop(p) -> None:
        calls.append(p)
        if len(calls) == 3:  # after the first commit (every 2 chunks), a chunk past it
            raise KeyboardInterrupt

    with emllm.create(tmp_path / "stopped", str(folder), profile=str(prof)) as mem:
        with pytest.raises(KeyboardInterrupt):
            mem.ingest(doc, commit_every=2, progress=stop)
        assert 0 < mem.job.done < mem.job.tokens
        mem.resume(commit_every=2)
        assert mem.job.complete and mem.ask(QUESTION, max_new_tokens=6, reread=False) == want
    for name in ("tokens.i32", "events.i32", "layers/00.k", "layers/01.v", "layers/01.r"):
        assert (tmp_path / "stopped" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert emllm.verify_store(tmp_path / "stopped")["problems"] == []


def test_a_closed_memory_says_so(store):
    mem = emllm.open(store, writable=True)
    mem.close()
    for use in (lambda: mem.ask(QUESTION, max_new_tokens=4), lambda: mem.ingest(("more", "text")),
                lambda: mem.summary(), lambda: mem.retrieval(QUESTION)):
        with pytest.raises(emllm.UsageError, match="this memory is closed"):  # (was OSError: bad file descriptor)
            use()
    mem.close()  # twice: nothing to do


def test_a_writable_memory_holds_a_conversation(store):
    # Its conversation's writes wanted the lock the memory itself held: "being written by another
    # emllm process".
    with emllm.open(store, writable=True) as mem:
        n = len(mem.info.documents)
        with mem.conversation() as talk:
            talk.say_all(QUESTION, max_new_tokens=4)
            talk.say_all("and then?", max_new_tokens=4)
            assert [d.name for d in mem.info.documents[n:]] == ["exchange 1", "exchange 2"]
            talk.undo()
        assert [d.name for d in mem.info.documents[n:]] == ["exchange 1"]
        mem.ingest(("more", words(12, 100)))  # the memory writes again after the conversation's writes
        assert [d.name for d in mem.info.documents[n:]] == ["exchange 1", "more"]
    assert emllm.verify_store(store)["problems"] == []

