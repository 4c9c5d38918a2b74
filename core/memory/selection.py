"""The retrieval policy, pure math: scoring events' representative keys against a query (exact,
bit for bit whatever the batching), choosing events within a token budget, representative keys of
new events, and the contiguity buffer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from emllm.memory.distinct import best_of_groups


SCORE_BLOCK_BYTES = 4 << 20  # float32 bytes of representative keys scored a block on the CPU (its caches)
# float32 bytes of products a block on a device: there each block costs its kernels' launches, not
# cache misses; in the CPU's blocks a step's launches grew with the memory, and a question's many
# queries took blocks of a few events each
DEVICE_BLOCK_BYTES = 256 << 20


def score_block_rows(dim: int, device: torch.device | None = None) -> int:
    """Events per scoring block for vectors of `dim` floats: a power of two, about 4 MiB of float32
    on the CPU (None), `DEVICE_BLOCK_BYTES` on another device."""
    budget = SCORE_BLOCK_BYTES if device is None or device.type == "cpu" else DEVICE_BLOCK_BYTES
    return 1 << max(6, (budget // (4 * dim)).bit_length() - 1)


_WORK: dict[tuple[torch.device, int], Tensor] = {}


def work_buffer(rows: int, dim: int, device: torch.device, slot: int = 0) -> Tensor:
    """A float32 buffer [rows, dim], one per device and slot, reused by every scoring call (grown
    as needed).

    A fresh process pays for new memory in page faults: a question against a large store scores
    a few MiB per layer, and allocating its temporaries anew for every block cost as much as the
    arithmetic (docs/benchmark-log.md). Callers use it at once, one at a time (the engine is single-threaded)."""
    buf = _WORK.get((device, slot))
    if buf is None or buf.numel() < rows * dim:
        buf = _WORK[(device, slot)] = torch.empty(max(rows * dim, 1 << 16), dtype=torch.float32, device=device)
    return buf[: rows * dim].view(rows, dim)


def score_groups(dim: int) -> int:
    """Terms per group when scoring vectors of `dim` floats: the divisor of dim nearest below its
    square root (g + dim / g, the rounding bound's length, is then smallest; 24 for 576)."""
    return max(g for g in range(1, math.isqrt(dim) + 1) if dim % g == 0)


def gamma(n: int) -> float:
    """The relative error bound of a float32 sum of n products, in any order of summation:
    |fl(x . y) - x . y| <= gamma(n) * sum |x_i y_i| (Higham, Accuracy and Stability, 3.1)."""
    nu = n * 2.0**-24
    return nu / (1 - nu)


def score_error(dim: int) -> float:
    """e with |score - q . x| <= e * sum |q_i x_i| <= e |q| |x| for every score `scores_in_blocks`
    computes: dim / g sums of g products each (gamma(g)), then those sums summed, each level in
    any order: gamma(g + dim / g - 1)."""
    g = score_groups(dim)
    return gamma(g + dim // g - 1)


def scores_in_blocks(n: int, dim: int, block: Callable[[int, int], Tensor], query: Tensor) -> Tensor:
    """Scores of events 0..n-1, a block of `score_block_rows(dim, query.device)` events at a time.

    block(start, stop) returns those events' representative keys [stop - start, dim] (float16,
    bfloat16 or float32; scored in float32). Each score is a product, then dim / g sums of
    g = `score_groups(dim)` terms each (terms j, j + dim / g, j + 2 dim / g, ...: the sums run down
    contiguous lanes, faster than summing contiguous groups: docs/benchmark-log.md), then a sum of those, along the row only, so its
    bits depend on that row alone: scoring any subset of the events, from any source, in any block, at any
    address, gives the same bits as the scan (a matrix-vector product does not: BLAS rounds a row
    differently with the number of rows it is given and their alignment; measured, most scores of
    a random subset differ in the last bit). Readers of a sketched store rely on it to select
    exactly what the scan selects, and on the two levels for a tight rounding bound
    (`score_error`: gamma(47) instead of gamma(576) for SmolLM2). query [dim] -> [n] float32.
    """
    return token_scores(n, dim, block, query.reshape(1, dim))[0]


def fold_query(query: Tensor, heads: int) -> Tensor:
    """query [..., H_q, D] -> [..., heads, D] float32: each group of H_q / heads query heads summed.

    Where every query head of a group scores the same representative key r (mean keys of a GQA
    model), sum_h q_h . r = (sum_h q_h) . r: one key per group then gives the same score, with
    1/group the bytes to read. heads == H_q: the query, unchanged."""
    *lead, h_q, d = query.shape
    if heads == h_q:
        return query
    return query.float().view(*lead, heads, h_q // heads, d).sum(-2)


def event_scores(reprs: Tensor, query: Tensor) -> Tensor:
    """Score of each event: sum over heads of dot(query_h, repr_h). reprs [E, H, D], query [H, D] -> [E]."""
    flat = reprs.reshape(reprs.shape[0], query.numel())  # (no rows: still [0, dim])
    return scores_in_blocks(flat.shape[0], flat.shape[1], lambda a, b: flat[a:b], query)


def token_scores(n: int, dim: int, block: Callable[[int, int], Tensor], queries: Tensor) -> Tensor:
    """Every event's score for each of several queries: queries [T, ...] (each `dim` floats) ->
    [T, n] float32, row t the bits `scores_in_blocks(n, dim, block, queries[t])` gives.

    The scan's operations (`scores_in_blocks` is this for one query), on [T, m, dim] at once: each
    block of keys is read once for all T queries, and the blocks shrink with T so the products
    stay ~4 MiB on the CPU, `DEVICE_BLOCK_BYTES` on a device (faster than one query at a time;
    tests/test_surprise_memory.py checks the bits against the scan's formula)."""
    q = queries.reshape(-1, dim).float()  # [T, dim]
    t = q.shape[0]
    out = torch.empty(t, n, dtype=torch.float32, device=q.device)
    step = max(16, score_block_rows(dim, q.device) // max(t, 1))
    g = score_groups(dim)
    for start in range(0, n, step):
        stop = min(n, start + step)
        m = stop - start
        w = work_buffer(t * m, dim, q.device).view(t, m, dim)
        torch.mul(block(start, stop).unsqueeze(0), q.unsqueeze(1), out=w)  # (a half row is widened exactly, as .float() would)
        if g > 1:
            w2 = work_buffer(t * m, dim // g, q.device, slot=1).view(t, m, dim // g)
            torch.sum(w.view(t, m, g, dim // g), 2, out=w2)  # [T, m, dim / g] lanes, each a sum of g strided terms
            w = w2
        torch.sum(w, 2, out=out[:, start:stop])
    return out


def token_z(scores: Tensor) -> Tensor:
    """[T, E] scores of E events for each of a chunk's T tokens -> [T, E] float64: each token's
    scores standardised over the events (z-scores: a token whose scores all lie close together
    decides nothing). A token whose scores are all equal gives every event 0.

    In float64 from float32 scores, on the scores' device: the same [T, E] give the same bits
    wherever the events are kept (in RAM, a store's files)."""
    s = scores.to(torch.float64, copy=True)  # (a copy even of float64 scores: changed in place below)
    mean = s.mean(1, keepdim=True)
    sd = s.std(1, correction=0, keepdim=True)
    # in place, the same operations: at 1M tokens [T, E] is ~14 MB a layer, each temporary fresh memory
    return s.sub_(mean).div_(torch.where(sd > 0, sd, 1.0)).masked_fill_(sd == 0, 0.0)


def token_max(scores: Tensor) -> Tensor:
    """[T, E] -> [E] float64: each event's best z-score over the tokens (`token_z`; profile
    question_scoring "max")."""
    return token_z(scores).max(0).values


# The soft maximum's temperature, in z-score units: at 0.5 a token half a standard deviation
# behind the best counts e^-1 as much. Not tuned: the value the offline recall probe had tried
# (recall equal to the hard maximum's); on the passkey's first answer token it was compared with
# temperature 1 and the hard maximum (docs/benchmarks.md, recall; docs/benchmark-log.md).
LSE_TEMPERATURE = 0.5


def token_lse(scores: Tensor, temperature: float = LSE_TEMPERATURE) -> Tensor:
    """[T, E] -> [E] float64: a soft maximum of each event's z-scores over the tokens,
    temperature * log(sum_t exp(z_t / temperature)) (profile question_scoring "lse"). Like
    "max", one token that singles an event out lifts it; unlike it, an event that several of
    the question's tokens find also gains. In z units: never below the best z, at most
    temperature * log(T) above it. One token: its z-score."""
    return temperature * torch.logsumexp(token_z(scores).div_(temperature), 0)


# How a question's chunk of several tokens turns their [T, E] scores into one per event
# (profile question_scoring; "mean" scores the tokens' mean query instead, with no [T, E]).
TOKEN_SCORINGS: dict[str, Callable[[Tensor], Tensor]] = {"max": token_max, "lse": token_lse}


TOPK_FROM = 1024  # select_events narrows to a top-k before sorting only past this many events


@dataclass(frozen=True)
class Selection:
    ids: Tensor  # [k] event ids, in stream order
    scores: Tensor  # [k] their scores
    # [T, E] every event's score for each of a question's T tokens, where the selection scored
    # them all (a question's chunk, `TOKEN_SCORINGS`) and a listener is told of it; else None
    token_scores: Tensor | None = field(default=None, repr=False, compare=False)


def select_events(scores: Tensor, lengths: Tensor, budget: int, groups: Tensor | None = None) -> Selection:
    """Similarity buffer: the best-scoring events, best first, while their tokens fit in `budget`.

    Filling stops at the first event that does not fit (a prefix of the ranking), so the result
    is the top of one sort, the same whichever search produced the ranking. Ties break by event
    id (earlier first): the sort is stable. The ranking is done on the host (`select_positions`);
    the ids and scores come back on the scores' device.

    groups [n] (`distinct.span_groups`): identical events take one place (profile
    distinct_events). The best-scoring event of each group is ranked first; the other copies
    only fill what budget is left once every group has its place, best first (a stream of few
    distinct events, a passkey's filler, still fills its budget).
    """
    if scores.numel() == 0 or budget <= 0:
        empty = torch.empty(0, dtype=torch.long, device=scores.device)
        return Selection(empty, scores[:0])
    s, n = scores.detach().cpu().numpy(), lengths.cpu().numpy()
    if groups is None:
        pos = select_positions(s, n, budget)
    else:
        keep = best_of_groups(s, groups.cpu().numpy())
        pos = keep[select_positions(s[keep], n[keep], budget)]
        if pos.size == keep.size and keep.size < s.size:  # every group has its place: copies fill the rest
            rest = np.setdiff1d(np.arange(s.size), keep, assume_unique=True)
            more = rest[select_positions(s[rest], n[rest], budget - int(n[keep].sum()))]
            pos = np.sort(np.concatenate((pos, more)))
    ids = torch.from_numpy(pos).to(scores.device)
    return Selection(ids, scores[ids])


def select_mask(scores: Tensor, lengths: Tensor, budget: int | Tensor, among: Tensor | None = None) -> Tensor:
    """`select_positions` on the scores' device, reading nothing back to the host: scores [n],
    lengths [n] (long) -> [n] bool, the selected events. budget: tokens, or a 0-d tensor on the
    scores' device. among [n] bool: only these compete (the others are ranked last and never taken).

    The same order (torch's stable descending sort: NaN first, then by score, ties in id order)
    and the same prefix, so the same events as `select_events` (tests/test_device_selection.py)."""
    order = torch.sort(scores, descending=True, stable=True).indices  # [n]
    n = lengths[order]
    if among is not None:
        out = ~among[order]
        order = order[torch.sort(out.to(torch.uint8), stable=True).indices]  # competitors first, in rank order
        n = lengths[order] * among[order]
    keep = torch.cumsum(n, 0) <= budget  # a prefix: the lengths are >= 0
    if isinstance(budget, Tensor):
        keep &= budget > 0  # (no budget: none, events of length 0 included)
    elif budget <= 0:
        keep.zero_()
    if among is not None:
        keep &= among[order]
    return torch.empty_like(keep).scatter_(0, order, keep)  # (order is a permutation: every place written)


def best_of_groups_mask(scores: Tensor, groups: Tensor) -> Tensor:
    """`distinct.best_of_groups` on the scores' device: scores [n], groups [n] -> [n] bool, each
    group's best-scoring member (the earliest among equal scores; NaN the best)."""
    key = torch.where(torch.isnan(scores), float("inf"), scores)
    order = torch.sort(key, descending=True, stable=True).indices  # best first, ties in id order
    order = order[torch.sort(groups[order], stable=True).indices]  # by group, best first inside each
    g = groups[order]
    head = torch.ones_like(g, dtype=torch.bool)
    head[1:] = g[1:] != g[:-1]
    return torch.zeros_like(head).scatter_(0, order, head)


def select_events_mask(scores: Tensor, lengths: Tensor, budget: int, groups: Tensor | None = None) -> Tensor:
    """`select_events` on the scores' device, as a mask [n] bool of the events it selects (nothing
    read back to the host: a step's selection keeps the device busy). With `groups`: each group's
    best first, the copies only where every group has its place, in what budget it left."""
    if groups is None:
        return select_mask(scores, lengths, budget)
    heads = best_of_groups_mask(scores, groups)
    sel = select_mask(scores, lengths, budget, among=heads)
    all_in = (sel == heads).all()  # (a 0-d tensor: no branch on the host)
    more = select_mask(scores, lengths, budget - (lengths * sel).sum(), among=~heads)
    return sel | (more & all_in)


def events_past(budget: int, shortest: int, n: int) -> int:
    """How many of n events, each at least `shortest` tokens long, surely hold more than `budget`
    tokens (all n when that takes more, or when an event may be empty): the best k of a ranking
    reach past the budget, so the event where it stops is among them."""
    return n if shortest <= 0 else min(n, budget // shortest + 1)


def select_positions(scores: np.ndarray, lengths: np.ndarray, budget: int) -> np.ndarray:
    """`select_events` on host arrays: scores [n], lengths [n] -> the selected positions [k]
    (int64, increasing).

    In numpy: a selection is a few dozen operations on a few hundred numbers, where each of
    torch's costs several microseconds more (a generated token makes one per layer: a share of
    its time worth saving, docs/benchmark-log.md). The order is torch's `sort(descending=True,
    stable=True)`: NaN first, then by score, ties in id order."""
    n = scores.size
    if n == 0 or budget <= 0:
        return np.zeros(0, dtype=np.int64)
    k = events_past(budget, int(lengths.min()), n)
    nan = np.isnan(scores)
    if nan.any():
        order = np.lexsort((-np.where(nan, 0, scores), ~nan))  # (last key first: NaN, then by score)
    elif k < n and n > TOPK_FROM:
        # Only the best k can be in the prefix: sort the events scoring at least the k-th best
        # (ties at that score included, in id order), not all of them. Same order, same prefix.
        # (a few hundred events: one sort costs less than the extra steps)
        cand = np.flatnonzero(scores >= np.partition(scores, n - k)[n - k])
        order = cand[np.argsort(-scores[cand], kind="stable")]
    else:
        order = np.argsort(-scores, kind="stable")
    # the prefix that fits: cumsum of lengths >= 0 is non-decreasing
    k = int(np.searchsorted(np.cumsum(lengths[order]), budget, side="right"))
    return np.sort(order[:k])


def event_rows(lengths: Tensor, n: int, width: int | None = None) -> tuple[Tensor, Tensor]:
    """Consecutive events of `lengths` ([e], sum n) as a padded grid of token rows: (idx [e, width]
    each event's rows, padding clamped into range; valid [e, width] which are its own). width: the
    longest event's tokens where the caller knows it on the host (else read from `lengths`). The
    same for every layer closing these events: `rows` of the functions below takes it made once."""
    width = int(lengths.max()) if width is None else width
    starts = torch.cumsum(lengths, 0) - lengths
    col = torch.arange(width, device=lengths.device)
    valid = col[None, :] < lengths[:, None]
    return (starts[:, None] + col[None, :]).clamp_max(n - 1), valid


def unit_keys(reprs: Tensor) -> Tensor:
    """reprs [..., D] scaled to unit length along D, in their dtype (profile repr_normalise)."""
    return reprs / reprs.float().norm(dim=-1, keepdim=True).clamp_min(1e-12).to(reprs.dtype)


def representative_keys(keys: Tensor, mass: Tensor, lengths: Tensor, topk: int, width: int | None = None,
                        rows: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Per event and query head, the mean pre-RoPE key of the `topk` tokens that drew most attention.

    keys: [H_kv, n, D] tokens of consecutive events; mass: [H_q, n] accumulated attention;
    lengths: [e] with sum == n (width: their largest, if known; rows: their `event_rows`, if made).
    Returns [e, H_q, D]. GQA keys are expanded to query heads.
    """
    h_kv, n, d = keys.shape
    h_q = mass.shape[0]
    e = lengths.numel()
    idx, valid = event_rows(lengths, n, width) if rows is None else rows
    width = idx.shape[1]
    m = mass[:, idx].masked_fill(~valid, float("-inf"))  # [H_q, e, width]
    k = min(topk, width)
    top = m.topk(k, dim=-1)  # [H_q, e, k]
    picked = torch.gather(idx.expand(h_q, e, width), 2, top.indices)  # [H_q, e, k] token index
    ok = torch.isfinite(top.values).to(keys.dtype)  # events shorter than k: fewer picks
    kv_head = torch.arange(h_q, device=keys.device) // (h_q // h_kv)
    gathered = keys[kv_head[:, None, None], picked]  # [H_q, e, k, D]
    summed = (gathered * ok[..., None]).sum(2)  # [H_q, e, D]
    return (summed / ok.sum(2, keepdim=True)).transpose(0, 1).contiguous()


@dataclass(frozen=True)
class EventGroups:
    """Consecutive events' token rows grouped by size, for `mean_keys`: events of up to 8 tokens
    padded to 8, up to 16 to 16, and so on (powers of two), so the grid is at most about twice the
    tokens, where one width for all (the longest event's) made it many times them; the longest
    events may keep that width (`event_groups`). Made once a step from the sizes on the host,
    shared by every layer closing these events."""

    n: int  # the events' tokens
    parts: list[Tensor]  # per group [e_g, width_g] token rows, padding pointing at row n (a zero row)
    order: Tensor | None  # [e] where each event's sum lies in the groups' concatenation; None: in order


def event_groups(lengths: Sequence[int] | np.ndarray, device: torch.device | str = "cpu") -> EventGroups:
    """`EventGroups` of consecutive events of these sizes (on the host: no device read)."""
    sizes = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    n = int(sizes.sum())
    width = np.maximum(8, 1 << np.ceil(np.log2(np.maximum(sizes, 1))).astype(np.int64))  # [e]
    # The bits of one grid as wide as the longest event (w), as stores were written before the
    # groups: torch's CPU sum takes the rows past the last multiple of 4 apart, so an event
    # reaching past 4 * (w // 4) is summed at width w; the others come out the same bits at any
    # width that is a multiple of 4 (tests/test_surprise_memory.py, tests/test_old_stores.py).
    longest = int(sizes.max()) if sizes.size else 0
    width[sizes > 4 * (longest // 4)] = longest
    parts, at = [], []
    for w in np.unique(width):
        ev = np.flatnonzero(width == w)
        col = np.arange(w)
        rows = np.where(col[None, :] < sizes[ev, None], starts[ev, None] + col[None, :], n)  # [e_g, w]
        parts.append(torch.from_numpy(rows).to(device))
        at.append(ev)
    order = np.argsort(np.concatenate(at), kind="stable")  # event i's sum is at order[i]
    in_order = bool((order == np.arange(order.size)).all())
    return EventGroups(n, parts, None if in_order else torch.from_numpy(order).to(device))


def mean_keys(keys: Tensor, lengths: Tensor, heads: int, groups: EventGroups | None = None) -> Tensor:
    """Per event, the mean pre-RoPE key of all its tokens, per KV head.

    keys: [..., H_kv, n, D] tokens of consecutive events (leading dims: several layers' at once,
    each the bits it gets alone); lengths: [e] with sum == n (groups: their `event_groups`, where
    made). Returns [..., e, heads, D] in the keys' dtype (summed in float32 along each event's own
    tokens, in order, then zeros up to its group's width: the bits of one grid as wide as the
    longest event, as stores were written before the groups);
    heads: H_kv, or H_q (each KV head's mean repeated for its query heads, as stores before
    version 7 keep them).
    """
    *lead, h_kv, n, d = keys.shape
    if groups is None:
        groups = event_groups(lengths.tolist(), keys.device)
    wide = torch.cat((keys.float(), keys.new_zeros(*lead, h_kv, 1, d, dtype=torch.float32)), -2)  # row n: zeros
    sums = [wide[..., rows, :].sum(-2) for rows in groups.parts]  # [..., H_kv, e_g, D]
    sums = sums[0] if len(sums) == 1 else torch.cat(sums, -2)
    if groups.order is not None:
        sums = sums.index_select(-2, groups.order)  # [..., H_kv, e, D]
    means = (sums / lengths.to(sums.dtype)[:, None]).to(keys.dtype)  # (float32 lengths: no cast)
    if heads != h_kv:  # (a repeat of 1 would still copy)
        means = means.repeat_interleave(heads // h_kv, dim=-3)
    return means.transpose(-3, -2).contiguous()


def update_contiguity(queue: Tensor, selected: Tensor, lengths: Tensor, neighbours: int, budget: int) -> Tensor:
    """Contiguity buffer (spec §4): a queue of event ids, oldest first.

    The neighbours (±1..±neighbours) of the selected events that are neither selected nor queued
    join at the back, in id order; then the oldest entries are dropped until the queue's tokens fit
    in `budget`. Entries stay while they fit, even when no longer next to a selected event.
    queue, selected: long [q], [k]; lengths: [E] all events' sizes. Returns the new queue.
    """
    n_events = lengths.numel()
    if selected.numel() and neighbours > 0:
        off = torch.cat((torch.arange(-neighbours, 0), torch.arange(1, neighbours + 1))).to(selected.device)
        cand = torch.unique((selected[:, None] + off).flatten())  # sorted
        cand = cand[(cand >= 0) & (cand < n_events)]
        cand = cand[~torch.isin(cand, selected) & ~torch.isin(cand, queue)]
        queue = torch.cat((queue, cand))
    if queue.numel() == 0:
        return queue
    # Keep the newest suffix whose tokens fit.
    from_back = torch.cumsum(lengths[queue].flip(0), 0).flip(0)  # tokens of entries i..end
    return queue[from_back <= budget]
