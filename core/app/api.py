"""The library's front door: a store with its model, to ingest into, ask, talk with and inspect.
The CLI and the server call only this (through `emllm`'s names), so every default is decided here.

    import emllm
    with emllm.create("book-memory") as mem:                     # a new store, the default model
        mem.ingest(("book.txt", text))
    with emllm.open("book-memory") as mem:                       # its model loaded and checked
        print(mem.ask("who hid the key?"))
        for piece in mem.answer("and why?"): print(piece, end="")  # streamed
        mem.retrieval("who hid the key?")["top_events"]           # what the layers retrieved

    model = emllm.load("qwen2.5-coder-0.5b")                     # loaded once, for several stores
    with emllm.open("a", model=model) as a, emllm.open("b", model=model) as b: ...

Paths are folders; `emllm.store_path(name)` is where the CLI keeps a named store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from emllm import models
from emllm.app import ingest as ing
from emllm.app.ask import Session
from emllm.app.conversation import Conversation, exchange_ids, messages_ids, remember_exchange
from emllm.app.report import retrieval_doc, retrieval_report, store_summary
from emllm.app.stream import create_store, identity_of, open_engine, open_store, pending_tokens, store_profile
from emllm.app.textinput import TextSource, file_sha256
from emllm.app.trace import Trace
from emllm.config import Profile, ProfileMismatchError
from emllm.engine.sampling import Sampling, TokenLogprob
from emllm.errors import UsageError
from emllm.home import stores_dir
from emllm.store import Identity, Store, StoreError, is_store, read_info
from emllm.store.files import folder_written
from emllm.store.manifest import MANIFEST, Job, Manifest

# The re-read's defaults, decided here only (docs/benchmarks.md measures both readings): a question
# about a document is answered better from the passages read again; a conversation's recent turns
# lie in emllm's own window, which answers at once, without a second forward over the span.
REREAD_QUESTIONS = True
REREAD_CONVERSATION = False


@dataclass
class Model:
    """A model loaded once (`load`), to create stores with or to open several with."""

    name: str  # as a store records it: an alias, a hub id, or a local folder's absolute path
    model: Any
    tokenizer: Any
    profile: Profile
    given: str = ""  # as the user named it (an alias, a folder as typed): for messages and reports
    _identity: Identity | None = None

    @property
    def dtype(self) -> str:
        """The dtype it computes in, as a store records it ("bfloat16", "float32")."""
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def identity(self) -> Identity:
        """Its config, weights and tokenizer hashes (computed once: the weights take a moment)."""
        if self._identity is None:
            self._identity = identity_of(self.name, self.model, self.tokenizer)
        return self._identity


def load(model: str | None = None, profile: str | None = None, dtype: str | None = None,
         log: Callable[[str], None] | None = None) -> Model:
    """A model by alias, local folder or cached hub id (None: `emllm.models.default_model()`), with
    its profile (or `profile`: a built-in name or a YAML file), computing in `dtype` (auto, float32,
    bfloat16; None: the profile's)."""
    src = models.resolve(model, profile, log=log)
    mdl, tok = models.load(src, dtype=dtype)
    given = Path(src.name).expanduser()  # (a folder or a GGUF file: the store records the path given, absolute)
    name = str(given.resolve()) if given.exists() else src.name
    return Model(name, mdl, tok, src.profile, src.name)


def sampling(model: Model | Any, **given: Any) -> Sampling:
    """The sampling of an answer: greedy, or temperature=, top_p=, top_k=, repetition_penalty=,
    seed= (unset: the model's generation config), presence_penalty=, frequency_penalty=,
    logit_bias={token id: bias} (OpenAI's, also greedy). Values out of bounds: UsageError."""
    try:
        return Sampling.from_model(model.model if isinstance(model, Model) else model, **given)
    except ValueError as e:
        raise UsageError(str(e)) from None


TOP_LOGPROBS = 20  # the most alternatives a token's log probability comes with (OpenAI's bound)


def _check_top_logprobs(n: int | None) -> None:
    if n is not None and not (isinstance(n, int) and 0 <= n <= TOP_LOGPROBS):
        raise UsageError(f"top_logprobs must be an integer from 0 to {TOP_LOGPROBS}, got {n!r}")


class Answer:
    """An answer (or a completion: `Memory.complete`) as it is generated: iterate for its text, a
    piece at a time (or read `.text`, which generates it all). Afterwards: `.tokens` generated,
    `.finish_reason` ("stop" or "length"), `.passages` (with the re-read: the stream spans read
    again), `.retrieval` (with trace: what each layer retrieved, as `Memory.retrieval` reports it)."""

    def __init__(self, session: Session, question: str | list[int], max_new_tokens: int, opts: Sampling | None,
                 stop: list[str] | None, trace: bool, history: list[int] | None = None,
                 current: Callable[[], bool] | None = None, top_logprobs: int | None = None,
                 echo: bool = False) -> None:
        self.question, self.max_new_tokens = question, max_new_tokens
        self._top_logprobs = top_logprobs
        self._logprobs: list[TokenLogprob] | None = None
        self._echo = echo
        self._prompt_logprobs: list[TokenLogprob] | None = None
        self._raw = session.raw
        self._cancelled = False
        self._session, self._opts, self._stop = session, opts, stop
        self._current = current  # False once a later answer of the same memory took its session
        self._trace = Trace.attach(session.engine) if trace else None
        self._history = history or []  # a request's earlier turns, read before the question
        self._parts: list[str] | None = None
        self.retrieval: dict | None = None
        self.tokens = 0
        # the last commit of a store whose ingest is unfinished: (tokens read, tokens of the job)
        self.unfinished: tuple[int, int] | None = session.unfinished
        # ... and whether another process is writing it now (else the ingest was interrupted)
        self.being_written = session.unfinished is not None and folder_written(session.store.path)

    def __iter__(self) -> Iterator[str]:
        if self._parts is not None:
            yield from self._parts
            return
        if self._current is not None and not self._current():
            raise UsageError("a later answer of this memory started before this one was read: read each answer "
                             "before asking the next")
        parts: list[str] = []
        s = self._session
        s.top_logprobs = self._top_logprobs
        s.cancelled = lambda: self._cancelled
        s.echo = (self._top_logprobs or 0) if self._echo else None
        if self._top_logprobs is not None:
            self._logprobs = s.logprobs  # (filled as the tokens are chosen: `logprobs` reads it live)
        for piece in s.answer_text(self.question, self.max_new_tokens, self._opts, self._stop):
            parts.append(piece)
            yield piece
            if self._current is not None and not self._current():  # another answer took the session meanwhile
                raise UsageError("a later answer of this memory started before this one was read: read each "
                                 "answer before asking the next")
        self.tokens = s.tokens
        if self._echo:
            self._prompt_logprobs = list(s.prompt_logprobs)
        if self._logprobs is not None:
            self._logprobs = list(s.logprobs)  # (its own: the session's list serves the next answer)
        if self._trace is not None:
            self._trace.detach()
            self.retrieval = retrieval_doc(self._trace, s.store, s.tok, self.question, window_start=s.engine.window_start)
        self._parts = parts

    def cancel(self) -> None:
        """Stop this answer where it is, from any thread: reading its prompt at the next chunk,
        generating at the next token; iterating it then raises `emllm.Cancelled`."""
        self._cancelled = True

    @property
    def text(self) -> str:
        """The whole text (an answer's stripped of the spaces around it; a completion's as generated)."""
        text = "".join(self)
        return text if self._raw else text.strip()

    @property
    def prompt_logprobs(self) -> list[TokenLogprob] | None:
        """With echo (a completion's): each prompt token's log probability (its `logprob` None for
        a first token nothing predicts: an empty store's), with `top_logprobs` alternatives, once
        the prompt is read; None where not asked."""
        if not self._echo:
            return None
        if self._prompt_logprobs is None and self._parts is None and self._session.echo is not None:
            return list(self._session.prompt_logprobs)  # (while it is read: the prompt is read before the first piece)
        return self._prompt_logprobs

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """With `top_logprobs` asked (0 or more): each answer token's log probability under the
        model and its likeliest alternatives: those of the answer's text (not of tokens past a stop
        string), as far as it has been given out. None where not asked."""
        if self._logprobs is not None and self._parts is None:  # (while it is read: the tokens of the text given so far)
            return self._logprobs[: self._session.shown_tokens]
        return self._logprobs

    @property
    def finish_reason(self) -> str:
        return "length" if self.tokens >= self.max_new_tokens else "stop"

    @property
    def reread(self) -> bool:
        """Whether it was answered by re-reading the passages the memory chose."""
        return self._session.reread

    @property
    def passages(self) -> list[tuple[int, int]]:
        return list(self._session.passages)

    @property
    def prompt_tokens(self) -> int:
        """Tokens the request's turns and the question (or the completion's prompt) added to the stream."""
        return len(self.prompt_ids)

    @property
    def prompt_ids(self) -> list[int]:
        """Those tokens' ids."""
        return self._history + self._session.question_ids(self.question)

    def exchange_ids(self) -> list[int]:
        """The tokens remembering this exchange adds to the stream (its turns, the answer, framing)."""
        if self._parts is None:
            raise UsageError("the answer is not complete: read it before remembering it")
        if self._current is not None and not self._current():
            raise UsageError("a later answer of this memory started: remember an answer before asking the next")
        s = self._session
        ids = exchange_ids(s, self.question)
        return s.lead + self._history + ids[len(s.lead):]


@dataclass
class IngestPlan:
    """What `emllm ingest` does with a store (`plan_ingest`): "create", "append" or "resume", and
    the notes to show the user (an interrupted ingest continued, an empty store made anew)."""

    mode: str
    notes: list[str]


def plan_ingest(path: Path, documents: list[str], append: bool = False, resume: bool = False,
                name: str | None = None, chat: bool = True, kv_format: str | None = None) -> IngestPlan:
    """The rules of an ingest of the files `documents` ("-": stdin) into the store at `path`: a
    new store is created; an existing one is appended to or resumed only when asked,
    except that the texts of its interrupted ingest, given again, continue it; an empty store
    left by an interrupted create is made anew. Refusals are StoreError or UsageError, with the
    command that would work. `name`: the store as the user named it (in messages)."""
    path = Path(path)
    name = name or str(path)
    if resume and documents:
        raise UsageError("resume continues the interrupted job: give no documents")
    if resume and append:
        raise UsageError("resume or append, not both")
    if not is_store(path):
        if append or resume:
            raise StoreError(f"no store at {path} to {'append to' if append else 'resume'}; create it with "
                             f"`emllm ingest FILE --store {name}`")
        return IngestPlan("create", [])
    m = read_info(path)
    job = m.job
    unfinished = not m.complete
    notes: list[str] = []
    mode = "append" if append else "resume" if resume else "create"
    if documents and unfinished and ing.continues_job(m, [file_sha256(d) for d in documents]):
        notes.append(f"continuing the interrupted ingest of these documents ({job.done} of {job.tokens} tokens read)")
        mode = "resume"
    elif append and unfinished:
        raise StoreError(f"store {name!r} has an unfinished ingest ({job.done} of {job.tokens} tokens "
                         f"read): finish it first with `emllm ingest --resume --store {name}`")
    elif mode == "create":
        if not m.empty:
            where = f"{name!r}" + (f" ({path})" if str(path) != name else "")
            raise StoreError(f"store {where} already exists: add with --append, or choose another --store")
        notes.append(f"{path} held an empty store (an interrupted create): it is made anew")
        Store.remove_empty(path)
        return IngestPlan("create", notes)
    elif resume and not unfinished and m.empty:
        raise StoreError(f"store {name!r} holds nothing: the ingest that created it was interrupted before its "
                         f"text was saved; run it again: emllm ingest FILE --store {name}")
    if not chat and m.stream is not None and m.stream.chat:  # the layout is the store's, fixed when it was made
        raise UsageError("this store's stream is in the model's chat template (set when it was created): omit "
                         "--raw, or ingest into a new store")
    held = m.kv_format
    if kv_format not in (None, "auto", held):
        raise StoreError(f"store {name!r} keeps keys and values in {held} (fixed when it was created): omit "
                         f"--format, or ingest into a new store")
    return IngestPlan(mode, notes)


def unchanged_files(path: Path, docs: list[tuple[str, TextSource]]) -> list[int]:
    """Indices of the folders' files among `docs` (`open_documents`: those that open with a
    naming line) that the store at `path` holds already under the same name with the same text:
    an append of a folder read before adds only its new and changed files."""
    held = {(d.name, d.sha256) for d in read_info(Path(path)).documents if d.header and d.sha256}
    return [i for i, (name, src) in enumerate(docs)
            if isinstance(src, TextSource) and src.header and (name, file_sha256(src.path)) in held]


@dataclass
class IngestReport:
    """What an ingest run did: `summary` is `emllm ingest --json`'s document (tokens, events, what
    this run read and left pending, seconds, bytes); `nothing_to_resume`: a resume of a job that
    had finished."""

    summary: dict
    nothing_to_resume: bool = False


class Memory:
    """A store opened with its model (`create`, `open`). Writable when made by `create` or opened
    with writable=True; questions never change the store, remembering an exchange does."""

    def __init__(self, store: Store, model: Model) -> None:
        self._store, self._model = store, model
        self._writable = store.writable
        self._opened = self._manifest_mtime()
        # a question's starting point, kept between questions: the session with the store's pending
        # tail read, and the engine's snapshot there (dropped when the store changes)
        self._ready: tuple[int, Session, dict, bool] | None = None
        self._epoch = 0  # questions begun: an answer reads only while its question is the last begun
        self._queued: tuple[Any, int] | None = None  # documents `add` queued: their engine, the stream's length before
        self._reader: tuple[int, Store] | None = None  # a writable memory's questions' store: (its commit, a reader)
        self._closed = False

    # -- what it is -------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self._store.path

    @property
    def store(self) -> Store:
        return self._store

    @property
    def model(self) -> Any:
        return self._model.model

    @property
    def tokenizer(self) -> Any:
        return self._model.tokenizer

    @property
    def loaded(self) -> Model:
        return self._model

    @property
    def info(self) -> Manifest:
        """What the store has committed, typed: rows, job, documents, profile, identity, geometry."""
        return self._store.info

    @property
    def job(self) -> Job | None:
        """The store's last ingest job: its tokens, how many are done, whether it is complete
        (None: nothing ingested)."""
        return self._store.info.job

    @property
    def chat(self) -> bool:
        """Whether the stream is laid out in the model's chat template."""
        return self._store.info.stream is not None and self._store.info.stream.chat

    def summary(self) -> dict:
        return store_summary(self._open_store())

    # -- ingesting --------------------------------------------------------------------------
    def ingest(self, *docs: str | tuple[str, str | TextSource], commit_every: int = 4,
               progress: Callable[[ing.Progress], None] | None = None, check_space: bool = False,
               kv_cache_mb: int | None = None) -> IngestReport:
        """Append documents (text, or (name, text or TextSource)) to the stream and read them:
        `add`, then `resume`. Committed every `commit_every` chunks: a crash keeps the last commit,
        and `resume` continues from it."""
        self.add(*docs, check_space=check_space, kv_cache_mb=kv_cache_mb)
        return self.resume(commit_every, progress)

    def add(self, *docs: str | tuple[str, str | TextSource], check_space: bool = False,
            kv_cache_mb: int | None = None) -> list[tuple[str, str]]:
        """Queue documents after the stream as its next job, unread (`resume` reads it). Nothing is
        kept of documents that fail to read, or are interrupted, before they are all saved.
        check_space: refuse (DiskSpaceError) a job whose store would not fit the disk. Returns
        (name, name held under) for each document whose text the store held already."""
        named = [d if isinstance(d, tuple) else (f"text-{i}", d) for i, d in enumerate(docs)]
        if not named:
            raise UsageError("no documents to ingest")
        st = self._writable_store()
        engine = open_engine(st, self.model, kv_cache_mb)  # a store that cannot continue fails before any write
        before = st.tokens.rows + len(pending_tokens(st))  # the stream's length before this job
        held = st.info.documents
        try:
            ing.add_documents(st, self.tokenizer, named, check_space=check_space)
        except BaseException:
            st.discard()  # a store never published is removed; one that was is left as it was
            raise
        self._queued = (engine, before)
        return ing.duplicates(held, named)

    def resume(self, commit_every: int = 4, progress: Callable[[ing.Progress], None] | None = None,
               kv_cache_mb: int | None = None) -> IngestReport:
        """Read the store's job: the documents `add` queued, or what an interrupted ingest left
        (which must fit the disk). Committed every `commit_every` chunks and at the end."""
        st = self._writable_store()
        queued, self._queued = self._queued, None
        if queued is not None:
            engine, before = queued
        else:
            engine = open_engine(st, self.model, kv_cache_mb)
            before = st.tokens.rows + len(pending_tokens(st))
            if not st.info.complete:
                ing.check_disk(st, st.info.pending)
        job = st.info.job
        done0, was_complete = (job.done, job.complete) if job is not None else (0, True)
        t0 = time.perf_counter()
        try:
            ing.run_job(st, engine, commit_every, progress)
        except BaseException:  # (Ctrl-C, a full disk): the next `resume` continues from the last commit
            self._ready = None
            self._store = st.reopened()
            raise
        self._ready = None
        summary = ing.run_summary(st, before, done0, was_complete, queued is not None, time.perf_counter() - t0)
        return IngestReport(summary, nothing_to_resume=queued is None and was_complete)

    def _open_store(self) -> Store:
        if self._closed:  # (its files' descriptors are closed: reading them failed with EBADF)
            raise UsageError(f"{self.path}: this memory is closed; open the store again")
        return self._store

    def _writable_store(self) -> Store:
        self._open_store()
        if not self._writable:
            raise UsageError(f"{self.path} is open for reading: open it with writable=True to ingest into it")
        return self._store

    # -- asking -----------------------------------------------------------------------------
    def answer(self, question: str, max_new_tokens: int = 256, stop: list[str] | None = None,
               reread: bool | None = None, trace: bool = False, sampling: Sampling | None = None,
               kv_cache_mb: int | None = None, top_logprobs: int | None = None, **sampling_options: Any) -> Answer:
        """The answer to `question`, streamed as it is iterated (on a copy of the memory's state:
        the store is unchanged). Greedy, or sampled (`sampling`, or temperature=, top_p=, top_k=,
        repetition_penalty=, seed=; unset: the model's generation config); it ends before any of
        the `stop` strings. reread (None: REREAD_QUESTIONS): answer by reading again the
        passages the memory chose (`emllm.app.reread`); False: emllm's own answer, the paper's.
        trace: record what each layer retrieved (`Answer.retrieval`). top_logprobs: record each
        token's log probability and this many alternatives (`Answer.logprobs`; 0: none)."""
        if not question.strip():
            raise UsageError("the question is empty")
        _check_top_logprobs(top_logprobs)
        opts = sampling if sampling is not None else self._sampling(sampling_options)
        current = None
        if trace or kv_cache_mb is not None:  # a session of its own: the trace sees the pending tail read too
            session = Session(self._questions_store(), self.model, self.tokenizer, kv_cache_mb)
        else:
            session, current = self._session()
        session.reread = REREAD_QUESTIONS if reread is None else reread
        return Answer(session, question, max_new_tokens, opts, stop, trace, current=current, top_logprobs=top_logprobs)

    def ask(self, question: str, max_new_tokens: int = 256, stop: list[str] | None = None,
            reread: bool | None = None, **sampling_options: Any) -> str:
        """The whole answer to `question` as text (see `answer`)."""
        return self.answer(question, max_new_tokens, stop, reread, **sampling_options).text

    def complete(self, prompt: str | list[int], max_new_tokens: int = 16, stop: list[str] | None = None,
                 sampling: Sampling | None = None, top_logprobs: int | None = None, echo: bool = False,
                 **sampling_options: Any) -> Answer:
        """A completion, as a base model gives one: `prompt` (text, whose special tokens count as
        written, or token ids) continues the store's stream as it stands, with no question's
        framing, and the model continues the prompt (emllm's own reading: each token attends to
        the events its layers retrieve). On a copy of the memory's state; `remember` appends the
        prompt and the completion. Sampling, stop and top_logprobs as `answer`'s; echo: record
        the prompt's tokens' log probabilities too (`Answer.prompt_logprobs`, with top_logprobs
        alternatives), as a model is scored on a text. max_new_tokens may be 0 (the prompt read,
        nothing generated)."""
        if isinstance(prompt, str):
            if not prompt:
                raise UsageError("the prompt is empty")
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            vocab = self._store.geometry.vocab
            if not all(0 <= t < vocab for t in prompt):
                raise UsageError(f"a prompt's token id is outside the model's vocabulary (0..{vocab - 1})")
        else:
            raise UsageError("the prompt must be text or a non-empty list of token ids")
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
            raise UsageError(f"max_new_tokens must be 0 or more, got {max_new_tokens!r}")
        _check_top_logprobs(top_logprobs)
        opts = sampling if sampling is not None else self._sampling(sampling_options)
        session, current = self._session()
        if session.lead:  # an empty store's session opens a chat turn first: a completion's does not
            session = Session(self._questions_store(), self.model, self.tokenizer, raw=True)
        session.raw, session.reread = True, False
        return Answer(session, prompt, max_new_tokens, opts, stop, False, current=current,
                      top_logprobs=top_logprobs, echo=echo)

    def reply(self, messages: list[dict], max_new_tokens: int = 256, stop: list[str] | None = None,
              reread: bool | None = None, sampling: Sampling | None = None, top_logprobs: int | None = None,
              **sampling_options: Any) -> Answer:
        """The answer to a conversation given whole, as OpenAI's chat messages ({"role": "system",
        "user" or "assistant", "content": text or text parts}): its turns continue the store's
        stream, the last (the user's) is the question. reread None: REREAD_CONVERSATION."""
        _check_top_logprobs(top_logprobs)
        opts = sampling if sampling is not None else self._sampling(sampling_options)
        session, current = self._session()
        history, question = messages_ids(session, messages)
        session.tail = history
        session.reread = REREAD_CONVERSATION if reread is None else reread
        return Answer(session, question, max_new_tokens, opts, stop, False, history, current, top_logprobs)

    def remember(self, answer: Answer, commit_every: int = 4) -> None:
        """Append an answered exchange (its turns, the answer, the chat template's framing) to the
        stream and commit it: later questions recall it. The store must not have another writer."""
        self._open_store()
        ids = answer.exchange_ids()
        with self._unlocked(always=True):
            remember_exchange(self.path, self.model, self.tokenizer, ids, commit_every=commit_every)

    @contextlib.contextmanager
    def _unlocked(self, always: bool = False) -> Iterator[None]:
        """This memory's store closed while another handle writes it: a writer's lock is free then
        (always: a reader's too, opened again to see the commit)."""
        if self._closed or not (self._writable or always):
            yield
            return
        self._ready = None
        self._store.close()
        try:
            yield
        finally:
            self._store = Store.open(self.path, writable=self._writable)
            self._opened = self._manifest_mtime()

    def conversation(self, remember: bool = True, reread: bool | None = None, commit_every: int = 4) -> Conversation:
        """Exchanges with this store, each remembered as it completes (or none, remember=False), with
        `undo` of the last. reread None: REREAD_CONVERSATION; the conversation's `reread` may change
        between exchanges. It opens the store for each exchange: it outlives this memory's `close`
        (which frees a writer's lock for others between exchanges, as `emllm chat` does)."""
        return Conversation(self.path, self.model, self.tokenizer, remember=remember, commit_every=commit_every,
                            reread=REREAD_CONVERSATION if reread is None else reread, unlocked=self._unlocked)

    def retrieval(self, query: str, layer: int | None = None, top: int = 8) -> dict:
        """What each layer retrieves for `query` read as a question (coverage per layer, the most
        retrieved events, one layer's steps): `report.retrieval_report`."""
        g = self._store.geometry
        if layer is not None and not 0 <= layer < g.layers:
            raise UsageError(f"layer {layer}: the model has {g.layers} layers (0..{g.layers - 1})")
        if layer is not None and layer not in g.with_memory:
            raise UsageError(f"layer {layer} attends within a sliding window and holds no memory (layers with "
                             f"memory: {', '.join(map(str, g.with_memory))})")
        return retrieval_report(self._questions_store(), self.model, self.tokenizer, query, layer, top)

    def _sampling(self, given: dict) -> Sampling:
        return sampling(self._model, **given)

    def _session(self) -> tuple[Session, Callable[[], bool]]:
        """A question's session, its pending tail read once and the engine restored to that point
        for each question (read again when a commit changed the store), and a test that it is
        still this question's (no later question has taken it)."""
        self._epoch += 1
        epoch = self._epoch
        current = lambda: self._epoch == epoch  # noqa: E731
        mtime = self._manifest_mtime()
        if self._ready is not None and self._ready[0] == mtime:
            _, session, snap, turn_start = self._ready
            session.engine.restore(snap)
            session.turn_start, session.tail, session.passages = turn_start, [], []
            session.raw, session.echo = False, None
            return session, current
        if mtime != self._opened and not self._writable:  # another process committed: see its commit
            self._reopen()
            mtime = self._opened
        session = Session(self._questions_store(), self.model, self.tokenizer)
        session.feed_pending()
        self._ready = (mtime, session, session.engine.snapshot(), session.turn_start)
        return session, current

    def _questions_store(self) -> Store:
        """The store as a question reads it: this memory's, or where that is a writer's, a reader's
        of its last commit. (A writer's engine writes every token it reads into the files: a
        question's tokens were taken for the stream's, and the next commit was refused.)"""
        store = self._open_store()
        if not self._writable:
            return store
        mtime = self._manifest_mtime()
        if mtime == -1:
            raise UsageError(f"{self.path} holds nothing yet: ingest into it first (a conversation from nothing: "
                             "create it with publish=True)")
        if self._reader is None or self._reader[0] != mtime:
            self._close_reader()
            self._reader = (mtime, Store.open(self.path))
        return self._reader[1]

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader[1].close()
            self._reader = None

    def _manifest_mtime(self) -> int:
        """When the store last committed (-1: not published yet)."""
        try:
            return (self.path / MANIFEST).stat().st_mtime_ns
        except FileNotFoundError:
            return -1

    def _reopen(self) -> None:
        self._ready = None
        path, writable = self.path, self._writable
        self._store.close()
        self._store = Store.open(path, writable=writable)
        self._opened = self._manifest_mtime()

    def close(self) -> None:
        self._ready = None
        self._close_reader()
        self._store.close()
        self._closed = True

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def segment(text: str, model: str | Model | None = None, methods: str | list[str] | tuple[str, ...] = ("S",),
            gamma: float | None = None, seed: int = 0, metrics: bool = False,
            progress: Callable[[int, int], None] | None = None) -> dict[str, dict]:
    """The event boundaries of `text` by each of `methods` (F, S, SM, SC, FM, FC, random: fixed
    blocks or surprise, refined by modularity or conductance; one method may be given as a string)
    as `model` (a `Model`, or what `load` takes) reads it, one document each (`document.events_doc`);
    gamma: the surprise threshold (None: the profile's). metrics: each document also scores its
    segmentation ("metrics") against a random one with as many events ("random_metrics"), and
    the difference ("difference_to_random"; a metric is None where the text is too short for it).
    progress(tokens read, tokens): as the model reads the text."""
    import torch

    from emllm.app import document
    from emllm.engine.stream import Engine

    methods = [methods] if isinstance(methods, str) else list(methods)
    unknown = [m for m in methods if m not in document.METHODS]
    if unknown or not methods:
        raise UsageError(f"{unknown[0] if unknown else ''!r}: choose one of {', '.join(document.METHODS)}")
    model = model if isinstance(model, Model) else load(model)
    tok = model.tokenizer
    if not getattr(tok, "is_fast", False):
        raise UsageError(f"the tokenizer of {model.name} has no fast (Rust) version: segment needs its character offsets")
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if not ids:
        raise UsageError("no tokens in the text")
    prof = model.profile.replace(segmentation="S", **({"gamma": gamma} if gamma is not None else {}))
    report = None if progress is None else (lambda r: progress(r.tokens_done, len(ids)))
    a = document.analyse(Engine(model.model, prof), torch.tensor(ids), progress=report)
    args = (prof.min_block, prof.max_block, prof.chunk_size)
    docs = {}
    for m in methods:
        starts = document.boundaries(a, m, *args, seed=seed)
        docs[m] = document.events_doc(model.given or model.name, m, prof, text, ids, offsets, starts, a)
        if metrics:  # against random segmentation with the same number of events
            rand = document.random_like(len(ids), starts.numel(), prof.min_block, seed)
            docs[m]["metrics"] = document.metrics(a, starts, prof.chunk_size)
            docs[m]["random_metrics"] = document.metrics(a, rand, prof.chunk_size)
            docs[m]["difference_to_random"] = document.difference(docs[m]["metrics"], docs[m]["random_metrics"])
    return docs


def create(path: str | Path, model: str | Model | None = None, profile: str | None = None, chat: bool = True,
           log: Callable[[str], None] | None = None, dtype: str | None = None, kv_format: str | None = None,
           publish: bool = False) -> Memory:
    """A new, empty store at `path` for `model` (a `Model`, or an alias, local folder or cached hub
    id; default: `emllm.models.default_model()`), computing in `dtype` (auto, float32, bfloat16;
    None: the profile's), keeping keys and values in `kv_format` (None: the compute dtype;
    bfloat16, int8, int4), laid out in the model's chat template unless chat=False. It appears
    at its first ingest, or at once with publish=True (a conversation that starts from nothing)."""
    if isinstance(model, Model):
        if profile is not None or dtype is not None:
            raise UsageError("a loaded model has its profile and dtype: give them to emllm.load")
        m = model
    else:
        m = load(model, profile, dtype, log)
    st = create_store(Path(path), m.name, m.model, m.tokenizer, m.profile, chat=chat, kv_format=kv_format)
    if publish:
        try:
            st.publish_empty()
        except BaseException:
            st.discard()
            raise
    return Memory(st, m)


def open(path: str | Path, writable: bool = False, model: str | Model | None = None,  # noqa: A001 - emllm.open
         log: Callable[[str], None] | None = None, profile: str | None = None, dtype: str | None = None) -> Memory:
    """The store at `path` with the model it was written with, loaded and checked against the
    store (config, weights, tokenizer), computing in the store's dtype. `model`: another name for
    the same weights (a moved folder), or a `Model` already loaded (checked, not reloaded);
    `profile` and `dtype`, if given, must be the store's."""
    path = Path(path)
    if not is_store(path) and not path.exists() and len(path.parts) == 1 and is_store(stores_dir() / path):
        # (the CLI's store names are the home's: a program's paths are its own)
        raise StoreError(f"no store at {path} here; the store {str(path)!r} under the emllm home is "
                         f"emllm.open(emllm.store_path({str(path)!r}))")
    if not isinstance(model, Model):
        o = open_store(path, writable=writable, model=model, profile=profile, log=log, dtype=dtype)
        name = o.store.info.model
        return Memory(o.store, Model(name, o.model, o.tok, store_profile(o.store), o.source.name))
    st = Store.open(path, writable=writable)
    try:
        st.check_identity(dataclasses.replace(model.identity(), model=st.info.model))
        if profile is not None and models.load_profile(profile, store_profile(st)) != store_profile(st):
            raise ProfileMismatchError(f"the store uses profile {st.info.profile.name!r}; a store keeps one profile")
    except BaseException:
        st.close()
        raise
    return Memory(st, model)


__all__ = ["Memory", "Model", "Answer", "segment", "IngestPlan", "IngestReport", "create", "open", "load", "sampling",
           "plan_ingest", "unchanged_files", "REREAD_QUESTIONS", "REREAD_CONVERSATION"]
