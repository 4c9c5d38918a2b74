"""One layer's events, backed by a store's files: the `EventMemory` interface on disk."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from emllm.config import Profile
from emllm.memory import prune, quant, sketch
from emllm.memory.cache import EventCache, runs
from emllm.memory.buffers import GrowBuffer, token_index
from emllm.memory.resident import CachedEvents, Codec, ResidentEvents, device_budget
from emllm.memory.selection import Selection, scores_in_blocks, select_events, token_scores
from emllm.store.errors import StoreError
from emllm.store.rows import finite, mappable, _BY_NAME, RowFile

if TYPE_CHECKING:
    from emllm.store.store import Store


RESIDENT_BLOCK = 1 << 14  # events read into the resident keys at a time
RING_BUDGETS = 4  # a device's ring of rows holds at least this many retrievals' (n_mem tokens each)


def _before(idx: Tensor, n: int) -> bool:
    """Whether every row of idx [m] (increasing, host) is below n."""
    return idx.numel() == 0 or int(idx.numpy()[-1]) < n


def _finite_reprs(ev: "StoredEvents", x: Tensor) -> Tensor:
    """Representative keys as read (once, into the resident ones), or the scores of those read at
    every step, refused where one is not finite. (Keys and values need no check of their own: what
    is not finite in them reaches the step's logits, which the engine checks.)"""
    if not finite(x):
        raise StoreError(f"{ev.store.path}: layer {ev.layer}'s representative keys are not finite: the store is "
                         "damaged or was edited; it is refused")
    return x


# -- the event memory of one layer, backed by the store --------------------------------------------
class StoredEvents:
    """`EventMemory` for one layer whose keys, values and representative keys live in the store's files.

    What stays resident grows with the store only up to a bound:
    - retrieval holds every event's representative key (bfloat16 as a bfloat16 store keeps it,
      float32 otherwise) while they fit in the profile's `repr_cache_mb` (all layers; 1,152 or
      2,304 bytes an event a layer for SmolLM2): one matrix-vector
      product estimates every score, and only the events that can be selected are scored exactly
      (`memory.prune`: the same selection as the scan). Past it, every event's key is scored
      exactly at every step, reading `layers/NN.r` a block at a time into one reused buffer
      (pread, from the page cache once warm); a reader of a store with a sketch scans the
      sketches instead and scores exactly only the events that can be selected (the same
      selection; only past `repr_cache_mb`: below it the resident keys' bound is far tighter);
    - keys and values are read per step for the retrieved events only (the engine's layers keep
      the last step's and ask only for the others): from the files (`RowFile.take`: pread,
      nothing mapped), or from an `EventCache` of the events read last where the profile's
      `kv_cache_mb` (or `--kv-cache-mb`) gives it RAM (none by default: the page cache serves).
    A read-only store (asking) keeps events closed after opening in RAM instead, so asking never
    changes the files. No faiss graph over a store: it would need RAM and upkeep per event.
    """

    def __init__(self, store: "Store", slot: int, kv_cache_mb: int | None = None) -> None:
        """slot: which of the store's layers with memory (`Geometry.with_memory`; every layer but a
        mixed model's sliding ones); kv_cache_mb: RAM of the event cache, all layers together
        (None: the store's profile's)."""
        self.store, self.slot = store, slot
        self.layer = store.geometry.with_memory[slot]  # the model's index, named in errors
        g = store.geometry
        dt = self.dtype = _BY_NAME[g.dtype][0]  # the compute dtype: keys and values are decoded to it
        self.fmt = store.kv_format  # how the files keep them (emllm.memory.quant)
        self.row = (g.kv_heads, g.head_dim)
        self.repr_heads = store.repr_heads  # rows of a representative key: KV heads (version 7) or query heads
        self.dim = self.repr_heads * g.head_dim
        self.k, self.v, self.r = store.layer_files[slot]
        # A reader of a store that has a sketch, once its keys exceed repr_cache_mb, scores the
        # sketches, then exactly only the events that can be selected (core/memory/sketch.py); a
        # writer always scans (its selections are part of the bytes it writes, so they must not
        # depend on when the sketch was fitted).
        self.sketch: tuple[RowFile, RowFile, Tensor, Tensor] | None = None  # coords, norms, mean, basis
        if store.sketch_files is not None and not store.writable:
            p, nrm = store.sketch_files[slot]
            self.sketch = (p, nrm, *store.sketch_basis(slot))
        self.lengths = GrowBuffer((0,), 0, torch.long, torch.device("cpu"))
        self.starts = GrowBuffer((0,), 0, torch.long, torch.device("cpu"))
        lengths = store.events.read().long()
        # A version-5 store's files hold every token from the stream's first, which `add_tokens`
        # writes as the engine reads them; events begin after the initial tokens. Before, the
        # files held the events' tokens only, written as they closed.
        self.all_tokens = store.all_tokens
        self.base = store.manifest["profile"].get("n_init", 0) if self.all_tokens else 0
        if lengths.numel():
            self.lengths.append(lengths)
            self.starts.append(torch.cumsum(lengths, 0) - lengths + self.base)
        self.event_end = self.base + int(lengths.sum())  # the row after the last event's
        self.n_disk = self.k.rows  # token rows in the files
        self.lossless = self.fmt.row_dtype == dt
        self.ram_k = GrowBuffer((0, g.kv_heads, g.head_dim), 0, dt, torch.device("cpu"))
        self.ram_v = GrowBuffer((0, g.kv_heads, g.head_dim), 0, dt, torch.device("cpu"))
        # (an integer store's reader) the same rows as the files would keep them, for a device's copy
        self.encoded_resident = self.fmt.bits is not None and self.all_tokens
        if self.encoded_resident:
            self.ram_rk = GrowBuffer((0, *self.fmt.row(*self.row)), 0, torch.uint8, torch.device("cpu"))
            self.ram_rv = GrowBuffer((0, *self.fmt.row(*self.row)), 0, torch.uint8, torch.device("cpu"))
        # a reader's own events' representative keys, as the file's rows (decoded as they are read)
        self.ram_r = GrowBuffer((0, *self.r.row), 0, self.r.dtype, torch.device("cpu"))
        mb = store.manifest["profile"].get("kv_cache_mb", Profile.kv_cache_mb) if kv_cache_mb is None else kv_cache_mb
        cap = (mb << 20) // (len(g.with_memory) * 2 * g.kv_heads * g.head_dim * dt.itemsize)  # tokens per layer
        # A ring smaller than one step's retrieval would only churn: no cache then.
        n_mem = store.manifest["profile"].get("n_mem", 0)
        self.cache = EventCache(cap, self.row, dt) if cap > 0 and cap >= n_mem else None
        # A reader indexes the files' maps (`RowFile.rows_at`): a step gathers its whole selection in
        # one copy, while the store's keys and values fit the page cache (`mappable`). A writer
        # reads with pread and its window keeps the last step's events: its resident memory stays
        # its own however long the stream (a 1M-token ingest); so does a reader of a larger store.
        kv_bytes = 2 * len(g.with_memory) * self.k.rows * self.k.row_bytes
        self.random_access = not store.writable and self.cache is None and mappable(kv_bytes)
        # The same for what a reader's sketched selection reads at every step: the sketches, and
        # the representative keys it scores exactly (scattered rows): one index of a map instead of
        # a pread per run (docs/benchmark-log.md, the store at scale).
        sketch_files = self.sketch[:2] if self.sketch is not None else ()  # coords, norms
        retrieval_bytes = sum(f.rows * f.row_bytes for f in (self.r, *sketch_files))
        self.retrieval_mapped = not store.writable and mappable(len(g.with_memory) * retrieval_bytes)
        # A writer's window computes each step as the same stream resumed from its files would
        # (no window kept rotated across tokens: LayerWindow.forward)
        self.writer = store.writable
        # Every event's representative key, read once (within repr_cache_mb): a selection is
        # then one mv and a few exact scores (`memory.prune`), not a scan of the file.
        mb = store.manifest["profile"].get("repr_cache_mb", Profile.repr_cache_mb)
        # As the store holds them: a half format's rows stay half (widened exactly when scored;
        # half the RAM of float32, and a question's first token sooner, for a generated token a
        # little slower: docs/benchmark-log.md); integer rows decoded to float32.
        rdt = self.r.dtype if self.fmt.reprs.bits is None else torch.float32
        self.resident_cap = (mb << 20) // (len(g.with_memory) * self.dim * rdt.itemsize)  # events per layer
        self.resident = GrowBuffer((0, self.dim), 0, rdt, torch.device("cpu"))
        self.resident_norms = GrowBuffer((0,), 0, torch.float32, torch.device("cpu"))
        self.score_dtype = rdt
        # every event's rows on the device a step runs on, while they fit its budget; past it, the
        # representative keys there and a ring of rows (`on_device`)
        self.on_dev: ResidentEvents | None = None
        self.on_dev_cap = 0  # bytes this layer's copy may take
        self.on_dev_refused = False  # (too large once: the host path from then on)
        self.pending_tokens = 0  # token rows a device step has deferred (`Store.defer`), not yet written

    def __len__(self) -> int:
        return self.lengths.n

    def mark(self) -> tuple[int, int, int]:
        """(events, tokens in RAM, end of the last event) now: what `truncate` comes back to."""
        self.store.flush_deferred()
        return self.lengths.n, self.ram_k.n, self.event_end

    def truncate(self, mark: tuple[int, int, int]) -> None:
        """Forget the events a reader closed in RAM after `mark` (the files are never changed)."""
        events, ram_tokens, event_end = mark
        self.store.flush_deferred()
        if self.store.writable:
            raise ValueError("a writer's events are in the store's files: they are not truncated")
        if events < self.r.rows or events > self.lengths.n:
            raise ValueError("a mark of another memory")
        self.lengths.n = self.starts.n = events
        self.resident.n = self.resident_norms.n = min(self.resident.n, events)
        self.ram_r.n = events - self.r.rows
        self.ram_k.n = self.ram_v.n = ram_tokens
        if self.encoded_resident:
            self.ram_rk.n = self.ram_rv.n = ram_tokens
        self.event_end = event_end
        if self.on_dev is not None:
            self.on_dev.truncate(events, event_end - self.base, self.n_tokens - event_end)
        if self.n_tokens == 0:  # the next first rows fit the equaliser again, as a writer's would
            self.store.forget_equaliser(self.slot)
            self.on_dev = None  # (its decoder holds the old one: copied again when asked)

    @property
    def n_tokens(self) -> int:
        return self.n_disk + self.ram_k.n + self.pending_tokens

    def add_tokens(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values [H_kv, c, D] of tokens the engine reads, in stream order: a
        version-5 store keeps every token's (a reader in RAM). Returns them as stored and read back
        (the engine's window holds them so: a stream continued from the files computes the same)."""
        if not self.all_tokens:
            return keys, values
        if self._defers():  # (written at the step's end, with every layer's)
            if self.lossless:  # (kept as they are)
                self._defer_tokens(keys, values)
                return keys, values
            return self._defer_encoded(keys, values)
        k, v = self._put(keys.transpose(0, 1).cpu(), values.transpose(0, 1).cpu())
        if k is None:
            return keys, values
        return k.transpose(0, 1).to(keys.device), v.transpose(0, 1).to(values.device)

    def _defers(self) -> bool:
        """Whether a step's rows stay on the device until its end (`Store.defer`): where every event
        is there (`on_device`) and the format keeps them as they are, or the store keeps every
        token's rows (version 5 on), which the device then encodes and decodes itself (the same
        operations as the host's, `memory.quant`: the same bits)."""
        return self.on_dev is not None and (self.lossless or self.all_tokens)  # (lossless: a float format)

    def _defer_tokens(self, keys: Tensor, values: Tensor) -> None:
        """keys/values [H_kv, c, D] on the device, to `_put` at the step's end."""
        self.pending_tokens += keys.shape[1]

        def write(kv: list[Tensor]) -> None:
            self.pending_tokens -= kv[0].shape[0]
            self._put(kv[0], kv[1])

        self.store.defer(write, [keys.transpose(0, 1), values.transpose(0, 1)])

    def _defer_encoded(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """keys/values [H_kv, c, D] on the device, encoded there as `_put` encodes them (a writer's
        rows written at the step's end, a reader's decoded rows kept in RAM then); returns them
        decoded, on the device, as `add_tokens` does."""
        k, v = keys.transpose(0, 1), values.transpose(0, 1)  # [c, H_kv, D]
        eq = self.store.key_equaliser_on(self.slot, k)
        rk, rv = quant.encode_keys(self.fmt, k, eq), self.fmt.encode(v)
        dk, dv = quant.decode_keys(self.fmt, rk, eq, self.dtype), self.fmt.decode(rv, self.dtype)
        self.pending_tokens += k.shape[0]
        writer = self.store.writable

        def write(rows: list[Tensor]) -> None:
            self.pending_tokens -= rows[0].shape[0]
            if writer:
                self.k.append(rows[0])
                self.v.append(rows[1])
                self.n_disk += rows[0].shape[0]
            else:
                self.ram_k.append(rows[0])
                self.ram_v.append(rows[1])
                if self.encoded_resident:
                    self.ram_rk.append(rows[2])
                    self.ram_rv.append(rows[3])

        self.store.defer(write, [rk, rv] if writer else [dk, dv] + ([rk, rv] if self.encoded_resident else []))
        if self.on_dev is not None and self.on_dev.codec is not None:
            self.on_dev.push_tail(rk, rv)
        return dk.transpose(0, 1), dv.transpose(0, 1)

    def flush(self) -> None:
        """Write what a device step deferred (every layer's: one read back for the step)."""
        self.store.flush_deferred()

    def _put(self, k: Tensor, v: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """Append token rows k/v [n, H_kv, D] to the files (a writer) or RAM (a reader); returns
        them decoded, or (None, None) when the format keeps them as they are."""
        rk, rv = self.store.encode_keys(self.slot, k), self.fmt.encode(v)
        dk = dv = None
        if not self.lossless or not self.store.writable:
            dk, dv = self.store.decode_keys(self.slot, rk, self.dtype), self.fmt.decode(rv, self.dtype)
        if self.store.writable:
            self.k.append(rk)
            self.v.append(rv)
            self.n_disk += k.shape[0]
        else:  # as a writer would have stored them, and read back
            self.ram_k.append(dk)
            self.ram_v.append(dv)
            if self.encoded_resident:
                self.ram_rk.append(rk)
                self.ram_rv.append(rv)
        if self.on_dev is not None and self.on_dev.codec is not None:  # (a device's copy, the host's step)
            self.on_dev.push_tail(rk, rv)
        return (None, None) if self.lossless else (dk, dv)

    def append(self, keys: Tensor, values: Tensor, lengths: Tensor, reprs: Tensor) -> None:
        """Close events of these sizes over the next tokens: keys/values [H_kv, n, D] (a
        version-5 store has them from `add_tokens`), lengths [e], reprs [e, H_r, D]."""
        lengths = lengths if lengths.device.type == "cpu" else lengths.cpu()  # (the host's, from the stream)
        offsets = torch.cumsum(lengths, 0) - lengths + self.event_end
        self.event_end += int(lengths.numpy().sum())
        deferred = self._defers()
        if deferred:  # the reprs encoded on the device (a float format: a cast), written at the step's end
            if not self.all_tokens:
                self._defer_tokens(keys, values)
            rows = self.fmt.reprs.encode(reprs)
            self.store.defer(lambda r: (self.r if self.store.writable else self.ram_r).append(r[0]), [rows])
        else:
            if not self.all_tokens:
                self._put(keys.transpose(0, 1).cpu(), values.transpose(0, 1).cpu())
            rows = self.fmt.reprs.encode(reprs.cpu())
            if self.store.writable:
                self.r.append(rows)
            else:
                self.ram_r.append(rows)
        self.starts.append(offsets)
        self.lengths.append(lengths)
        dev = self.on_dev
        if dev is not None:
            if dev.bytes_after(keys.shape[1], lengths.numel()) > self.on_dev_cap:
                self.store.flush_deferred()  # (the host path and the ring read the files: everything written first)
                # outgrew the device: its rows read as they are selected (the ring made smaller as
                # the keys grow), else the host path from here
                if isinstance(dev, CachedEvents):
                    ring = self._ring_tokens(len(self), dev.row_bytes)
                    if ring is not None:
                        dev.resize_ring(ring)
                    else:
                        dev = None
                else:
                    dev = self._cached(dev, dev.device, dev.lengths.n)
                self.on_dev = dev
                self.on_dev_refused = dev is None
            if dev is not None:
                dev.append(keys, values, lengths, self._decoded(rows).reshape(-1, self.dim).to(self.score_dtype))

    def _repr_block(self, start: int, stop: int) -> Tensor:
        """Representative keys of events start..stop-1, [n, H_r * D] (the store's float dtype, or
        float32 decoded from integer rows)."""
        n_file = self.r.rows
        if stop <= n_file:
            x = self.r.read_block(start, stop)
        elif start >= n_file:
            x = self.ram_r.view()[start - n_file : stop - n_file]
        else:
            x = torch.cat((self.r.read_block(start, n_file), self.ram_r.view()[: stop - n_file]))
        return self._decoded(x).reshape(stop - start, self.dim)

    def _decoded(self, rows: Tensor) -> Tensor:
        """Rows of `layers/NN.r` as keys: a float format's as they are, an integer one's decoded."""
        return rows if self.fmt.reprs.bits is None else self.store.reprs_of(rows)

    def repr_keys(self) -> Tensor:
        """[E, H_r, D] float32, all of them (for inspection and tests: reads the whole file)."""
        return torch.cat((self._decoded(self.r.read()).float(), self._decoded(self.ram_r.view()).float()))

    def select(self, query: Tensor, budget: int) -> Selection:
        """As `EventMemory.select` on the exact path, bit for bit (a score depends on its row alone)."""
        if len(self) == 0 or budget <= 0:
            return select_events(torch.zeros(0), self.event_lengths(), 0)
        if self._sketched():
            return self._select_sketched(query.cpu(), budget)
        q = query.cpu()
        n = min(len(self), self.resident_cap)
        # the events past what stays resident are scanned from the file (exact scores), the rest
        # estimated from RAM: the scan's selection either way
        tail = None if n == len(self) else _finite_reprs(self, scores_in_blocks(
            len(self) - n, self.dim, lambda a, b: self._repr_block(n + a, n + b), q))
        return prune.select(self._resident_rows(n), self.resident_norms.view(), q, self.event_lengths(), budget, tail)

    def token_scores(self, queries: Tensor) -> Tensor:
        """Every event's exact score for each query [T, H_r, D] -> [T, E] float32, on the host:
        each row the bits the scan gives (a question's chunk: `selection.TOKEN_SCORINGS`)."""
        if self.on_dev is not None and self.on_dev.device == queries.device:
            return self.on_dev.token_scores(queries)
        n = len(self)
        # the resident keys where a selection keeps them; else the file's, read once for all T
        rows = self._resident_rows(n) if n <= self.resident_cap else self._repr_block(0, n)
        return _finite_reprs(self, token_scores(n, self.dim, lambda a, b: rows[a:b], queries.cpu()))

    def _sketched(self) -> bool:
        """Whether a selection goes through the sketch: a reader's, once its events' keys no longer
        all fit in `repr_cache_mb`. Below that the resident keys' product and its tight bound
        leave far fewer exact scores a layer than the sketch's bound (docs/benchmark-log.md); a
        question reads every key either way."""
        return self.sketch is not None and len(self) > self.resident_cap

    def _resident_rows(self, n: int) -> Tensor:
        """[n, H_r * D]: the first n events' representative keys (as the store holds them, or
        float32 decoded from integers), the new ones read in."""
        if n - self.resident.n > RESIDENT_BLOCK:  # a first question reads them all: one allocation, with
            room = n + max(256, n >> 4)  # room for the events a conversation closes in RAM
            self.resident.reserve(room)
            self.resident_norms.reserve(room)
        for a in range(self.resident.n, n, RESIDENT_BLOCK):
            b = min(n, a + RESIDENT_BLOCK)
            x = _finite_reprs(self, self._repr_block(a, b).to(self.resident.buf.dtype))
            self.resident.append(x)
            self.resident_norms.append(prune.norms_up(x))
        return self.resident.view()

    def _select_sketched(self, query: Tensor, budget: int) -> Selection:
        """The scan's selection, reading a few events' keys: exact scores for the best-sketched
        events and the events without a sketch (a reader's own), then for every other event whose
        bound reaches the score where the selection stops (`sketch.exact_selection`)."""
        p, nrm, mean, basis = self.sketch
        n_s = p.rows
        if self.retrieval_mapped:  # (a reader: the maps' pages, no copy through a read call)
            coords, norms = p.read(0, n_s), nrm.read(0, n_s)
            block = lambda a, b: coords[a:b]  # noqa: E731
        else:
            block, norms = p.read_block, nrm.read_copy(0, n_s)
        est = sketch.estimate(n_s, block, query, mean, basis)  # [n_s]
        ub = sketch.upper_bound(est, norms, query, mean, basis)
        return sketch.exact_selection(est, ub, self.event_lengths(), budget,
                                      lambda ids: self._exact_scores(ids, query), torch.arange(n_s, len(self)))

    def _exact_scores(self, ids: Tensor, query: Tensor) -> Tensor:
        """Scores of events ids [m] (increasing; files, then a reader's RAM) -> [m]."""
        disk = ids[ids < self.r.rows]
        rows = self.r.rows_at(disk) if self.retrieval_mapped else self.r.take(disk)
        if disk.numel() < ids.numel():
            rows = torch.cat((rows, self.ram_r.view()[ids[disk.numel() :] - self.r.rows]))
        rows = _finite_reprs(self, self._decoded(rows).reshape(ids.numel(), self.dim))
        return scores_in_blocks(ids.numel(), self.dim, lambda a, b: rows[a:b], query)

    def event_lengths(self) -> Tensor:
        return self.lengths.view()

    def on_device(self, device: torch.device) -> bool:
        """Whether a step on `device` scores, selects and gathers there: every event's rows there
        (copied at the first step that asks, kept there as events close) while they fit its budget
        (`resident.device_budget`, shared by the layers); past it the representative keys there
        and the rows of the events selected lately (`resident.CachedEvents`), while the keys and
        a ring of a few budgets' rows fit; past that, the host path: rows read from the files for
        each selection."""
        if self.on_dev is None and not self.on_dev_refused:
            self.on_dev = self._copy_to(device)
            self.on_dev_refused = self.on_dev is None
        return self.on_dev is not None and self.on_dev.device == device

    def _copy_to(self, device: torch.device) -> ResidentEvents | None:
        g = self.store.geometry
        codec = None
        if self.encoded_resident:  # (kept encoded there: `resident.Codec`)
            self.store.flush_deferred()
            eq = self.store.key_equaliser(self.slot) if self.n_tokens else None
            eq = None if eq is None else eq.to(device)
            fmt, dt = self.fmt, self.dtype
            codec = Codec(fmt.row(*self.row), lambda r: quant.decode_keys(fmt, r, eq, dt), lambda r: fmt.decode(r, dt))
        dev = ResidentEvents(g.kv_heads, g.head_dim, self.dim, self.dtype, self.score_dtype, device, codec)
        tokens, events = self.event_end - self.base, len(self)
        self.on_dev_cap = device_budget(device) / len(g.with_memory)
        if dev.bytes_for(tokens, events) > self.on_dev_cap:
            return self._cached(dev, device, events)
        dev.keys.reserve(tokens + 1024)
        dev.values.reserve(tokens + 1024)
        for a in range(self.base, self.event_end, RESIDENT_BLOCK):
            idx = torch.arange(a, min(self.event_end, a + RESIDENT_BLOCK))
            if codec is not None:
                k, v = self._read_encoded(idx)
                dev.keys.append(k.to(device))
                dev.values.append(v.to(device))
                continue
            k, v = self._read(idx)
            dev.keys.append(k.transpose(0, 1).to(device))
            dev.values.append(v.transpose(0, 1).to(device))
        if codec is not None and self.n_tokens > self.event_end:  # the tokens read since the last event
            dev.push_tail(*self._read_encoded(torch.arange(self.event_end, self.n_tokens)))
        for a in range(0, events, RESIDENT_BLOCK):
            dev.reprs.append(_finite_reprs(self, self._repr_block(a, min(events, a + RESIDENT_BLOCK))).to(device, self.score_dtype))
        dev.lengths.append(self.lengths.view().to(device))
        return dev

    def _cached(self, dev: ResidentEvents, device: torch.device, events: int) -> CachedEvents | None:
        """The first `events` events as representative keys on `device` and a ring of rows: those of
        `dev` where it holds them (a full copy that outgrew), else read from the files. The ring
        takes what the budget leaves beside twice the keys (room to grow); None where that is
        less than `RING_BUDGETS` retrievals' rows."""
        g = self.store.geometry
        ring = self._ring_tokens(len(self), dev.bytes_for(1, 0))  # (a token's key and value, as the copy keeps them)
        if ring is None:
            return None
        read = self._encoded_rows if dev.codec is not None else self._event_rows
        kv_dtype = self.dtype
        if events and dev.lengths.n == events:
            return CachedEvents.from_resident(dev, g.kv_heads, g.head_dim, kv_dtype, self.lengths.view()[:events], ring, read)
        out = CachedEvents(g.kv_heads, g.head_dim, self.dim, kv_dtype, self.score_dtype, device, dev.codec, ring, read)
        for a in range(0, events, RESIDENT_BLOCK):
            b = min(events, a + RESIDENT_BLOCK)
            out.append(None, None, self.lengths.view()[a:b],
                       _finite_reprs(self, self._repr_block(a, b)).to(device, self.score_dtype))
        return out

    def _ring_tokens(self, events: int, row_bytes: int) -> int | None:
        """Rows of a device's ring beside the keys of `events` events: what the budget leaves beside
        twice the keys (room to grow), at most the store's tokens; None where that is less than
        `RING_BUDGETS` retrievals' rows."""
        keys_bytes = 2 * events * (self.dim * self.score_dtype.itemsize + 8)
        ring = int(self.on_dev_cap - keys_bytes) // row_bytes
        n_mem = self.store.manifest["profile"].get("n_mem", 0)
        if ring < RING_BUDGETS * max(n_mem, 1):
            return None
        return min(ring, max(self.n_tokens, RING_BUDGETS * n_mem))

    def _event_rows(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Rows [sum, H_kv, D] of events ids [m] (increasing, host), as a step attends to them. Not
        flushed first: an event a step can select closed at an earlier step, whose end wrote it."""
        return self._read(self._token_rows(ids), flush=False)

    def _encoded_rows(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(an integer store's) `_event_rows` as the files keep them, [sum, *row] uint8."""
        return self._read_encoded(self._token_rows(ids), flush=False)

    def _token_rows(self, ids: Tensor) -> Tensor:
        """The token rows of events ids [m] (host), in order (numpy: no host tensor read as a scalar)."""
        i = ids.numpy()
        return torch.from_numpy(runs(self.starts.view().numpy()[i], self.lengths.view().numpy()[i]))

    def lengths_on(self, device: torch.device) -> Tensor:
        dev = self.on_dev
        return dev.lengths.view() if dev is not None and dev.device == device else self.lengths.view().to(device)

    def scores(self, query: Tensor) -> Tensor:
        """Every event's exact score for query [H_r, D] -> [E] float32 on the query's device
        (the scan's bits: on the device where the rows are there, else on the host)."""
        if self.on_dev is not None and self.on_dev.device == query.device:
            return self.on_dev.scores(query)
        return self.token_scores(query[None])[0].to(query.device)

    def gather_masked(self, mask: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
        """The events `mask` [E] selects, padded to `size` rows: from the device's copy, or
        gathered on the host (the mask read back)."""
        if self.on_dev is not None and self.on_dev.device == mask.device:
            return self.on_dev.gather_masked(mask, size)
        ids = mask.nonzero().flatten()
        k, v = self.gather(ids)
        n = k.shape[1]
        valid = torch.arange(size, device=k.device) < n
        pad = k.new_zeros(k.shape[0], size - n, k.shape[2])
        return torch.cat((k, pad), 1), torch.cat((v, pad), 1), valid

    def gather(self, ids: Tensor, prefetch: bool = False) -> tuple[Tensor, Tensor]:
        """Keys and values of events `ids`: [H_kv, n, D] each, on the ids' device.

        Cached events are copied from the cache; the others are read (map or RAM) and the ones
        read from the files are cached. prefetch: a chunk's gather, whose rows a map asks the
        kernel for first (`RowFile.rows_at`)."""
        dev = ids.device
        ids = ids.cpu()
        starts, lengths = self.starts.view()[ids], self.lengths.view()[ids]
        if self.cache is None:
            k, v = self._read(token_index(starts, lengths), prefetch)
            return k.transpose(0, 1).to(dev), v.transpose(0, 1).to(dev)
        on_disk = starts + lengths <= self.n_disk  # an event is wholly in the files or wholly in RAM
        offsets = torch.full_like(ids, -1)
        offsets[on_disk] = self.cache.lookup(ids[on_disk])
        hit = offsets >= 0
        out_at = torch.cumsum(lengths, 0) - lengths  # each event's first row in the result
        total = int(lengths.sum())
        k = torch.empty((total, *self.row), dtype=self.dtype)
        v = torch.empty_like(k)
        if bool(hit.any()):  # copied out before inserting overwrites any of them
            rows = token_index(out_at[hit], lengths[hit])
            k[rows], v[rows] = self.cache.read(offsets[hit], lengths[hit])
        need = ~hit
        if bool(need.any()):
            k_new, v_new = self._read(token_index(starts[need], lengths[need]), prefetch)
            rows = token_index(out_at[need], lengths[need])
            k[rows], v[rows] = k_new, v_new
            fresh = need & on_disk
            if bool(fresh.any()):
                if bool(fresh[need].all()):
                    self.cache.insert(ids[fresh], lengths[fresh], k_new, v_new)
                else:
                    src = token_index(out_at[fresh], lengths[fresh])
                    self.cache.insert(ids[fresh], lengths[fresh], k[src], v[src])
        return k.transpose(0, 1).to(dev), v.transpose(0, 1).to(dev)

    def _read_encoded(self, idx: Tensor, flush: bool = True) -> tuple[Tensor, Tensor]:
        """(an integer store's) token rows idx [n] as the files keep them: [n, *row] uint8 each."""
        if flush:
            self.store.flush_deferred()
        if _before(idx, self.n_disk):
            return RowFile.take(self.k, idx), RowFile.take(self.v, idx)
        disk = idx < self.n_disk
        ram = idx[~disk] - self.n_disk
        k = torch.cat((RowFile.take(self.k, idx[disk]), self.ram_rk.view()[ram]))  # (files first: idx sorted)
        v = torch.cat((RowFile.take(self.v, idx[disk]), self.ram_rv.view()[ram]))
        return k, v

    def _read(self, idx: Tensor, prefetch: bool = False, flush: bool = True) -> tuple[Tensor, Tensor]:
        """Token rows idx [n] of the layer's events (files, then a reader's RAM): [n, H_kv, D] each."""
        if flush:
            self.store.flush_deferred()
        disk = idx < self.n_disk
        dec_k = lambda rows: self.store.decode_keys(self.slot, rows, self.dtype)  # noqa: E731
        dec_v = lambda rows: self.fmt.decode(rows, self.dtype)  # noqa: E731
        take = (lambda f, i: f.rows_at(i, prefetch)) if self.random_access else RowFile.take
        if _before(idx, self.n_disk):
            return dec_k(take(self.k, idx)), dec_v(take(self.v, idx))
        k = torch.empty((idx.numel(), *self.row), dtype=self.dtype)
        v = torch.empty_like(k)
        k[disk], v[disk] = dec_k(take(self.k, idx[disk])), dec_v(take(self.v, idx[disk]))
        ram = idx[~disk] - self.n_disk
        k[~disk], v[~disk] = self.ram_k.view()[ram], self.ram_v.view()[ram]
        return k, v