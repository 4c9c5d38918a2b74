"""Conversations: remembered exchanges are appended to the store's stream and committed; not
remembered, the store is unchanged; undo cuts the last one away; a conversation can start from an
empty store; `ask --remember` remembers one exchange."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from emllm.app.conversation import Conversation
from emllm.app.stream import encode, encode_framing
from emllm.store import Store

from .helpers import EMLLM, cli_env, ingest_store, load_tiny, run_in_process, store_files, words


def _stream(path) -> list[int]:
    with Store.open(path) as st:
        job = st.manifest["job"]
        return st.tokens.read().tolist() + st.job.read(job["done"], job["tokens"]).tolist()


def test_a_remembered_exchange_is_in_the_stream_and_undo_takes_it_back(tiny, tmp_path):
    folder, prof, _, _ = tiny
    ingest_store(tmp_path / "s", folder, prof, [("doc", words(5, 200))])
    model, tok = load_tiny(folder)
    before, files = _stream(tmp_path / "s"), store_files(tmp_path / "s")
    with Conversation(tmp_path / "s", model, tok, remember=False) as talk:
        talk.say_all("my name is Ada", max_new_tokens=6)
    assert store_files(tmp_path / "s") == files  # not remembered: not a byte changed
    with Conversation(tmp_path / "s", model, tok) as talk:
        a1 = talk.say_all("my name is Ada", max_new_tokens=6)
        after1 = _stream(tmp_path / "s")
        q = encode(tok, "\n\nmy name is Ada")
        assert after1[: len(before)] == before and len(after1) > len(before) + len(q)
        added = after1[len(before):]
        assert added[: len(q)] == q  # the question's turn first, then its closing, the answer, the reopening
        with Store.open(tmp_path / "s") as st:
            suffix = encode_framing(tok, st.manifest["stream"]["suffix"])
            assert st.manifest["documents"][-1]["kind"] == "exchange"
        assert added[len(q): len(q) + len(suffix)] == suffix
        assert tok.decode(added[len(q) + len(suffix):], skip_special_tokens=True).startswith(a1)
        talk.say_all("what is my name?", max_new_tokens=6)
        assert len(_stream(tmp_path / "s")) > len(after1)
        talk.undo()
        assert _stream(tmp_path / "s") == after1
        talk.undo()
        assert _stream(tmp_path / "s") == before


def test_a_reread_exchange_answers_as_ask_reread_and_is_remembered(tiny, tmp_path):
    """In a conversation with reread on, an answer is `ask --reread`'s on the store as it was (the
    passages it read again are kept), and the exchange is appended as any other; turned off, the
    next answer is emllm's own again."""
    from emllm.app.ask import Session
    folder, prof, _, _ = tiny
    ingest_store(tmp_path / "s", folder, prof, [("doc", words(5, 300)), ("key", "The pass key is 71432. " + words(6, 300))])
    model, tok = load_tiny(folder)
    q = "what is the pass key?"
    with Store.open(tmp_path / "s") as st:
        want = "".join(Session(st, model, tok, reread=True).answer_text(q, 6)).strip()
        own = "".join(Session(st, model, tok).answer_text(q, 6)).strip()
    before = _stream(tmp_path / "s")
    with Conversation(tmp_path / "s", model, tok, reread=True) as talk:
        assert talk.say_all(q, max_new_tokens=6) == want
        assert talk.last_passages and all(0 <= a < b <= len(before) for a, b in talk.last_passages)
        after = _stream(tmp_path / "s")
        assert after[: len(before)] == before and q in tok.decode(after[len(before):])
        talk.undo()
        talk.reread = False
        assert talk.say_all(q, max_new_tokens=6) == own and talk.last_passages == []


@pytest.mark.slow
def test_chat_from_an_empty_store_and_ask_remember(tiny, tmp_path):
    folder, prof, _, _ = tiny
    env = {**os.environ, **cli_env(tmp_path)}
    r = subprocess.run([EMLLM, "chat", "--store", "talk", "-m", str(folder), "--profile", str(prof), "-n", "4"],
                       input="/help\nhello there\n/undo\n/reread\nmy name is Ada\n/reread\n/retrieval\n/nope\n/quit\n", capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "new store" in r.stderr and "the last exchange is forgotten" in r.stderr and "unknown command /nope" in r.stderr
    assert "retrieval for 'my name is Ada'" in r.stderr
    assert "\n  /undo        forget the last exchange" in r.stderr and "\\n" not in r.stderr  # (the help's lines as lines)
    assert r.stderr.index("re-read answers on") < r.stderr.index("re-read answers off")
    model, tok = load_tiny(folder)
    stream = _stream(tmp_path / "stores" / "talk")
    text = tok.decode(stream)
    assert text.startswith("<|im_start|>") and "my name is Ada" in text and "hello there" not in text  # undone
    n = len(stream)
    r = run_in_process("ask", "and now?", "--store", "talk", "-n", "3", "--remember", home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(_stream(tmp_path / "stores" / "talk")) > n and "and now?" in tok.decode(_stream(tmp_path / "stores" / "talk"))
    with Store.open(tmp_path / "stores" / "talk") as st:  # counted, the undone one left out
        assert [d["name"] for d in st.manifest["documents"]] == ["exchange 1", "exchange 2"]
    n = len(_stream(tmp_path / "stores" / "talk"))
    r = run_in_process("ask", "again?", "--store", "talk", "-n", "3", "--json", home=tmp_path)  # without --remember: unchanged
    assert json.loads(r.stdout)["tokens"] <= 3 and len(_stream(tmp_path / "stores" / "talk")) == n


def test_a_message_after_an_answer_opens_its_turn_as_the_chat_template_does(tiny, tmp_path):
    """After a remembered answer the stream ends with the template's reopening of a user turn: the
    next message (a conversation's, `ask`'s, a document's) is that turn's text, as
    `apply_chat_template` lays it out, with no separator; after a document a question is still set
    apart from it (the first test)."""
    from emllm.app.ingest import add_documents
    from emllm.app.stream import create_store, opens_a_turn, pending_tokens, reopen_text
    folder, prof, _, _ = tiny
    model, tok = load_tiny(folder)
    from emllm.config import load_profile_file
    profile = load_profile_file(prof)
    path = tmp_path / "talk"
    with create_store(path, "tiny", model, tok, profile) as st:
        st.publish_empty()
    with Conversation(path, model, tok) as talk:
        a1 = talk.say_all("hello there", max_new_tokens=4)
        talk.say_all("my name is Ada", max_new_tokens=4)
    text = tok.decode(_stream(path))
    reopen = reopen_text(tok, True)
    turns = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": a1},
             {"role": "user", "content": "my name is Ada"}]
    want = tok.apply_chat_template(turns, tokenize=False)
    assert reopen + "my name is Ada" in text and reopen + "my name is Ada" in want
    assert reopen + "\n\nmy name is Ada" not in text  # (as an earlier emllm laid every message out)
    with Store.open(path) as st:
        assert opens_a_turn(st, tok, pending_tokens(st))
    with Store.open(path, writable=True) as st:
        add_documents(st, tok, [("notes", "The pass key is 71432.")])
    text = tok.decode(_stream(path))
    assert text.endswith(reopen + "The pass key is 71432.")
    with Store.open(path) as st:
        assert not opens_a_turn(st, tok, pending_tokens(st))


def test_ctrl_c_at_the_terminals_prompt_drops_the_line_and_the_chat_goes_on(tiny, tmp_path):
    """At a terminal, Ctrl-C at the prompt drops the line typed (as a shell or ollama does; it ended
    the chat: "emllm: interrupted", exit 130); Ctrl-D or /quit leave."""
    import pty
    import select
    import signal
    import time

    folder, prof, _, _ = tiny
    leader, follower = pty.openpty()
    proc = subprocess.Popen([EMLLM, "chat", "--store", "talk", "-m", str(folder), "--profile", str(prof), "-n", "2"],
                            stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **cli_env(tmp_path)},
                            # (a shell's background job, as CI may run the suite, ignores SIGINT, and its children with it)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(follower)
    err = ""
    try:
        os.write(leader, b"/help\n")
        deadline = time.monotonic() + 300
        while "/quit        leave" not in err and time.monotonic() < deadline:  # (then at its prompt)
            if select.select([proc.stderr], [], [], 1)[0]:
                err += os.read(proc.stderr.fileno(), 4096).decode()
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)  # (a terminal's Ctrl-C; the line it drops stays the terminal's to drop)
        time.sleep(0.5)
        os.write(leader, b"/quit\n")
        out, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    err += rest
    assert proc.returncode == 0, err
    assert "Ctrl-D or /quit leaves" in err and "interrupted" not in err
