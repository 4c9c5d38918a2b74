"""A conversation with a store: each exchange is answered from the store's memory and, when
remembered, appended to its stream (the question's turn, the answer, the template's framing) and
committed, so later questions, in this conversation or one days later, recall it however far
back it lies. Without remembering, the store is never changed.

    with Conversation(path, model, tok) as talk:
        for piece in talk.say("my name is Ada"): print(piece, end="")
        talk.say_all("what is my name?")
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

from emllm.app.ask import Session
from emllm.app.ingest import add_tokens, run_job
from emllm.app.report import retrieval_doc
from emllm.app.trace import Trace
from emllm.app.stream import encode, encode_framing, open_engine, reopen_text
from emllm.engine.sampling import Sampling
from emllm.errors import UsageError
from emllm.store import Store, StoreError, cut_back, save_mark


class Conversation:
    """Exchanges with the store at `path` (its model already loaded and checked by the caller)."""

    def __init__(self, path: Path, model: Any, tok: Any, remember: bool = True, kv_cache_mb: int | None = None,
                 commit_every: int = 4, reread: bool = False,
                 unlocked: Callable[[], ContextManager[None]] = contextlib.nullcontext) -> None:
        """unlocked: a context in which the store's writer lock is free for this conversation's writes
        (a writable `Memory`'s, which holds it otherwise)."""
        self.path, self.model, self.tok = Path(path), model, tok
        self._unlocked = unlocked
        self.remember, self.kv_cache_mb, self.commit_every = remember, kv_cache_mb, commit_every
        self.reread = reread  # answer as `ask --reread` does (`app.reread`); may change between exchanges
        self.last_passages: list[tuple[int, int]] = []  # with reread: the stream spans the last answer read again
        self.exchanges = 0  # remembered in this conversation
        self.last_retrieval: dict | None = None
        self._marks: list[Path] = []  # one per remembered exchange: what `undo` cuts back to
        self._tmp = Path(tempfile.mkdtemp(prefix="emllm-chat-"))

    def say(self, question: str, max_new_tokens: int = 256, sampling: Sampling | None = None,
            stop: list[str] | None = None, trace: bool = False) -> Iterator[str]:
        """The answer, a piece of text at a time; once it is complete, the exchange is remembered
        (committed) if this conversation remembers. A question interrupted (Ctrl-C) is forgotten.
        trace: record what each layer retrieved (`last_retrieval`, as `report.retrieval_doc`)."""
        with Store.open(self.path) as st:
            session = Session(st, self.model, self.tok, self.kv_cache_mb, reread=self.reread)
            q_ids = session.question_ids(question)
            lead = session.lead
            tr = Trace.attach(session.engine) if trace else None
            for piece in session.answer_text(question, max_new_tokens, sampling, stop):
                yield piece
            answer = session.answered
            self.last_passages = list(session.passages)
            if tr is not None:
                tr.detach()
                self.last_retrieval = retrieval_doc(tr, st, self.tok, question, window_start=session.engine.window_start)
        if self.remember:
            self._append(lead + q_ids + answer + encode_framing(self.tok, reopen_text(self.tok, st.info.stream.chat)))


    def say_all(self, question: str, **kw: Any) -> str:
        return "".join(self.say(question, **kw)).strip()

    def _append(self, ids: list[int]) -> None:
        mark = None
        with Store.open(self.path) as st:
            can_mark = not st.info.has_sketch
        with self._unlocked():
            if can_mark:  # for undo: what the store was before this exchange (a few MB)
                mark = self._tmp / f"mark-{len(self._marks)}"
                save_mark(self.path, mark)
            remember_exchange(self.path, self.model, self.tok, ids, self.kv_cache_mb, self.commit_every)
        self.exchanges += 1
        self._marks.append(mark)

    def undo(self) -> None:
        """Forget the last exchange this conversation remembered (the store is cut back to before it)."""
        if not self._marks:
            raise StoreError("nothing to undo in this conversation")
        mark = self._marks[-1]
        if mark is None:
            raise StoreError("this store keeps a sketch (it is large): its exchanges cannot be undone")
        with self._unlocked():
            cut_back(self.path, mark)  # the rows past it become an uncommitted tail, dropped by the next write
        self._marks.pop()
        shutil.rmtree(mark, ignore_errors=True)
        self.exchanges -= 1

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "Conversation":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def exchange_ids(session: Session, question: str) -> list[int]:
    """The tokens an answered exchange adds to the stream: what the store did not hold before the
    question (an empty store's opening), the question's turn, the answer, the template's
    reopening of a user turn. (A completion's: its prompt and what the model wrote, as they are.)"""
    if session.raw:
        return session.question_ids(question) + session.answered
    return (session.lead + session.question_ids(question) + session.answered
            + encode_framing(session.tok, reopen_text(session.tok, session.store.info.stream.chat)))


def remember_exchange(path: Path, model: Any, tok: Any, ids: list[int], kv_cache_mb: int | None = None,
                      commit_every: int = 4) -> None:
    """Append an exchange's tokens (`exchange_ids`) to the store at `path` and commit them."""
    with Store.open(path, writable=True) as st:
        engine = open_engine(st, model, kv_cache_mb)
        n = sum(d.kind == "exchange" for d in st.info.documents)  # (an undone exchange left the list)
        add_tokens(st, ids, {"name": f"exchange {n + 1}", "kind": "exchange"})
        run_job(st, engine, commit_every)


ROLES = ("system", "developer", "user", "assistant")


def _text(m: dict) -> str:
    content = m.get("content")
    if isinstance(content, list):  # OpenAI's content parts: text only (an image left out would change the question)
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            if kind != "text" or not isinstance(p.get("text"), str):
                raise UsageError(f"a message's content part of type {kind!r}: emllm reads text parts only")
        return "".join(p["text"] for p in content)
    return content or ""


def messages_ids(session: Session, messages: list[dict]) -> tuple[list[int], str]:
    """The token ids that continue the store's stream with OpenAI-style `messages` up to the last
    user message (which is returned as the question, laid out by the session as `ask` lays out a
    question). System messages are read as the start of the first user message; earlier user and
    assistant turns are laid out as a remembered conversation lays them out."""
    for m in messages:
        if m.get("role") not in ROLES:
            raise UsageError(f"a message of role {str(m.get('role'))[:40]!r}: emllm reads {', '.join(ROLES)} "
                             "messages (no tools)")
    if not messages or messages[-1].get("role") != "user":
        raise UsageError("the last message must be the user's")
    if not _text(messages[-1]).strip():
        raise UsageError("the last message, the question, is empty")
    tok = session.tok
    reopen = encode_framing(tok, reopen_text(tok, session.store.info.stream.chat))
    ids: list[int] = []
    system = "\n\n".join(_text(m) for m in messages if m.get("role") in ("system", "developer"))
    turns = [m for m in messages if m.get("role") in ("user", "assistant")]
    for i, m in enumerate(turns[:-1]):
        text = _text(m)
        if m["role"] == "user":
            if i == 0 and system:
                text = system + "\n\n" + text
            ids += session.question_ids(text)
            session.turn_start = False  # what follows continues the stream the first turn began
        else:
            ids += encode(tok, text.strip()) + reopen
            session.turn_start = bool(reopen)  # the next user message opens a turn of its own
    question = _text(turns[-1])
    if len(turns) == 1 and system:
        question = system + "\n\n" + question
    return ids, question


__all__ = ["Conversation", "exchange_ids", "remember_exchange", "messages_ids"]
