"""What a store holds and what a question retrieves from it, as data (the CLI renders it).

    store_summary(store)                                   # sizes, events, documents, bytes
    retrieval_report(store, model, tok, "who hid the key?") # per layer, which events, where
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import torch
from torch import Tensor

from emllm.app.ask import Session
from emllm.app.trace import Trace
from emllm.store import Store

BINS = 64  # columns of the coverage heatmap
PREVIEW = 70  # characters of an event's text shown


def store_summary(st: Store) -> dict:
    """What a store holds: identity, profile, sizes, event-size histogram, documents, bytes on disk."""
    m = st.info
    lengths = st.events.read().long()
    hist: dict[str, int] = {}
    if lengths.numel():
        lo, hi = m.profile.min_block, m.profile.max_block
        edges = sorted({lo, *[2**i for i in range(1, 12) if lo < 2**i < hi], hi + 1})
        idx = torch.bucketize(lengths, torch.tensor(edges), right=True) - 1
        counts = torch.bincount(idx.clamp(0, len(edges) - 2), minlength=len(edges) - 1)
        hist = {f"{edges[i]}-{edges[i + 1] - 1}": int(c) for i, c in enumerate(counts.tolist())}
    surprise = st.surprise.read()  # [T] -log p(token | what emllm attended to), NaN where none
    spans = [surprise[d.start: d.start + d.tokens] for d in m.documents]
    docs = [{**d.as_dict(), "perplexity": _perplexity(s)} for d, s in zip(m.documents, spans)]
    return {
        "store": str(st.path), "format_version": m.version, "model": m.model,
        "identity": m.identity, "profile": m.profile_keys, "created": m.created, "updated": m.updated,
        "layers": st.geometry.layers, "memory_layers": list(st.geometry.memory_layers or []) or None,
        "dtype": st.geometry.dtype, "format": st.kv_format.name,
        "key_equaliser": st.key_equalised,
        # how an event is found: its key (a profile without the key predates it: the paper's) and its heads
        "representative": m.profile.representative, "representative_heads": st.repr_heads,
        "tokens": m.rows.tokens + m.pending,
        "processed_tokens": m.rows.tokens, "events": m.rows.events,
        "event_tokens": m.rows.event_tokens,
        "mean_event_size": round(float(lengths.float().mean()), 2) if lengths.numel() else None,
        "event_sizes": hist, "documents": docs, "complete": m.complete,
        # the documents' tokens as emllm read them (its memory and window): exp of their mean surprise,
        # exact where the profile computes every token's ("full"), estimated from a shortlist else
        "perplexity": _perplexity(torch.cat(spans)) if spans else None,
        "perplexity_exact": m.profile.surprise_head == "full",
        "bytes": st.bytes_on_disk(),
    }


def _perplexity(nll: Tensor) -> float | None:
    """exp of the mean of the finite negative log-likelihoods in `nll` [n] (None: none)."""
    x = nll[torch.isfinite(nll)].double()
    return round(math.exp(float(x.mean())), 4) if x.numel() else None


def retrieval_report(st: Store, model: Any, tok: Any, query: str, layer: int | None = None, top: int = 8) -> dict:
    """Read `query` as the question closing the store's stream (on a copy: the store is unchanged)
    and report what each layer retrieved for it."""
    session = Session(st, model, tok)
    trace = Trace.attach(session.engine)
    session.read_question(query)
    trace.detach()
    return retrieval_doc(trace, st, tok, query, layer, top, session.engine.window_start)


def retrieval_doc(trace, st, tok, query: str, layer: int | None = None, top: int = 8,
                  window_start: int | None = None) -> dict:
    """The retrieval recorded in `trace` as data: coverage heatmap, most retrieved events, one layer.
    window_start: the stream position where the local window began when the question was read."""
    layer_ids = [w.layer_idx for w in trace.engine.windows]  # the layers with memory: the coverage's rows
    n = st.info.rows.tokens
    cov = trace.coverage(n, BINS) if n else None
    counts = trace.counts()  # [layers, E]
    spans = trace.event_spans()
    ids = st.tokens.read()
    docs = st.info.documents
    starts = [d.start for d in docs]

    def document(s: int) -> str | None:
        """The document the stream position s lies in (None: framing, separators, the question)."""
        i = bisect.bisect_right(starts, s) - 1
        return docs[i].name if i >= 0 and s < docs[i].start + docs[i].tokens else None

    def event(e: int, score: float | None = None) -> dict:
        s, t = spans[e].tolist()
        d = {"event": e, "tokens": [s, t], "layers": int((counts[:, e] > 0).sum()), "document": document(s),
             "preview": tok.decode(ids[s:t].tolist(), skip_special_tokens=True)[:PREVIEW]}
        if score is not None:
            d["score"] = round(score, 4)
        return d

    by_layers = (counts > 0).sum(0)
    order = torch.sort(by_layers, descending=True, stable=True).indices.tolist()[:top]
    out = {
        "query": query, "layers": len(layer_ids), "layer_ids": layer_ids, "bins": BINS, "steps": trace.steps, "span": n,
        # attended at every step, never retrieved: the first n_init tokens and the local window
        "initial_tokens": min(n, st.info.profile.n_init),
        "window_start": n if window_start is None else max(0, min(n, window_start)),
        "coverage": [[round(x, 3) for x in row] for row in cov.tolist()] if cov is not None else [],
        "top_events": [event(int(e)) for e in order if by_layers[e] > 0],
    }
    if layer is not None:
        recs = [r for r in trace.records if r.layer == layer]
        out["layer"] = {"index": layer, "steps": [
            {"step": r.step, "scoring": r.scoring, "events": [event(int(e), float(s)) for e, s in zip(r.ids, r.scores)]}
            for r in recs]}
    return out
