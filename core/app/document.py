"""Segment a whole document (the engine behind `emllm segment`) and score segmentations.

One streaming pass of the engine gives every token's surprise and its pre-RoPE keys (the layers'
initial tokens + events + remainder + local window are the whole stream, in order). Boundaries of
each method are then computed over the whole document; refinement (M/C) and the metrics run on
stretches of `chunk_size` tokens, as the engine does while streaming (A is chunk-sized, never n²).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from emllm.engine.stream import Engine
from emllm.math.segmentation import (
    conductance,
    enforce_block_sizes,
    fixed_starts,
    intra_inter_similarity,
    key_adjacency,
    modularity,
    random_starts,
    refine,
    refined_max_block,
    surprise_starts,
)

METHODS = ("F", "S", "SM", "SC", "FM", "FC", "random")


@dataclass
class Analysis:
    """What one pass of the engine tells about a document."""

    ids: Tensor  # [n]
    surprise: Tensor  # [n] float32, NaN for the first token
    flags: Tensor  # [n] bool: surprise boundary candidates (eq. 1)
    keys: Tensor  # [layers, H_kv, n, D] pre-RoPE keys of the refinement layers


def analyse(engine: Engine, ids: Tensor, progress=None) -> Analysis:
    engine.feed(ids, progress=progress)
    keys = torch.stack([
        torch.cat((w.init_k, w.events.keys.view(), w.rem_k, w.local_k), 1) for w in engine.refinement_layers()
    ])
    return Analysis(ids, engine.surprise.view().clone(), engine.flags.view().clone(), keys)


def _stretches(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def random_like(n: int, k: int, min_block: int, seed: int = 0) -> Tensor:
    """Random segmentation with k events (the comparison of paper Table 2)."""
    return random_starts(n, k, torch.Generator().manual_seed(seed), max(1, min(min_block, n // k)))


def boundaries(a: Analysis, method: str, min_block: int, max_block: int, chunk: int, seed: int = 0) -> Tensor:
    """Event starts over the whole document for one method ("random": as many events as S)."""
    n = a.ids.numel()
    if method == "random":
        return random_like(n, surprise_starts(a.flags, min_block, max_block).numel(), min_block, seed)
    base = fixed_starts(n, max_block) if method.startswith("F") else surprise_starts(a.flags, min_block, max_block)
    if len(method) == 1:
        return base
    metric = "modularity" if method.endswith("M") else "conductance"
    out = []
    # Refine inside stretches of about `chunk` tokens that begin and end on a boundary.
    b = base.tolist() + [n]
    i = 0
    while i < len(b) - 1:
        j = i + 1
        while j < len(b) - 1 and b[j + 1] - b[i] <= chunk:
            j += 1
        lo, hi = b[i], b[j]
        local = torch.tensor(b[i:j]) - lo
        adj = key_adjacency(a.keys[:, :, lo:hi])
        cap = refined_max_block(method, max_block)
        r = refine(adj, local, metric, min_block=min_block, max_block=cap)
        r = enforce_block_sizes(r, hi - lo, min_block, cap)
        out.append(r + lo)
        i = j
    return torch.cat(out)


def metrics(a: Analysis, starts: Tensor, chunk: int) -> dict[str, float | None]:
    """Modularity, conductance and intra/inter similarity, averaged over chunk-sized stretches.

    A metric no stretch defines (none holds two events, or every intra/inter ratio divides by
    zero) is None: there is nothing to average, and JSON has no NaN."""
    mods, cons, iis = [], [], []
    s = starts.tolist()
    for lo, hi in _stretches(a.ids.numel(), chunk):
        inner = [x - lo for x in s if lo < x < hi]
        local = torch.tensor([0] + inner)
        if len(local) < 2:
            continue
        adj = key_adjacency(a.keys[:, :, lo:hi]).double()
        mods.append(modularity(adj, local))
        cons.append(conductance(adj, local))
        iis.append(intra_inter_similarity(adj, local))
    return {"modularity": _mean(mods), "conductance": _mean(cons), "intra_inter": _mean(iis)}


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def difference(method: dict[str, float | None], random: dict[str, float | None]) -> dict[str, float | None]:
    """Each metric of a segmentation less a random one's (paper Table 2); None where either is."""
    return {k: None if v is None or random[k] is None else v - random[k] for k, v in method.items()}


def char_ranges(offsets: list[tuple[int, int]], starts: list[int], text_len: int) -> list[tuple[int, int]]:
    """Character range of each event; consecutive ranges partition the text exactly."""
    cs = [0] + [offsets[s][0] for s in starts[1:]]
    for i in range(1, len(cs)):  # tokens that split a character share offsets: keep ranges ordered
        cs[i] = max(cs[i], cs[i - 1])
    return [(cs[i], cs[i + 1] if i + 1 < len(cs) else text_len) for i in range(len(cs))]


PREVIEW = 60  # characters of an event's text in a segmentation's document


def events_doc(model: str, method: str, prof, text: str, ids: list[int], offsets: list[tuple[int, int]],
               starts: Tensor, a: Analysis) -> dict:
    """A segmentation as data (`emllm segment --json`): each event's tokens, characters, surprise
    at its start and the beginning of its text, with the parameters that cut it."""
    st = starts.tolist()
    ends = st[1:] + [len(ids)]
    chars = char_ranges(offsets, st, len(text))
    events = []
    for i, (s, e, (c0, c1)) in enumerate(zip(st, ends, chars)):
        sup = a.surprise[s]
        events.append({"index": i, "tokens": [s, e], "chars": [c0, c1],
                       "surprise": None if sup != sup else round(float(sup), 3),
                       "preview": text[c0:c1][:PREVIEW]})
    return {"model": model, "method": method,
            "parameters": {"gamma": prof.gamma, "tau": prof.surprise_window, "min_block": prof.min_block,
                           "max_block": prof.max_block, "max_event": refined_max_block(method, prof.max_block),
                           "chunk_size": prof.chunk_size, "n_local": prof.n_local},
            "tokens": len(ids), "characters": len(text), "events": events}
