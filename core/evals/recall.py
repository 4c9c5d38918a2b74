"""Needle recall: did retrieval bring a needle to the layers when the question was read?

A quality answer alone cannot tell "the memory did not find it" from "the model did not read it".
`RecallProbe` records every layer's selection and query while the question is fed (the step whose
retrieval the answer's first token attends to), and `needle_recall` says, per needle:
- where it was: in the initial tokens or the window (every layer attends to it, nothing to
  retrieve), or in events of the memory;
- how many layers' selections held one of its events, how many held all of them (a needle split
  by boundaries into several events may reach a layer in part: its key without its value), and
  per layer the best rank of its events in that layer's full ranking (1: the best-scoring event;
  exact scores of every event, the ranking `select_events` sorts).

    probe = RecallProbe(engine); engine.feed(question); probe.detach()
    found = needle_recall(engine, probe, prompt.needles)   # one NeedleRecall per needle
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from emllm.engine.stream import RetrievalListener
from emllm.memory.passages import event_spans
from emllm.memory.selection import TOKEN_SCORINGS, Selection, event_scores


@dataclass(frozen=True)
class NeedleRecall:
    needle: int  # index into the prompt's needles
    where: str  # "init" or "window" (attended by every layer), "memory" (must be retrieved)
    layers: int  # layers whose selection held one of the needle's events (all of them for init/window)
    of: int  # layers
    ranks: list[int]  # per layer, the best rank of the needle's events (1 = top); [] unless "memory"
    events: int  # events the needle's tokens fall in
    whole: int = 0  # layers whose selection held every one of those events (all layers for init/window)

    @property
    def share(self) -> float:
        return self.layers / self.of if self.of else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "share": round(self.share, 4)}


class RecallProbe(RetrievalListener):
    """Records, per layer, the last selection and query the engine retrieved with (from attach to
    detach): feed the question between the two."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.last: dict[int, tuple[Selection, Tensor, int]] = {}  # layer -> (selection, query, events then)

    def heard(self, layer: int, sel: Selection, query: Tensor) -> None:
        n = len(self.engine.layers[layer].events)  # (the step may close events after retrieving)
        self.last[layer] = (Selection(sel.ids.cpu(), sel.scores.cpu()), query.detach().float().cpu(), n)


def needle_recall(engine: Any, probe: RecallProbe, needles: Sequence[tuple[int, int]]) -> list[NeedleRecall]:
    """For each needle (a token span [start, end) of the stream), what the question's retrieval
    did with it (module docstring). The engine's stream must begin with the document."""
    windows = engine.windows  # the layers with memory
    n_layers = len(windows)
    n_init = engine.profile.n_init
    starts, ends = event_spans(windows[0].events.event_lengths(), n_init).unbind(1)
    ranks_of: dict[int, Tensor] = {}  # layer -> rank of every event (1 = best)

    def ranks(layer: int) -> Tensor:
        if layer not in ranks_of:
            _, query, n = probe.last[layer]
            events = engine.layers[layer].events
            if query.dim() == 3:  # a question's tokens, scored as the profile says (`LayerWindow.retrieve`)
                scores = TOKEN_SCORINGS[engine.profile.question_scoring](events.token_scores(query)[:, :n]).cpu()
            else:
                scores = event_scores(events.repr_keys()[:n].float(), query)
            order = torch.sort(scores, descending=True, stable=True).indices  # as select_events ranks
            r = torch.empty_like(order)
            r[order] = torch.arange(1, order.numel() + 1)
            ranks_of[layer] = r
        return ranks_of[layer]

    # events closed after the retrieval (by the question's own step) were in the window then
    n_then = min((n for _, _, n in probe.last.values()), default=len(starts))
    out = []
    for j, (s, e) in enumerate(needles):
        ev = torch.nonzero((starts < e) & (ends > s)).squeeze(1)
        ev = ev[ev < n_then]
        if ev.numel() == 0:
            where = "init" if e <= n_init else "window"
            out.append(NeedleRecall(j, where, n_layers, n_layers, [], 0, n_layers))
            continue
        held, whole, best = 0, 0, []
        for layer in (w.layer_idx for w in windows):
            if layer not in probe.last:  # this layer did not retrieve (no events yet)
                best.append(0)
                continue
            sel, _, _ = probe.last[layer]
            hit = torch.isin(ev, sel.ids)
            held += bool(hit.any())
            whole += bool(hit.all())
            best.append(int(ranks(layer)[ev].min()))
        out.append(NeedleRecall(j, "memory", held, n_layers, best, ev.numel(), whole))
    return out


def chunk_recall(ranked: Sequence[int], spans: Sequence[tuple[int, int]], needle: tuple[int, int],
                 budget: int) -> tuple[int, bool]:
    """A chunk retriever's view of a needle: (rank of the first chunk holding the needle's first
    token, 1 = best; 0 if none), whether that chunk is among the best chunks that fit in `budget`
    tokens (taken best first while they fit, as emllm's selection is)."""
    s = needle[0]
    hit = next((i for i, (a, b) in enumerate(spans) if a <= s < b), None)
    if hit is None or hit not in ranked:
        return 0, False
    rank = list(ranked).index(hit) + 1
    used = 0
    for i in ranked:
        n = spans[i][1] - spans[i][0]
        if used + n > budget:
            return rank, False
        used += n
        if i == hit:
            return rank, True
    return rank, False


__all__ = ["NeedleRecall", "RecallProbe", "needle_recall", "chunk_recall"]
