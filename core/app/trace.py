"""Retrieval traces: which events each layer retrieved, step by step (spec §4, issue: inspect).

    trace = Trace.attach(engine)         # engine.on_retrieval now records
    engine.feed(question_ids)
    trace.detach()
    trace.coverage(n_tokens, bins=60)    # [layers, bins]: share of each stretch of the document retrieved

Cheap when nobody listens: the engine calls its callback only when one is set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from emllm.engine.stream import Engine, RetrievalListener
from emllm.memory.buffers import token_index
from emllm.memory.passages import event_spans
from emllm.memory.selection import Selection


@dataclass
class Record:
    step: int
    layer: int
    ids: Tensor  # [k] event ids, increasing
    scores: Tensor  # [k]
    # what the scores are: "dot", the query's inner product with each event's representative key;
    # "z", z-scores over a question's tokens combined: the best (profile question_scoring "max")
    # or a soft maximum ("lse")
    scoring: str = "dot"


class Trace(RetrievalListener):
    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.records: list[Record] = []
        self._step = -1

    @classmethod
    def attach(cls, engine: Engine) -> "Trace":
        return cls(engine)

    @property
    def steps(self) -> int:
        """Steps recorded (a chunk's forward, or a generated token's)."""
        return self._step + 1

    def heard(self, layer: int, sel: Selection, query: Tensor | None = None) -> None:
        if layer == self.engine.windows[0].layer_idx or self._step < 0:  # (the first layer with memory)
            self._step += 1
        scoring = "z" if query is not None and query.dim() == 3 else "dot"  # ([T, H_r, D]: a question's tokens)
        self.records.append(Record(self._step, layer, sel.ids.cpu(), sel.scores.float().cpu(), scoring))

    def event_spans(self) -> Tensor:
        """[E, 2] stream positions [start, end) of every event (events follow the initial tokens)."""
        return event_spans(self.engine.windows[0].events.event_lengths(), self.engine.profile.n_init)

    def counts(self) -> Tensor:
        """[layers, E]: how many steps each layer with memory (`Engine.windows`) retrieved each event."""
        row = {w.layer_idx: i for i, w in enumerate(self.engine.windows)}
        e = len(self.engine.windows[0].events)
        out = torch.zeros(len(row), e, dtype=torch.long)
        for r in self.records:
            out[row[r.layer], r.ids[r.ids < e]] += 1
        return out

    def coverage(self, n_tokens: int, bins: int) -> Tensor:
        """[layers, bins] in [0, 1]: for each layer with memory and each stretch of n_tokens / bins stream
        positions, the share of its tokens in events the layer retrieved at any step."""
        spans = self.event_spans()
        hit = self.counts() > 0  # [layers, E]
        per_token = torch.zeros(hit.shape[0], n_tokens)
        for_each = torch.repeat_interleave(torch.arange(spans.shape[0]), spans[:, 1] - spans[:, 0])
        pos = token_index(spans[:, 0], spans[:, 1] - spans[:, 0])  # [event tokens] stream positions
        keep = pos < n_tokens
        per_token[:, pos[keep]] = hit[:, for_each[keep]].float()
        edges = torch.linspace(0, n_tokens, bins + 1).long()
        cum = torch.nn.functional.pad(per_token.cumsum(1), (1, 0))
        width = (edges[1:] - edges[:-1]).clamp_min(1)
        return (cum[:, edges[1:]] - cum[:, edges[:-1]]) / width


__all__ = ["Trace", "Record"]
