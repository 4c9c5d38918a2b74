"""EventCache (core/memory/cache.py) against a brute-force ring written with Python lists, and the
store's gather with the cache against the same gather without it."""

from __future__ import annotations

import random

import torch

from emllm.memory.cache import EventCache


class RingRef:
    """The same policy, one event at a time: a run of events goes at the head, or at row 0 when
    it would pass the end; every cached event that shares a row with the run is evicted."""

    def __init__(self, cap: int) -> None:
        self.cap, self.head, self.at = cap, 0, {}  # event -> (offset, length)

    def insert(self, ids: list[int], lengths: list[int]) -> None:
        kept, total = [], 0
        for e, n in zip(ids, lengths):
            if total + n > self.cap:
                break
            kept.append((e, n))
            total += n
        if not kept:
            return
        start = self.head if self.head + total <= self.cap else 0
        rows = set(range(start, start + total))
        for e, (o, n) in list(self.at.items()):
            if rows & set(range(o, o + n)):
                del self.at[e]
        pos = start
        for e, n in kept:
            self.at[e] = (pos, n)
            pos += n
        self.head = pos % self.cap


def test_cache_equals_a_brute_force_ring_and_returns_the_right_rows():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    n_events = 60
    lengths = torch.randint(1, 9, (n_events,), generator=gen)
    starts = torch.cumsum(lengths, 0) - lengths
    data = torch.randn(int(lengths.sum()), 2, 3, generator=gen)  # the "files"
    for cap in (1, 7, 20, 64):
        cache, ref = EventCache(cap, (2, 3), torch.float32), RingRef(cap)
        for _ in range(200):
            ids = torch.tensor(sorted(rng.sample(range(n_events), rng.randint(1, 8))))
            off = cache.lookup(ids)
            hit = off >= 0
            want_hit = torch.tensor([int(e) in ref.at for e in ids])
            assert torch.equal(hit, want_hit)
            if bool(hit.any()):
                k, v = cache.read(off[hit], lengths[ids[hit]])
                rows = torch.cat([torch.arange(int(starts[e]), int(starts[e] + lengths[e])) for e in ids[hit]])
                assert torch.equal(k, data[rows]) and torch.equal(v, -data[rows])
            miss = ids[~hit]
            if miss.numel():
                rows = torch.cat([torch.arange(int(starts[e]), int(starts[e] + lengths[e])) for e in miss])
                cache.insert(miss, lengths[miss], data[rows], -data[rows])
                ref.insert(miss.tolist(), lengths[miss].tolist())
            cached = {int(e): (int(cache.where[e]), int(cache.size[e])) for e in range(cache.where.size) if cache.where[e] >= 0}
            assert cached == ref.at
            # the invariant: owner marks exactly the rows of cached events
            owner = torch.full((cap,), -1, dtype=torch.long)
            for e, (o, n) in cached.items():
                owner[o : o + n] = e
            assert torch.equal(torch.from_numpy(cache.owner), owner)
            assert sum(n for _, n in cached.values()) <= cap


def test_store_gather_with_the_cache_equals_the_rows_written(tmp_path, monkeypatch):
    """Through the cache, gather returns exactly the rows written (bit for bit), for a writer and
    for a reader with events of its own in RAM; the cache hits; 0 MiB turns it off. A reader
    without a cache (the default) reads the files' maps while they fit in memory, else by pread:
    the same rows."""
    from emllm.store import Geometry, Identity, Store, StoredEvents

    g = Geometry(layers=1, kv_heads=2, q_heads=2, head_dim=4, vocab=10, dtype="float32")
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    ks, vs, ls = [], [], []

    def fill(ev: StoredEvents, e: int) -> None:
        lengths = torch.randint(1, 9, (e,), generator=gen)
        k = torch.randn(2, int(lengths.sum()), 4, generator=gen)
        v = torch.randn(2, int(lengths.sum()), 4, generator=gen)
        ev.add_tokens(k, v)  # every token's rows as it is read, then the events over them
        ev.append(k, v, lengths, torch.randn(e, 2, 4, generator=gen))
        if ev.store.writable:
            ev.store.events.append(lengths.to(torch.int32))
        ks.append(k), vs.append(v), ls.append(lengths)

    def check(ev: StoredEvents, steps: int) -> None:
        k_all, v_all, lengths = torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(ls)
        starts = torch.cumsum(lengths, 0) - lengths
        for _ in range(steps):
            n = len(ev)
            ids = torch.tensor(sorted(rng.sample(range(n), rng.randint(1, min(12, n)))))
            rows = torch.cat([torch.arange(int(starts[e]), int(starts[e] + lengths[e])) for e in ids])
            k, v = ev.gather(ids)
            assert torch.equal(k, k_all[:, rows]) and torch.equal(v, v_all[:, rows])

    st = Store.create(tmp_path / "s", Identity("m", "c", "w", "t"), {"name": "t"}, g)
    assert StoredEvents(st, 0).cache is None  # the default: no cache
    ev = StoredEvents(st, 0, kv_cache_mb=128)
    assert ev.cache is not None and ev.cache.cap == (128 << 20) // (2 * 2 * 4 * 4)
    ev.cache = EventCache(40, ev.k.row, torch.float32)  # small: it fills and evicts
    fill(ev, 50)
    check(ev, 200)
    assert ev.cache.hit_tokens > 0 and ev.cache.miss_tokens > 0
    assert StoredEvents(st, 0, kv_cache_mb=0).cache is None
    n = ev.k.rows  # the stream these rows are of (a version-5 store keeps every token's)
    st.tokens.append(torch.zeros(n, dtype=torch.int32))
    st.surprise.append(torch.zeros(n))
    st.flags.append(torch.zeros(n, dtype=torch.uint8))
    st.commit({}, {})
    st.close()
    in_files = len(ks)
    with Store.open(tmp_path / "s") as rd:
        ev = StoredEvents(rd, 0)
        assert ev.random_access  # a reader without a cache indexes the files' maps
        ev.cache = EventCache(40, ev.k.row, torch.float32)
        ev.random_access = False
        fill(ev, 20)  # a reader's own events stay in RAM, never cached
        check(ev, 200)
        assert int((ev.cache.where[50:] >= 0).sum()) == 0
    del ks[in_files:], vs[in_files:], ls[in_files:]
    with Store.open(tmp_path / "s") as rd:  # the maps, then with events of its own in RAM too
        ev = StoredEvents(rd, 0)
        assert ev.random_access and ev.cache is None
        check(ev, 50)
        fill(ev, 20)
        check(ev, 200)
    del ks[in_files:], vs[in_files:], ls[in_files:]
    import emllm.store.rows as rows_mod

    assert rows_mod.mappable(0) and not rows_mod.mappable(1 << 62)
    monkeypatch.setattr(rows_mod, "MAP_SHARE", 0.0)  # a store larger than the memory: pread
    with Store.open(tmp_path / "s") as rd:
        ev = StoredEvents(rd, 0)
        assert not ev.random_access and ev.cache is None
        check(ev, 50)


def test_forgotten_events_leave_the_cache_and_their_numbers_can_come_back():
    """A reader's events forgotten (`forget_from`): none of them is found any more, the others
    still are with their rows, and a new event of a forgotten number is placed anew."""
    import numpy as np

    cache = EventCache(30, (1,), torch.float32)
    lengths = np.array([3, 2, 4, 1, 5, 2, 3])
    ids = np.arange(7)
    cache.insert(torch.from_numpy(ids), torch.from_numpy(lengths),
                 *(torch.from_numpy(np.repeat(ids, lengths)).float()[:, None],) * 2)
    cache.forget_from(4)
    at = cache.offsets(ids)
    assert (at[4:] < 0).all() and (at[:4] >= 0).all()
    for e in range(4):
        assert torch.equal(cache.k[at[e] : at[e] + lengths[e], 0], torch.full((int(lengths[e]),), float(e)))
    assert (cache.owner >= 4).sum() == 0
    rows = cache.place(np.array([4]), np.array([6]))
    assert rows.size == 6 and cache.offsets(np.array([4]))[0] == rows[0]

