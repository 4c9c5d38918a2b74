"""Retrieval index over one layer's representative keys: exact scan, or faiss HNSW past a size.

`EventIndex` answers the question `select_events(event_scores(reprs, query), lengths, budget)`
asks, without converting every representative key to float32 at each step, and, once the layer
holds `threshold` events or more, without scoring every event.

What is exact and what is approximate
-------------------------------------
- Exact path (fewer than `threshold` events, or `threshold=None`): the result is bit for bit
  `select_events(event_scores(all_reprs, query), lengths, budget)`; the same float32 values go
  through the same `event_scores`, only their conversion is done once, at `add`.
- faiss path: an HNSW graph proposes the k best-scoring events, the one approximate step. The
  candidates are then re-scored exactly (float32, the same formula) and `select_events` runs over
  them alone. k is chosen so that k events hold more tokens than the budget, so when the graph
  returns the true top-k (perfect recall) the result is the exact path's: same ids, same order
  rule (score descending, ties to the lower id), same prefix rule, same score bits (a score
  depends on its row alone, `scores_in_blocks`). When recall is imperfect, a missed
  event is replaced by the next-best candidate: the result is still a prefix of an exactly
  scored ranking, of the candidates instead of all events.

Inner product on lifted vectors
------------------------------
HNSW over the raw vectors with `METRIC_INNER_PRODUCT` links the wrong neighbourhoods on keys
shaped like a model's (one large mean shared by every event; its recall measured low whatever M
and efConstruction: docs/benchmark-log.md): inner product between two keys is not a similarity. The
graph is built instead over the classic lifting of maximum inner product search to a sphere:
each vector x gets one more coordinate sqrt(R^2 - |x|^2), so every lifted x' has norm R and
x'.y' = R^2 - |x' - y'|^2 / 2 (the graph links true neighbours), while the query gets 0, so
q'.x' = q.x exactly (the search ranks by the real score, in float32 without an R^2 offset).
R is twice the largest norm when the graph is started; a later vector longer than R rebuilds
the graph with a new R (rare: key norms vary by a few percent).

The beam search starts from the best of the anchors (every `anchor_stride`-th event, scored
exactly, `entries` of them), not from HNSW's single entry point: from there the search can stay
in one cluster of events, e.g. another document (measured on separated clusters, the anchors'
recall is far higher: tests/test_search.py).

Building without a stall
------------------------
Inserting into HNSW costs a fraction of a millisecond per event and layer, so building the graph
for tens of thousands of events in every layer at once would stall one step for minutes. Indexing starts instead at
`warmup * threshold` events and each `add` inserts its own events plus a share of the backlog,
so the graph is complete when the size reaches `threshold` (about twice the insert cost per
`add` in between, with warmup 0.5). The graph is only searched from `threshold` on.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

from emllm.memory.buffers import GrowBuffer

from emllm.memory.selection import Selection, event_scores, events_past, select_events

# Defaults chosen with tests/test_search.py (recall) and a cost benchmark (docs/benchmark-log.md, retrieval cost).
DEFAULT_THRESHOLD = 20_000  # events per layer from which the faiss path pays off
DEFAULT_M = 32  # HNSW graph degree
DEFAULT_EF_CONSTRUCTION = 40
DEFAULT_EF_SEARCH = 128  # beam width, at least 2 k
DEFAULT_MARGIN = 32  # extra candidates beyond budget // shortest event + 1
DEFAULT_WARMUP = 0.5  # graph insertion starts at this fraction of the threshold
DEFAULT_ANCHOR_STRIDE = 64  # every 64th event is an anchor (a possible entry point)
DEFAULT_ENTRIES = 16  # the best-scoring anchors the graph search starts from
NORM_HEADROOM = 2.0  # R = NORM_HEADROOM x the largest norm when the graph starts


class EventIndex:
    """Append-only index over one layer's representative keys [E, H, D], held in float32.

    `add` appends events (in stream order: their ids are 0, 1, ...); `select` returns the
    `Selection` of `select_events` for one query. Below `threshold` events (or always, with
    `threshold=None`) the selection is exact; from `threshold` on, a faiss HNSW graph over the
    same vectors proposes candidates that are re-scored exactly (see the module docstring).
    No graph exists below `warmup * threshold` events; from there it is filled gradually.
    """

    def __init__(
        self,
        n_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        threshold: int | None = DEFAULT_THRESHOLD,
        m: int = DEFAULT_M,
        ef_construction: int = DEFAULT_EF_CONSTRUCTION,
        ef_search: int = DEFAULT_EF_SEARCH,
        margin: int = DEFAULT_MARGIN,
        warmup: float = DEFAULT_WARMUP,
        anchor_stride: int = DEFAULT_ANCHOR_STRIDE,
        entries: int = DEFAULT_ENTRIES,
    ):
        if threshold is not None and threshold < 1:
            raise ValueError(f"threshold must be >= 1 or None, got {threshold}")
        if not 0.0 < warmup <= 1.0:
            raise ValueError(f"warmup must be in (0, 1], got {warmup}")
        self.shape = (n_heads, head_dim)
        self.dim = n_heads * head_dim
        self.reprs = GrowBuffer((0, n_heads, head_dim), 0, torch.float32, torch.device(device))
        self.threshold = threshold
        self.start = None if threshold is None else max(1, math.ceil(warmup * threshold))
        self.m, self.ef_construction, self.ef_search, self.margin = m, ef_construction, ef_search, margin
        self.anchor_stride, self.entries = anchor_stride, entries
        self.anchors = GrowBuffer((0, self.dim), 0, torch.float32, torch.device(device))  # ids 0, s, 2s, ...
        self.faiss_index = None  # the HNSW graph, from `start` events on
        self.radius = 0.0  # R of the lifting (every lifted vector has norm R)
        self.rebuilds = 0  # graphs rebuilt because a vector outgrew R
        self.last_k: int | None = None  # candidates searched by the last faiss select (for inspection)
        self._gather_buf: Tensor | None = None

    def __len__(self) -> int:
        return self.reprs.n

    @property
    def n_indexed(self) -> int:
        """Events already in the graph (they are the first n_indexed ids)."""
        return 0 if self.faiss_index is None else self.faiss_index.ntotal

    def vectors(self) -> Tensor:
        """All representative keys, float32 [E, H, D] (a view: do not modify)."""
        return self.reprs.view()

    def add(self, reprs: Tensor) -> None:
        """Append events' representative keys [e, H, D] (any float dtype; stored as float32)."""
        if tuple(reprs.shape[1:]) != self.shape:
            raise ValueError(f"reprs must be [e, {self.shape[0]}, {self.shape[1]}], got {list(reprs.shape)}")
        if reprs.shape[0] == 0:
            return
        n_old = len(self)
        self.reprs.append(reprs)  # converted to float32 once, here
        first = -n_old % self.anchor_stride  # the batch's first id that is a multiple of the stride
        self.anchors.append(self.reprs.view()[n_old + first :: self.anchor_stride].reshape(-1, self.dim))
        n = len(self)
        if self.start is None or n < self.start:
            return
        if n >= self.threshold:
            target = n
        else:  # fill the graph linearly from 0 at `start` to everything at `threshold`
            target = min(n, math.ceil(self.threshold * (n - self.start + 1) / (self.threshold - self.start + 1)))
        if target > self.n_indexed:
            self._insert(target)

    def _insert(self, target: int) -> None:
        """Put events n_indexed .. target-1 into the graph (starting or rebuilding it as needed)."""
        import faiss

        new = self.reprs.view()[self.n_indexed : target].reshape(-1, self.dim)
        longest = float(new.norm(dim=1).max())
        if self.faiss_index is None or longest > self.radius:
            if self.faiss_index is not None:
                self.rebuilds += 1
            longest = float(self.reprs.view().reshape(-1, self.dim).norm(dim=1).max())  # every event so far
            self.radius = NORM_HEADROOM * longest
            index = faiss.IndexHNSWFlat(self.dim + 1, self.m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = self.ef_construction
            self.faiss_index = index
            new = self.reprs.view()[:target].reshape(-1, self.dim)
        with _faiss_threads(1 if new.shape[0] < 1024 else None):
            # Small batches (one chunk's events) on this thread: the OpenMP region costs more
            # than it saves (measured on 2 shared cores), and the graph
            # is then the same from run to run.
            self.faiss_index.add(self._lift(new))

    def _lift(self, x: Tensor) -> np.ndarray:
        """[n, dim] -> [n, dim + 1] float32 numpy: x with sqrt(R^2 - |x|^2) appended (|x'| = R)."""
        x = x.detach().cpu()
        extra = (self.radius**2 - x.pow(2).sum(1, keepdim=True)).clamp_min(0).sqrt()
        return torch.cat((x, extra), 1).numpy()

    def select(self, query: Tensor, lengths: Tensor, budget: int) -> Selection:
        """The events `select_events(event_scores(reprs, query), lengths, budget)` picks.

        query [H, D]; lengths [E] long, every event's tokens (positive). Exact below the
        threshold; from it on, approximate candidates, re-scored exactly (module docstring).
        """
        n = len(self)
        if lengths.shape[0] != n:
            raise ValueError(f"lengths has {lengths.shape[0]} entries for {n} events")
        if n == 0 or budget <= 0:  # what select_events gives (event_scores cannot take 0 events)
            return Selection(torch.empty(0, dtype=torch.long, device=lengths.device),
                             torch.empty(0, dtype=torch.float32, device=lengths.device))
        if self.threshold is None or n < self.threshold or self.n_indexed < n:
            return select_events(event_scores(self.reprs.view(), query), lengths, budget)
        return self._select_faiss(query, lengths, budget)

    def _select_faiss(self, query: Tensor, lengths: Tensor, budget: int) -> Selection:
        n = len(self)
        shortest = int(lengths.min())
        # k events of at least `shortest` tokens hold more than `budget` tokens: with the true
        # top-k, the first event that does not fit is among them, so the prefix is the exact one.
        k = min(n, events_past(budget, shortest, n) + self.margin)
        while k < n:
            cand = self.search(query, k).to(lengths.device)
            # Widen when the candidates cannot fill the budget (the graph returned fewer than k
            # events): an event not returned could still fit.
            if int(lengths[cand].sum()) > budget:
                break
            k = min(n, 2 * k)
        self.last_k = k
        if k >= n:  # every event is a candidate: the exact path, on the full matrix
            return select_events(event_scores(self.reprs.view(), query), lengths, budget)
        cand = torch.sort(cand).values  # id order: the stable sort in select_events breaks ties by id
        sel = select_events(event_scores(self._gather(cand), query), lengths[cand], budget)
        return Selection(cand[sel.ids], sel.scores)

    def _gather(self, ids: Tensor) -> Tensor:
        """reprs[ids] [m, H, D], copied into a buffer kept between calls, on this thread.

        (torch's index_select of a few hundred rows opens a parallel region; on 2 shared cores
        waiting for the second thread cost far more than the graph search. numpy's take does not.)
        """
        m = ids.numel()
        if self._gather_buf is None or self._gather_buf.shape[0] < m:
            cap = max(m, 2 * (0 if self._gather_buf is None else self._gather_buf.shape[0]), 256)
            self._gather_buf = torch.empty((cap, *self.shape), dtype=torch.float32, device=self.reprs.buf.device)
        out = self._gather_buf[:m]
        if out.device.type == "cpu":
            np.take(self.reprs.view().numpy(), ids.numpy(), axis=0, out=out.numpy())
        else:
            torch.index_select(self.reprs.view(), 0, ids.to(out.device), out=out)
        return out

    def search(self, query: Tensor, k: int) -> Tensor:
        """Approximate: the ids of (at most) k events with the highest scores, per the graph.

        Needs the graph to hold every event (len(self) >= threshold). The beam search starts from
        the best-scoring anchors (every `anchor_stride`-th event, scored exactly): a search started
        only from HNSW's own entry point can stay inside one cluster of events, missing whole
        clusters (tests/test_search.py holds the anchors' recall on separated clusters).
        """
        import faiss

        if self.faiss_index is None or self.n_indexed < len(self):
            raise RuntimeError("the graph does not hold every event yet")
        qf = query.detach().reshape(-1).float()
        anchor_scores = self.anchors.view() @ qf.to(self.anchors.buf.device)
        top = anchor_scores.topk(min(self.entries, anchor_scores.numel()))
        entry_ids = np.ascontiguousarray((top.indices * self.anchor_stride).to(torch.int32).cpu().numpy()[None])
        entry_d = np.ascontiguousarray(top.values.cpu().numpy()[None])  # q'.x' = q.x: their similarity
        q = np.ascontiguousarray(torch.cat((qf.cpu(), torch.zeros(1)))[None].numpy())
        distances = np.empty((1, k), dtype=np.float32)
        labels = np.empty((1, k), dtype=np.int64)
        params = faiss.SearchParametersHNSW(efSearch=max(self.ef_search, 2 * k))
        # One query: on this thread. (search_level_0 opens an OpenMP region even for one query;
        # with 2 busy cores that region cost many times the search itself.)
        with _faiss_threads(1):
            self.faiss_index.search_level_0(
                1, faiss.swig_ptr(q), k, faiss.swig_ptr(entry_ids), faiss.swig_ptr(entry_d),
                faiss.swig_ptr(distances), faiss.swig_ptr(labels), entry_ids.shape[1], 2, params,
            )
        found = torch.from_numpy(labels[0])
        return found[found >= 0]


@contextmanager
def _faiss_threads(n: int | None):
    """faiss's OpenMP threads set to n (None: unchanged) for this thread, restored after."""
    if n is None:
        yield
        return
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)
