"""The context window of one attention layer (spec §1) and its bookkeeping.

A `LayerWindow` holds, for one layer, the parts that are not events yet: the initial tokens
(once evicted from the local window), the remainder (evicted, not yet closed into an event) and
the local window with the attention mass each of its tokens has drawn. Its `forward` is what the
registered attention function calls: retrieve, attend once over all parts, then slide the window.
Events themselves live in an `EventStorage` (`EventMemory` in RAM, or the on-disk store).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import Tensor

from emllm.math.attention import attend
from emllm.engine.rotated import RotatedWindow
from emllm.memory.buffers import SlidingRows, token_index
from emllm.memory.events import EventStorage
from emllm.memory.selection import (
    TOKEN_SCORINGS, Selection, event_groups, event_rows, fold_query, mean_keys, representative_keys, select_events,
    select_events_mask, unit_keys, update_contiguity,
)

# Whether a step selects and gathers its events on the device, padded to the budget, reading
# nothing back to the host (events in the device's memory, no contiguity buffer). None: on every
# device but the CPU, where the host's selection (numpy) costs less than torch's operations and
# reading back costs nothing.
DEVICE_STEP: bool | None = None
from emllm.math.rope import rotate


@dataclass
class StepInfo:
    """What all layers share during one forward: the rotary table and the window geometry."""

    cos: Tensor  # [>= window length, rotary_dim]
    ssin: Tensor  # the sin table signed as `rope.rotate` takes it (`rope.signed_sin`)
    n_local: int
    n_init: int
    budget: int  # similarity-buffer budget in tokens
    contiguity_budget: int = 0  # tokens of the contiguity buffer (0: none)
    neighbours: int = 1
    centering: float = 0.0  # share of the running mean query taken from each query (profile query_centering)
    keep_mean: bool = False  # whether the running mean query is kept (the profile centres at some point)
    # (layer, selection, query as scored: [H_r, D], or [T, H_r, D] a question's tokens')
    on_retrieval: Callable[[int, Selection, Tensor], None] | None = None
    mass: bool = True  # whether the window's attention mass is computed (representative keys need it)
    token_slack: int = 0  # steps of one token keep the window rotated (`RotatedWindow`) with this room (0: never)
    # a question's chunk: each token scores every event, combined as profile question_scoring says
    # ("max", "lse": `selection.TOKEN_SCORINGS`); None: the chunk's mean query scores them
    token_scoring: str | None = None
    # [E] group labels of the events for a question's token scoring (`memory.distinct`): identical
    # events take one place in its selection (profile distinct_events); None: every event competes
    groups: Tensor | None = None
    # cos/signed sin [>= window, rotary_dim] of the sliding-window layers of a model that mixes them with
    # global ones (their own rope base: Gemma 3); None: the model has none
    sliding_rope: tuple[Tensor, Tensor] | None = None
    # keep this step's memory (the events retrieved, gathered) for the answer to come: a question's chunk
    keep_memory: bool = False
    # attend to the memory the last keeping step retrieved instead of retrieving (a generated answer's
    # token, profile answer_retrieval "question"); a layer that kept none retrieves
    reuse_memory: bool = False
    # (start, queries, device) -> the query tables of `query_rope`, made once for all layers
    _query_rope: dict = field(default_factory=dict, repr=False)

    def query_rope(self, start: int, c: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos/signed sin [2, 1, c, rotary_dim]: the window's positions start..start + c - 1, then
        the memory's (n_local - 1) for every query: a chunk's queries rotated both ways in one pass
        (`rotate` broadcasts), the tables made once per forward, not once per layer."""
        key = (start, c, device)
        if key not in self._query_rope:
            p = self.n_local - 1
            self._query_rope[key] = tuple(
                torch.stack((t[start : start + c], t[p : p + 1].expand(c, -1))).to(device)[:, None]
                for t in (self.cos, self.ssin))
        return self._query_rope[key]


class _Rows:
    """A layer's rows [H, n, ...] held in `SlidingRows` under `slot`: reading gives their view
    (valid until the next append), assigning holds a copy of the tensor given."""

    def __init__(self, slot: str) -> None:
        self.slot = slot

    def __get__(self, obj: object, owner: type | None = None) -> Tensor:
        return self if obj is None else getattr(obj, self.slot).view()  # type: ignore[return-value]

    def __set__(self, obj: object, t: Tensor) -> None:
        setattr(obj, self.slot, SlidingRows(t))


@dataclass
class LayerWindow:
    layer_idx: int
    n_kv_heads: int
    n_q_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    events: EventStorage  # this layer's events: in RAM, or the store's (given, never built here)
    n_seen: int = 0  # tokens of the stream this layer has processed

    def __post_init__(self) -> None:
        z = lambda *s, dt=self.dtype: torch.zeros(*s, dtype=dt, device=self.device)  # noqa: E731
        h, d = self.n_kv_heads, self.head_dim
        self.init_k, self.init_v = z(h, 0, d), z(h, 0, d)
        self.local_k, self.local_v = z(h, 0, d), z(h, 0, d)
        self._rw: RotatedWindow | None = None  # the window rotated for steps of one token (none yet)
        self.local_mass = z(self.n_q_heads, 0, dt=torch.float32)
        self.rem_k, self.rem_v = z(h, 0, d), z(h, 0, d)
        self.rem_mass = z(self.n_q_heads, 0, dt=torch.float32)
        self.contiguity = torch.zeros(0, dtype=torch.long, device=self.device)  # event ids, oldest first
        # every retrieval query so far (one per step), summed: the running mean query
        self.query_sum = z(self.n_q_heads, self.head_dim, dt=torch.float32)
        self.query_n = 0
        # the last retrieval's events (sorted ids) and their keys and values [H_kv, n, D]: the
        # next step reads only the events it did not have (an event's rows never change)
        self._held: tuple[Tensor, Tensor, Tensor] | None = None
        # the memory a question's last chunk retrieved (keys, values, valid as `attend` takes them;
        # the rows [H_kv, n, D] of the events closed since, as they left the window), which a
        # generated answer's tokens attend to (StepInfo.reuse_memory)
        self._kept: tuple[Tensor, Tensor, Tensor | None, list[tuple[Tensor, Tensor]]] | None = None

    # the local window's and the remainder's keys and values live in sliding buffers: a step
    # appends the window's rows and drops the evicted ones, which join the remainder, and a closed
    # event's rows leave it, all without copying what stays (a closed event's rows, views, are
    # never written again); these are views of them
    local_k, local_v, rem_k, rem_v = _Rows("_lk"), _Rows("_lv"), _Rows("_rk"), _Rows("_rv")

    _STATE = ("init_k", "init_v", "local_k", "local_v", "local_mass", "rem_k", "rem_v", "rem_mass", "contiguity",
              "query_sum")

    def state(self) -> dict[str, Tensor]:
        """The tensors that continue this layer's stream (events excluded: they are in `events`)."""
        own = lambda t: t.clone(memory_format=torch.contiguous_format)  # noqa: E731 (views of buffers a step overwrites)
        return {**{name: own(getattr(self, name)) if name.startswith(("local", "rem")) else getattr(self, name)
                   for name in self._STATE},
                "n_seen": torch.tensor(self.n_seen),
                "query_n": torch.tensor(self.query_n)}

    def load_state(self, state: dict[str, Tensor]) -> None:
        """Continue from `state` (read from a store: its shapes are checked first, ValueError)."""
        h, hq, d = self.n_kv_heads, self.n_q_heads, self.head_dim
        for part in ("init", "local", "rem"):
            k, v = state.get(f"{part}_k"), state.get(f"{part}_v")
            if k is None or v is None or k.ndim != 3 or k.shape[0] != h or k.shape[2] != d or v.shape != k.shape:
                raise ValueError(f"layer {self.layer_idx}: {part} keys/values of the wrong shape")
        for part in ("local", "rem"):
            m = state.get(f"{part}_mass")
            if m is None or tuple(m.shape) != (hq, state[f"{part}_k"].shape[1]):
                raise ValueError(f"layer {self.layer_idx}: {part} attention mass of the wrong shape")
        qs = state.get("query_sum")
        if qs is not None and (tuple(qs.shape) != (hq, d) or not bool(torch.isfinite(qs).all())):
            raise ValueError(f"layer {self.layer_idx}: query sum of the wrong shape, or not finite")
        if int(state.get("query_n", 0)) < 0:
            raise ValueError(f"layer {self.layer_idx}: a negative query count")
        c = state.get("contiguity")
        if c is not None and (c.ndim != 1 or c.dtype not in (torch.int64, torch.int32) or
                              (c.numel() and (int(c.min()) < 0 or int(c.max()) >= len(self.events)))):
            raise ValueError(f"layer {self.layer_idx}: contiguity names events the store does not hold")
        for name in self._STATE:
            if name in state:
                ref = getattr(self, name)
                setattr(self, name, state[name].to(ref.device, ref.dtype).contiguous())
        self.n_seen = int(state.get("n_seen", 0))
        self.query_n = int(state.get("query_n", 0))  # a store from before the key: no mean yet
        if "query_sum" not in state:
            self.query_sum = torch.zeros_like(self.query_sum)
        self._held = self._kept = None  # events may have been forgotten (a reader's truncate): ids name others
        self._rw = None  # (a window of other rows)

    # -- the attention call ------------------------------------------------------------------
    def forward(self, q: Tensor, k: Tensor, v: Tensor, scaling: float, st: StepInfo,
                softcap: float | None = None) -> Tensor:
        """q [H_q, c, D], k/v [H_kv, c, D], all pre-RoPE; st: what this forward's layers share;
        softcap: the model's cap on attention scores (Gemma 2), None: none.
        Returns [H_q, c, D]."""
        c = q.shape[1]
        # as the memory keeps them (a store's format may round them): the stream computes the same
        # whether it goes on in this process or from the store's files
        k, v = self.events.add_tokens(k, v)
        k_loc = self._lk.append(k)  # [H_kv, L, D] (a view: valid until the next step's append)
        v_loc = self._lv.append(v)
        length = k_loc.shape[1]
        # A generated token: the window stays rotated. Not in a store writer, whose stream must
        # compute the same bits when resumed from its files (where no rotated window is kept).
        if c == 1 and st.token_slack and not self.events.writer:
            rw = self._rw
            if rw is None or rw.full() or rw.rows != length - 1:
                # in the model's dtype, as the CPU's kernel takes it; in float32 where the joint
                # path widens it anyway (`attends_jointly`): widened once, not at every token
                wide = q.device.type != "cpu" or self._device_step(q, st)
                rw = self._rw = RotatedWindow(k_loc[:, :-1], v_loc[:, :-1], st.cos, st.ssin, st.token_slack,
                                              torch.float32 if wide else k_loc.dtype)
            at = rw.push(k, v, st.cos, st.ssin)
            k_rot, v_att = rw.view()
        else:
            self._rw = None  # (a chunk moves the window past what it holds)
            at = length - c
            k_rot, v_att = rotate(k_loc, st.cos[:length].to(q.device), st.ssin[:length].to(q.device)), v_loc

        q_mem = k_mem = v_mem = mem_valid = out_dtype = None
        has_memory = self.init_k.shape[1] or self.rem_k.shape[1] or len(self.events)
        if not has_memory:
            q_loc = rotate(q, st.cos[at : at + c].to(q.device), st.ssin[at : at + c].to(q.device))
        else:
            # the queries at their window positions, and at the memory's, which sits at one fixed
            # distance from every query (n_local - 1)
            both = rotate(q, *st.query_rope(at, c, q.device))  # [2, H_q, c, D]
            if q.device.type != "cpu" or self._device_step(q, st):
                # attention's joint path ahead (`attends_jointly`), which widens its queries to
                # float32: widened here, both at once, laid out for its products, one copy
                q_loc, q_mem = both.to(torch.float32, memory_format=torch.contiguous_format)
                out_dtype = q.dtype
            else:
                q_loc, q_mem = both
            parts_k, parts_v = [self.init_k], [self.init_v]
            # [H_q, D]: the mean of the model's dtype's queries; one query: itself (widened or not, the same bits scored)
            query = both[1].mean(1) if c > 1 else q_mem[:, 0]
            kept = self._kept if st.reuse_memory else None
            self._kept = None  # (held past this step only where it keeps it)
            if kept is not None:  # (nothing retrieved: the running mean query is left as it is)
                mk, mv, mem_valid, closed = kept
                if closed:
                    # events closed since (they left the window while answering) join it with the
                    # rows the window held, as if they had stayed there (nothing read from the store)
                    mk = torch.cat((mk, *(k.to(mk.dtype) for k, _ in closed)), 1)
                    mv = torch.cat((mv, *(v.to(mv.dtype) for _, v in closed)), 1)
                    if mem_valid is not None:
                        mem_valid = torch.cat((mem_valid, mem_valid.new_ones(sum(k.shape[1] for k, _ in closed))))
                self._kept = mk, mv, mem_valid, []
            elif len(self.events):
                # (summed over each group of query heads where the memory keeps a key per KV head)
                if st.token_scoring:  # [c, H_r, D]: every token's query, centred as the mean would be
                    scored = fold_query(self._centred(q_mem.transpose(0, 1), st.centering), self.events.repr_heads)
                else:
                    scored = fold_query(self._centred(query, st.centering), self.events.repr_heads)
                if self._device_step(q, st):
                    mk, mv, mem_valid = self._retrieve_on_device(scored, st)
                else:
                    ids = self.retrieve(scored, st.budget, st.on_retrieval, st.token_scoring, st.groups).ids
                    mk, mv = self._gather(self._with_contiguity(ids.to(self.contiguity.device), st), prefetch=c > 1)
                if st.keep_memory:
                    self._kept = mk, mv, mem_valid, []
            if kept is None and not len(self.events):
                parts_k.append(self.rem_k)
                parts_v.append(self.rem_v)
            elif mem_valid is not None:  # a selection padded to the budget goes last: its validity masks the memory's tail
                parts_k += [self.rem_k, mk]
                parts_v += [self.rem_v, mv]
            else:
                parts_k += [mk, self.rem_k]
                parts_v += [mv, self.rem_v]
            k_mem, v_mem = torch.cat(parts_k, 1), parts_v  # (the values joined with the window's by `attend`)
            if st.keep_mean and kept is None:  # (kept only when used: a store that does not centre writes zeros, as before)
                self.query_sum.add_(query)  # (widened in the add: exact, no copy made first)
                self.query_n += 1

        out, mass = attend(q_loc, k_rot, v_att, q_mem, k_mem, v_mem, scaling, st.mass, mem_valid, softcap, out_dtype)
        self._slide(k_loc, v_loc, mass, st)
        return out

    def _device_step(self, q: Tensor, st: StepInfo) -> bool:
        on = DEVICE_STEP if DEVICE_STEP is not None else q.device.type != "cpu"
        return on and not st.contiguity_budget and self.events.on_device(q.device)

    def _retrieve_on_device(self, query: Tensor, st: StepInfo) -> tuple[Tensor, Tensor, Tensor]:
        """`retrieve` and the gather, on the device: the events selected as a mask (every event
        scored exactly: the same selection as `retrieve`'s) and their rows padded to the budget:
        keys, values [H_kv, budget, D] and valid [budget]. A listener is told as by `retrieve`
        (its ids are read back: a listener inspects, it is not a step's hot path)."""
        raw = None
        if query.dim() == 3:
            raw = self.events.token_scores(query)  # [T, E]
            scores = TOKEN_SCORINGS[st.token_scoring or "max"](raw)
        else:
            scores = self.events.scores(query)
        mask = select_events_mask(scores, self.events.lengths_on(scores.device), st.budget, st.groups)
        if st.on_retrieval is not None:
            ids = mask.nonzero().flatten()
            st.on_retrieval(self.layer_idx, Selection(ids, scores[ids], raw), query)
        return self.events.gather_masked(mask, st.budget)

    def _with_contiguity(self, ids: Tensor, st: StepInfo) -> Tensor:
        """The selected events `ids` [k] (sorted) and the contiguity buffer's, after updating it."""
        if not st.contiguity_budget:
            return ids
        self.contiguity = update_contiguity(
            self.contiguity, ids, self.events.event_lengths().to(ids.device), st.neighbours, st.contiguity_budget,
        )
        extra = self.contiguity[~torch.isin(self.contiguity, ids)]
        return torch.sort(torch.cat((ids, extra))).values

    def _centred(self, query: Tensor, share: float) -> Tensor:
        """query [..., H_q, D] less `share` of the mean of the queries before it (none yet: as it is)."""
        if not share or not self.query_n:
            return query
        return query.float() - (share / self.query_n) * self.query_sum

    def _gather(self, ids: Tensor, prefetch: bool = False) -> tuple[Tensor, Tensor]:
        """Keys and values of events ids [k] (sorted), [H_kv, n, D] each, on the ids' device: the
        events the last step held are copied from what it held, only the others are read from
        the memory (a store reads on the host). The same rows in the same order as
        `events.gather(ids)`. A memory read by one index (in RAM, a reader's map) is simply indexed."""
        if self.events.random_access:
            return self.events.gather(ids, prefetch)
        held = self._held
        if held is not None and held[0].numel() == ids.numel() and bool(torch.equal(held[0], ids)):
            return held[1], held[2]
        if held is None or ids.numel() == 0 or held[0].numel() == 0:
            k, v = self.events.gather(ids, prefetch)
        else:
            old_ids, old_k, old_v = held
            at_old = torch.searchsorted(old_ids, ids).clamp_max_(old_ids.numel() - 1)  # both sorted
            keep = old_ids[at_old] == ids  # (isin, a sort-based op, cost far more here)
            new = ids[~keep]
            if new.numel() == ids.numel():
                k, v = self.events.gather(ids, prefetch)
            else:
                lengths = self.events.event_lengths().to(ids.device)
                n_k, n_v = self.events.gather(new, prefetch)
                old_len = lengths[old_ids]
                old_at = torch.cumsum(old_len, 0) - old_len  # each held event's first row
                new_len = lengths[new]
                new_at = torch.cumsum(new_len, 0) - new_len + old_k.shape[1]  # after the held rows
                src = torch.empty_like(ids)
                src[keep] = old_at[at_old[keep]]
                src[~keep] = new_at
                idx = token_index(src, lengths[ids])
                k = torch.cat((old_k, n_k), 1).index_select(1, idx)
                v = torch.cat((old_v, n_v), 1).index_select(1, idx)
        self._held = ids, k, v
        return k, v

    def retrieve(self, query: Tensor, budget: int,
                 on_retrieval: Callable[[int, Selection, Tensor], None] | None = None,
                 token_scoring: str | None = None, groups: Tensor | None = None) -> Selection:
        """query [H_r, D] (rotated at the memory position; H_r: the memory's representative heads)
        -> the events to attend to. query [T, H_r, D], a chunk's tokens': every event scored by
        each token, the scores combined by `token_scoring` ("max" unless given;
        `selection.TOKEN_SCORINGS`; exact, every event scored); with `groups` [E] identical
        events take one place (`select_events`)."""
        raw = None
        if query.dim() == 3:
            raw = self.events.token_scores(query)  # [T, E]
            sel = select_events(TOKEN_SCORINGS[token_scoring or "max"](raw), self.events.event_lengths(), budget, groups)
        else:
            sel = self.events.select(query, budget)
        if on_retrieval is not None:  # (a listener may score more than the events: the re-read's tail)
            on_retrieval(self.layer_idx, sel if raw is None else replace(sel, token_scores=raw), query)
        return sel

    # -- bookkeeping ---------------------------------------------------------------------------
    def _slide(self, k_loc: Tensor, v_loc: Tensor, mass: Tensor | None, st: StepInfo) -> None:
        """Keep the last n_local tokens; evicted ones go to the initial tokens or the remainder.

        mass [H_q, L]: attention drawn by each window token in this step, added to what it had;
        None: nothing reads it (mean representatives), and the mass buffers stay zeros, keeping
        their shapes and the state its format."""
        n_old = self.local_mass.shape[1]
        total_mass = mass  # (attend's own tensor)
        if mass is not None:
            total_mass[:, :n_old].add_(self.local_mass)
        c = k_loc.shape[1] - n_old
        self.n_seen += c
        n_out = max(0, k_loc.shape[1] - st.n_local)
        if n_out:
            first = self.n_seen - k_loc.shape[1]  # stream position of the window's first token
            to_init = max(0, min(n_out, st.n_init - first))
            if to_init:
                self.init_k = torch.cat((self.init_k, k_loc[:, :to_init]), 1)
                self.init_v = torch.cat((self.init_v, v_loc[:, :to_init]), 1)
            if n_out > to_init:
                self._rk.append(k_loc[:, to_init:n_out])
                self._rv.append(v_loc[:, to_init:n_out])
                if mass is None:
                    self.rem_mass = self._zeros(self.rem_k.shape[1])
                else:
                    self.rem_mass = torch.cat((self.rem_mass, total_mass[:, to_init:n_out]), 1)
        self._lk.drop_front(n_out)
        self._lv.drop_front(n_out)
        if self._rw is not None:
            self._rw.drop_front(n_out)
        if mass is None:
            self.local_mass = self._zeros(k_loc.shape[1] - n_out)
        else:
            self.local_mass = total_mass[:, n_out:]  # a view: the next step adds to it

    def _zeros(self, n: int) -> Tensor:
        """[H_q, n] float32 zeros: a view of one buffer (never written), grown as needed."""
        z = getattr(self, "_zero_mass", None)
        if z is None or z.shape[1] < n:
            z = self._zero_mass = torch.zeros(self.n_q_heads, max(n, 2 * (0 if z is None else z.shape[1]), 1024),
                                              dtype=torch.float32, device=self.device)
        return z[:, :n]

    def close(self, lengths: Tensor, n: int, reprs: Tensor, mean: bool) -> None:
        """Turn the first n remainder tokens into events of these sizes (lengths [e] long, on the
        host, summing to n), their representative keys `reprs` [e, H_r, D] (`close_events` makes
        them; `mean`: mean keys, which read no attention mass)."""
        keys, values = self.rem_k[:, :n], self.rem_v[:, :n]
        self.events.append(keys, values, lengths, reprs)
        if self._kept is not None:  # (views of rows the remainder's buffer never writes again)
            self._kept[3].append((keys, values))
        self._rk.drop_front(n)
        self._rv.drop_front(n)
        # (mean representatives: the mass stays zeros, a view of `_zeros`)
        self.rem_mass = self._zeros(self.rem_k.shape[1]) if mean else self.rem_mass[:, n:].contiguous()


def close_events(windows: list[LayerWindow], lengths: Tensor, repr_topk: int, normalise: bool = False,
                 mean: bool = False) -> None:
    """Every layer's first sum(lengths) remainder tokens become events of these sizes (lengths [e]
    long, on the host: the stream's segmentation, read there, not from a device). Their
    representative keys: the mean key of all their tokens when `mean`, else of the repr_topk
    that drew the most attention; scaled to unit length per head when `normalise`. What the
    layers share (the sizes on the device, their token rows) is made once a device, and mean keys
    are computed for the layers of a device and shape together: a few kernels a step, not a few a
    layer (each layer's the bits it gets alone)."""
    host = lengths.numpy() if lengths.device.type == "cpu" else lengths.cpu().numpy()
    n = int(host.sum())
    if n == 0:
        return
    groups: dict[tuple, list[LayerWindow]] = {}
    for w in windows:
        key = (w.rem_k.device, w.rem_k.dtype, w.rem_k.shape[0], w.rem_k.shape[2], w.events.repr_heads)
        groups.setdefault(key, []).append(w)
    for (dev, *_, heads), ws in groups.items():
        on_device = lengths.to(dev)
        if mean:
            keys = torch.stack([w.rem_k[:, :n] for w in ws])  # [layers, H_kv, n, D]
            reprs = mean_keys(keys, on_device.float(), heads, event_groups(host, dev))  # [layers, e, H_r, D]
        else:
            rows = event_rows(on_device, n, int(host.max()))
            reprs = torch.stack([representative_keys(w.rem_k[:, :n], w.rem_mass[:, :n], on_device, repr_topk, rows=rows)
                                 for w in ws])
        if normalise:
            reprs = unit_keys(reprs)
        for w, r in zip(ws, reprs):
            w.close(lengths, n, r, mean)
