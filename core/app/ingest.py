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
from typing import Any, Callable, Sequence

import torch

from emllm.app.stream import SEPARATOR, encode, encode_framing, opens_a_turn, pending_tokens
from emllm.app.textinput import TextSource, cut_rules, token_pieces
from emllm.engine.stream import Engine
from emllm.store import Store, StoreError
from emllm.store.manifest import Document, Manifest

class DiskSpaceError(StoreError):
    """Not enough free disk for what an ingest would write."""


def bytes_per_token(store: Store) -> float:
    """Bytes a store grows by per token read: keys and values of every layer with memory, a share of a
    representative key (one per event; events are at least min_block tokens), the token arrays."""
    g, prof = store.geometry, store.info.profile
    fmt = store.kv_format
    kv = len(g.with_memory) * 2 * fmt.row_bytes(g.kv_heads, g.head_dim)
    reprs = len(g.with_memory) * fmt.reprs.row_bytes(store.repr_heads, g.head_dim) / max(1, prof.min_block)
    return kv + reprs + 4 + 4 + 1


def state_bytes(store: Store) -> int:
    """An upper bound of a state file (a commit writes the new one before it deletes the old)."""
    g, prof = store.geometry, store.info.profile
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[g.dtype]
    held = prof.n_init + prof.n_local + 2 * prof.max_block + prof.chunk_size
    return g.layers * held * (2 * g.kv_heads * g.head_dim * size + 2 * g.q_heads * 4) + g.vocab * 4 + (1 << 20)


def check_disk(store: Store, tokens: int) -> None:
    """Refuse (DiskSpaceError) an ingest of `tokens` more tokens whose store would not fit on the disk."""
    import shutil

    need = int(tokens * bytes_per_token(store)) + 2 * state_bytes(store)
    free = shutil.disk_usage(store.folder.path).free
    if need > free:
        raise DiskSpaceError(f"not enough free disk: this ingest needs ~{_size(need)} ({tokens:,} tokens × "
                             f"{bytes_per_token(store) / 1000:.1f} kB, and the stream's state), {_size(free)} are free "
                             f"under {store.path.parent}")


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def add_documents(store: Store, tok: Any, docs: list[tuple[str, str | TextSource]], check_space: bool = False) -> int:
    """Queue documents as a new job (after what is pending). Returns the job's token count.

    A document is a string or a `TextSource` (read and tokenized a piece at a time, its tokens
    written to the job file as they come: memory does not grow with the document). Nothing is
    committed until every document has been read: an error or an interrupt leaves the store as it was.
    check_space: refuse (DiskSpaceError, before the commit) a job whose store would not fit the disk."""
    if not store.info.complete:
        raise StoreError(f"{store.path} has an unfinished ingest; finish it first (resume)")
    pending = pending_tokens(store)
    first = store.tokens.rows == 0 and not pending
    turn = first or opens_a_turn(store, tok, pending)  # the first document opens a user turn's text
    rules = cut_rules(tok)
    documents = []
    stream_pos = store.tokens.rows
    writer = store.begin_job()
    try:
        writer.append(torch.tensor(pending, dtype=torch.int32))
        for i, (name, src) in enumerate(docs):
            prefix = store.info.stream.prefix
            head = encode_framing(tok, prefix) if first and i == 0 and prefix else []
            sep = [] if (turn and i == 0) else encode(tok, SEPARATOR)
            writer.append(torch.tensor(head + sep, dtype=torch.int32))
            start = writer.rows
            pieces = iter([src]) if isinstance(src, str) else src.pieces()
            for ids in token_pieces(lambda t: encode(tok, t), pieces, [] if isinstance(src, str) else rules):
                writer.append(torch.tensor(ids, dtype=torch.int32))
            if writer.rows == start:
                raise StoreError(f"{name}: no tokens in the text")
            sha, chars = (hashlib.sha256(src.encode()).hexdigest(), len(src)) if isinstance(src, str) else (src.sha256, src.chars)
            documents.append({"name": name, "sha256": sha, "start": stream_pos + start,
                              "tokens": writer.rows - start, "chars": chars,
                              **({"header": src.header} if isinstance(src, TextSource) and src.header else {})})
        if check_space:
            check_disk(store, writer.rows)
        store.commit_job(writer, documents)
    except BaseException:
        store.abort_job(writer)
        raise
    return writer.rows


def add_tokens(store: Store, ids: list[int], document: dict) -> int:
    """Queue token ids that emllm laid out itself (an exchange of a conversation: the question's
    turn, the answer, the template's framing) as a new job after what is pending; `document`
    describes them in the manifest ({"name", "kind"}). Returns the job's token count."""
    if not store.info.complete:
        raise StoreError(f"{store.path} has an unfinished ingest; finish it first (resume)")
    pending = pending_tokens(store)
    writer = store.begin_job()
    try:
        writer.append(torch.tensor(pending + list(ids), dtype=torch.int32))
        store.commit_job(writer, [{**document, "start": store.tokens.rows + len(pending), "tokens": len(ids)}])
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
    job = store.info.job
    if job is None or job.complete:
        store.commit_sketch()  # a store written before sketches existed gets one here (--resume)
        return
    cs = engine.profile.chunk_size
    done, n = job.done, job.tokens
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
    store.commit(engine.state_dict(), {"tokens": engine.n_tokens, "events": engine.n_events}, done, complete)


def duplicates(held: Sequence[Document], docs: list[tuple[str, str | TextSource]]) -> list[tuple[str, str]]:
    """(name, name it was held under) for each document whose text a store held already (`held`:
    its documents before; a TextSource's sha256 is known once it has been read)."""
    seen = {d.sha256: d.name for d in held if d.sha256 is not None}
    out = []
    for name, src in docs:
        sha = hashlib.sha256(src.encode()).hexdigest() if isinstance(src, str) else src.sha256
        if sha in seen:
            out.append((name, seen[sha]))
    return out


def continues_job(m: Manifest, sha256s: list[str | None]) -> bool:
    """Whether the store's unfinished job is these texts, in order (so running the interrupted
    command again continues it). None: a text whose hash is unknown (stdin)."""
    job = m.job
    k = job.documents if job is not None else None
    if job is None or job.complete or not k or k != len(sha256s):
        return False
    theirs = [d.sha256 for d in m.documents[-k:]]
    return all(s is not None and s == t for s, t in zip(sha256s, theirs))


def run_summary(store: Store, before: int, done0: int, was_complete: bool, added: bool, seconds: float) -> dict:
    """What an ingest run did, as data. before: the stream's length (with its pending tail) before
    the run; done0, was_complete: the job's progress when the run began; added: documents added."""
    m = store.info
    pending = len(pending_tokens(store))
    tokens = m.rows.tokens + pending
    read = m.job.done - done0  # tokens the model read this run (the rate's numerator)
    return {
        "store": str(store.path), "model": m.model, "profile": m.profile.name,
        "documents": [d.name for d in m.documents], "tokens": tokens,
        "events": m.rows.events,
        # what this run took in: the documents it added (with separators), or for a resume the
        # interrupted job's tokens still unread when it began (0 if that job had finished)
        "ingested_tokens": tokens - before if added else (0 if was_complete else m.job.tokens - done0),
        # a tail short of a chunk waits for the next append or the question, unread
        "pending_tokens": pending, "read_tokens": read,
        "seconds": round(seconds, 2), "tokens_per_second": round(read / max(seconds, 1e-9), 1),
        "bytes": sum(store.bytes_on_disk().values()),
    }


__all__ = ["add_documents", "add_tokens", "run_job", "Progress", "DiskSpaceError", "check_disk", "bytes_per_token", "duplicates", "continues_job", "run_summary"]
