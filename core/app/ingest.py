"""Ingesting documents into a store: the write path behind `emllm ingest`.

The stream of a store is: the chat template's opening of a user turn (when the model has one),
then the documents joined by a blank line. It is processed in whole chunks only; the last partial
chunk stays pending (in the job file) until more text arrives (`--append`) or a question completes it
(`ask`, on a copy). So ingesting A then appending B chunks the stream exactly as ingesting A and
B in one call, and the two stores are identical.

    store = create_store(path, source, model, tok)
    engine = open_engine(store, model)
    add_documents(store, tok, [("book.txt", text)])
    run_job(store, engine, progress=...)      # commits every few chunks; resumable after a crash
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from emllm.config import Profile, profile_from_dict
from emllm.engine.stream import Engine, check_supported
from emllm.models import config_hash
from emllm.app.textinput import TextSource, cut_rules, token_pieces
from emllm.store import Geometry, Identity, Store, StoreError, StoredEvents, tokenizer_hash, weights_hash, weights_sample

SEPARATOR = "\n\n"
_MARK = "\x00EMLLM\x00"


@dataclass(frozen=True)
class StreamFormat:
    """How documents and questions are laid out in the stream (recorded in the manifest)."""

    chat: bool
    prefix: str  # before the first document: the opening of a user turn
    suffix: str  # after the question: end of the user turn, start of the answer

    @classmethod
    def for_tokenizer(cls, tok: Any, chat: bool = True) -> "StreamFormat":
        if chat and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": _MARK}], add_generation_prompt=True, tokenize=False)
            if text.count(_MARK) == 1:
                prefix, suffix = text.split(_MARK)
                return cls(True, prefix, suffix)
        return cls(False, "", "\nAnswer:")


def identity_of(name: str, model: Any, tok: Any) -> Identity:
    return Identity(name, config_hash(model), weights_hash(model), tokenizer_hash(tok), weights_sample(model))


def geometry_of(model: Any) -> Geometry:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Geometry(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, head_dim, cfg.vocab_size, dtype)


def encode(tok: Any, text: str) -> list[int]:
    """Token ids of user text (a document, a question): special tokens written in it are read as
    the characters they are, so a document cannot forge the chat template's turns."""
    return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def encode_framing(tok: Any, text: str) -> list[int]:
    """Token ids of emllm's own framing (the chat template's prefix and suffix): special tokens count."""
    return tok(text, add_special_tokens=False)["input_ids"]


def create_store(path: Path, model_name: str, model: Any, tok: Any, profile: Profile, chat: bool = True) -> Store:
    check_supported(model)  # before its geometry is read: an unsupported config may lack the fields
    fmt = StreamFormat.for_tokenizer(tok, chat)
    return Store.create(
        path, identity_of(model_name, model, tok), _profile_dict(profile), geometry_of(model),
        extra={"stream": asdict(fmt)},
    )


def store_profile(store: Store) -> Profile:
    return profile_from_dict(store.manifest["profile"], store.manifest["profile"]["name"], " (in the store)")


def open_engine(store: Store, model: Any, kv_cache_mb: int | None = None) -> Engine:
    """An engine that continues the store's stream: its events are the store's, its state the
    last committed one. kv_cache_mb: RAM for recently read events (None: the profile's)."""
    if (mine := geometry_of(model)) != store.geometry:
        raise StoreError(f"{store.path}: the store's geometry ({_geometry_text(store.geometry)}) is not this "
                         f"model's ({_geometry_text(mine)}): the store is damaged, or of another model")
    engine = Engine(model, store_profile(store), memory=lambda i: StoredEvents(store, i, kv_cache_mb))
    state = store.load_state()
    if state:
        try:
            engine.load_state_dict(state, store.tokens.read(), store.surprise.read(), store.flags.read())
        except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as e:
            raise StoreError(f"{store.path}: its state does not fit the model ({e}): the store is damaged") from None
    if engine.n_tokens != store.tokens.rows or engine.n_events != store.events.rows:
        raise StoreError(f"{store.path}: the state does not match the arrays: the store is damaged; re-ingest")
    return engine


def _geometry_text(g: Geometry) -> str:
    return f"{g.layers} layers, {g.q_heads}/{g.kv_heads} heads of {g.head_dim}, vocabulary {g.vocab}, {g.dtype}"


def add_documents(store: Store, tok: Any, docs: list[tuple[str, str | TextSource]]) -> int:
    """Queue documents as a new job (after what is pending). Returns the job's token count.

    A document is a string or a `TextSource` (read and tokenized a piece at a time, its tokens
    written to the job file as they come: memory does not grow with the document). Nothing is
    committed until every document has been read: an error or an interrupt leaves the store as it was."""
    job = store.manifest.get("job")
    if job and not job["complete"]:
        raise StoreError(f"{store.path} has an unfinished ingest; finish it first (resume)")
    pending = pending_tokens(store)
    first = store.tokens.rows == 0 and not pending
    rules = cut_rules(tok)
    documents = []
    stream_pos = store.tokens.rows
    writer = store.begin_job()
    try:
        writer.append(torch.tensor(pending, dtype=torch.int32))
        for i, (name, src) in enumerate(docs):
            prefix = store.manifest["stream"]["prefix"]
            head = encode_framing(tok, prefix) if first and i == 0 and prefix else []
            sep = [] if (first and i == 0) else encode(tok, SEPARATOR)
            writer.append(torch.tensor(head + sep, dtype=torch.int32))
            start = writer.rows
            pieces = iter([src]) if isinstance(src, str) else src.pieces()
            for ids in token_pieces(lambda t: encode(tok, t), pieces, [] if isinstance(src, str) else rules):
                writer.append(torch.tensor(ids, dtype=torch.int32))
            if writer.rows == start:
                raise StoreError(f"{name}: no tokens in the text")
            sha, chars = (hashlib.sha256(src.encode()).hexdigest(), len(src)) if isinstance(src, str) else (src.sha256, src.chars)
            documents.append({"name": name, "sha256": sha, "start": stream_pos + start,
                              "tokens": writer.rows - start, "chars": chars})
        store.commit_job(writer, documents)
    except BaseException:
        store.abort_job(writer)
        raise
    return writer.rows


@dataclass
class Progress:
    done: int  # tokens of the job processed
    total: int
    events: int
    stream_tokens: int


def run_job(
    store: Store, engine: Engine, commit_every: int = 4, progress: Callable[[Progress], None] | None = None,
) -> None:
    """Process the current job's whole chunks, committing every `commit_every` chunks and at the end.

    Resumable: the job's tokens and how far it got are in the store, and commits fall on chunk
    borders of the job, so a resumed run chunks (and computes) exactly as an uninterrupted one.
    """
    job = store.manifest["job"]
    if job is None or job["complete"]:
        store.commit_sketch()  # a store written before sketches existed gets one here (--resume)
        return
    cs = engine.profile.chunk_size
    done, n = job["done"], job["tokens"]
    since = 0
    while n - done >= cs:
        engine.step(store.job.read_copy(done, done + cs).long())  # a chunk at a time: RAM flat in the job's size
        done += cs
        since += 1
        if since >= commit_every:
            _commit(store, engine, done, complete=False)
            since = 0
        if progress is not None:
            progress(Progress(done, n, engine.n_events, engine.n_tokens))
    _commit(store, engine, done, complete=True)
    if progress is not None:
        progress(Progress(n, n, engine.n_events, engine.n_tokens))


def pending_tokens(store: Store) -> list[int]:
    """Tokens received but not processed yet (less than a chunk once a job is complete)."""
    job = store.manifest.get("job")
    return store.job.read(job["done"], job["tokens"]).tolist() if job and store.job is not None else []


def _commit(store: Store, engine: Engine, done: int, complete: bool) -> None:
    """Write the token arrays and event sizes appended since the last commit, then commit."""
    t0 = store.tokens.rows
    store.tokens.append(engine.ids.view()[t0:].to(torch.int32))
    store.surprise.append(engine.surprise.view()[t0:])
    store.flags.append(engine.flags.view()[t0:].to(torch.uint8))
    e0 = store.events.rows
    store.events.append(engine.windows[0].events.event_lengths()[e0:].to(torch.int32))
    store.manifest["job"] = {**store.manifest["job"], "done": done, "complete": complete}
    store.commit(engine.state_dict(), {"tokens": engine.n_tokens, "events": engine.n_events})


def _profile_dict(p: Profile) -> dict:
    d = asdict(p)
    d["aliases"] = list(d["aliases"])
    return d


__all__ = [
    "StreamFormat", "create_store", "open_engine", "add_documents", "run_job", "pending_tokens",
    "identity_of", "geometry_of", "store_profile", "encode", "Progress",
]
