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
from dataclasses import dataclass
from typing import Any, Callable

import torch

from emllm.app.stream import SEPARATOR, encode, encode_framing, pending_tokens
from emllm.app.textinput import TextSource, cut_rules, token_pieces
from emllm.engine.stream import Engine
from emllm.store import Store, StoreError

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


__all__ = ["add_documents", "run_job", "Progress"]
