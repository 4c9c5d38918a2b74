"""Selection from a matrix-vector estimate (core/memory/prune.py): the bound holds for every event,
the selection is the full scan's bit for bit (ties included), a store's resident keys select what
its scan of the files selects, and a layer's reuse of the last step's events reads the same rows."""

from __future__ import annotations

import pytest
import torch

from emllm.memory import prune as _prune


@pytest.fixture(autouse=True)
def _always_prune(monkeypatch):
    """Small cases take the estimate too (the scan is what they are compared with)."""
    monkeypatch.setattr(_prune, "PRUNE_FROM", 1)

from emllm.engine.window import LayerWindow
from emllm.memory import prune
from emllm.memory.events import EventMemory
from emllm.memory.selection import event_scores, gamma, score_error, scores_in_blocks, select_events
from emllm.store import Geometry, Identity, Store, StoredEvents

G = Geometry(layers=2, kv_heads=1, q_heads=3, head_dim=32, vocab=10, dtype="float32")
IDENT = Identity("m", "c", "w", "t")


def _events(n: int, seed: int, spread: float, dtype: torch.dtype = torch.float32):
    """lengths [n], reprs [n, 96]: clusters around one large mean (keys look like that); spread
    0 makes whole clusters of identical events (a repeated filler: exact ties)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(8, 96, generator=g) * 2 + 5
    pick = torch.randint(0, 8, (n,), generator=g)
    reprs = (centres[pick] + spread * torch.randn(n, 96, generator=g)).to(dtype)
    return torch.randint(1, 9, (n,), generator=g), reprs


def _select(rows: torch.Tensor, lengths: torch.Tensor, q: torch.Tensor, budget: int, scored: list | None = None):
    """prune.select over rows (as given: float32 or bfloat16); `scored` collects the rows it scored exactly."""
    r32 = rows
    real = _prune.event_scores
    def counting(x, query):
        if scored is not None and x.shape[0] < r32.shape[0]:
            scored.extend(range(x.shape[0]))
        return real(x, query)
    _prune.event_scores = counting
    try:
        return prune.select(r32, prune.norms_up(r32), q, lengths, budget)
    finally:
        _prune.event_scores = real


@pytest.mark.parametrize("spread", [1.0, 0.001, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_selection_is_the_scans_bit_for_bit(spread, dtype):
    lengths, rows = _events(3000, 1, spread, dtype)
    g = torch.Generator().manual_seed(2)
    for _ in range(10):
        q = torch.randn(96, generator=g) * 3
        for budget in (1, 40, 400, 30_000):
            scored: list[int] = []
            got = _select(rows, lengths, q, budget, scored)
            want = select_events(event_scores(rows.reshape(-1, 3, 32), q), lengths, budget)  # the scan, of the rows as stored
            assert got.ids.tolist() == want.ids.tolist()
            assert torch.equal(got.scores, want.scores)
            if spread == 1.0 and budget == 40:
                assert len(scored) < 100  # distinct events: the estimate leaves few to score exactly


@pytest.mark.parametrize("spread", [1.0, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resident_rows_and_a_scanned_tail_select_what_the_scan_selects(spread, dtype):
    """Past what stays resident, a store scores its newest events exactly from the file (the tail):
    the selection of rows and tail together is the scan's, bit for bit, ties included."""
    lengths, rows = _events(3000, 7, spread, dtype)
    g = torch.Generator().manual_seed(8)
    for held in (0, 700, 2500, 3000):  # none resident, too few to estimate, estimated, all
        res = rows[:held]
        for _ in range(4):
            q = torch.randn(96, generator=g) * 3
            tail = scores_in_blocks(3000 - held, 96, lambda a, b: rows[held + a : held + b], q) if held < 3000 else None
            for budget in (1, 40, 400):
                got = prune.select(res, prune.norms_up(res), q, lengths, budget, tail)
                want = select_events(event_scores(rows.reshape(-1, 3, 32), q), lengths, budget)
                assert got.ids.tolist() == want.ids.tolist() and torch.equal(got.scores, want.scores), (held, budget)


def test_the_bound_holds_for_every_event():
    # large and small magnitudes, a query of mixed scales: lower <= exact (the scan's float32) <= upper
    g = torch.Generator().manual_seed(3)
    for scale in (1e-30, 1e-3, 1.0, 1e3, 1e30):
        rows = torch.randn(2000, 576, generator=g) * scale + torch.randn(576, generator=g) * 10 * scale
        q = torch.randn(576, generator=g) * torch.logspace(-3, 3, 576)
        for x in (rows, rows.bfloat16(), rows.half() if scale == 1.0 else rows):
            # float32: one mv; bfloat16: the split query in bfloat16 (a slack of ~2^-8 the score);
            # float16: widened a block at a time
            exact = scores_in_blocks(2000, 576, lambda a, b: x[a:b], q).double()
            lower, upper = prune.bounds(x, prune.norms_up(x), q)
            assert bool((lower.double() <= exact).all()) and bool((exact <= upper.double()).all()), (scale, x.dtype)
            if x.dtype == torch.float32:  # the mv's slack stays ~gamma(dim) |q| |x|, not bfloat16's ~2^-8 |score|
                est = prune.estimate(x, q).double()
                tight = (gamma(576) + score_error(576)) * float(q.double().norm()) * prune.norms_up(x).double()
                assert bool(((upper - lower).double() / 2 <= tight * 1.01 + est.abs() * 2.0**-19 + 2.0**-99).all())


def test_a_bfloat16_estimate_leaves_few_events_to_score():
    """The split query's slack is ~2^-8 of a score: on clustered keys the floor of the stopper
    still lets through few more events than the budget holds."""
    lengths, rows = _events(20_000, 12, 1.0, torch.bfloat16)
    q = torch.randn(96, generator=torch.Generator().manual_seed(13)) * 3
    lower, upper = prune.bounds(rows, prune.norms_up(rows), q)
    floor = prune.stopper_floor(lower, lengths, 400)
    exact = event_scores(rows.reshape(-1, 3, 32), q)
    want = select_events(exact, lengths, 400)
    assert int((upper >= floor).sum()) < 3 * want.ids.numel()



def test_a_sample_whose_threshold_holds_too_few_tokens_falls_back_to_the_best_k(monkeypatch):
    """bfloat16 rows take the sampled threshold; where the sampled events are the best ones (so
    the events estimated above the threshold hold too few tokens) the best k of every estimate
    give the floor instead: the scan's selection either way. A non-finite key: the general path."""
    monkeypatch.setattr(_prune, "SAMPLE", 100)  # every 30th of 3,000 events
    lengths, rows = _events(3000, 31, 1.0, torch.bfloat16)
    q = torch.randn(96, generator=torch.Generator().manual_seed(32))
    rows = rows.clone()
    rows[::30] = (rows[::30].float() + 3 * q / q.norm()).bfloat16()  # the sampled events score best
    floors = []
    real = _prune._floor
    monkeypatch.setattr(_prune, "_floor", lambda *a: floors.append(real(*a)) or floors[-1])
    for budget in (1, 40, 400):
        floors.clear()
        got = prune.select(rows, prune.norms_up(rows), q, lengths, budget)
        want = select_events(event_scores(rows.reshape(-1, 3, 32), q), lengths, budget)
        assert got.ids.tolist() == want.ids.tolist() and torch.equal(got.scores, want.scores)
        if budget == 400:  # the ~27 events above the threshold hold ~120 tokens: -inf, then the best k
            assert len(floors) == 2 and floors[0] == float("-inf") and floors[1] > float("-inf")
    bad = rows.clone()
    bad[7, 3] = float("nan")
    got = prune.select(bad, prune.norms_up(bad), q, lengths, 40)
    want = select_events(event_scores(bad.reshape(-1, 3, 32), q), lengths, 40)
    assert got.ids.tolist() == want.ids.tolist()

@pytest.mark.parametrize("spread", [1.0, 0.0])
def test_the_floor_is_at_most_the_stopper(spread):
    """stopper_floor (from lower bounds) <= the score where select_events stops, ties included;
    -inf when everything fits."""
    from emllm.memory.sketch import stopper
    lengths, rows = _events(500, 21, spread)
    g = torch.Generator().manual_seed(22)
    for _ in range(20):
        q = torch.randn(96, generator=g)
        exact = event_scores(rows.reshape(-1, 3, 32), q)
        lower = exact - torch.rand(500, generator=g) * (0 if spread == 0 else 0.5)
        for budget in (1, 30, 300):
            assert prune.stopper_floor(lower, lengths, budget) <= stopper(exact, lengths, budget)
    assert prune.stopper_floor(lower, lengths, int(lengths.sum())) == float("-inf")


def test_half_rows_are_estimated_as_their_float32_widening(monkeypatch):
    monkeypatch.setattr(_prune, "ESTIMATE_BLOCK", 700)  # several blocks, the last one short
    g = torch.Generator().manual_seed(9)
    rows = (torch.randn(2000, 96, generator=g) + 4).bfloat16()
    q = torch.randn(96, generator=g)
    est = prune.estimate(rows, q)
    want = torch.cat([torch.mv(rows[a : a + 700].float(), q) for a in range(0, 2000, 700)])
    assert est.dtype == torch.float32 and torch.equal(est, want)


def _store(path, n_events: int, repr_cache_mb: int | None, kv: str | None = None, spread: float = 0.3) -> Store:
    prof = {"name": "t", "faiss_threshold": None, "sketch_threshold": None}
    if repr_cache_mb is not None:
        prof["repr_cache_mb"] = repr_cache_mb
    st = Store.create(path, IDENT, prof, G, kv=kv)
    lengths, reprs = _events(n_events, 4, spread)
    for i in range(G.layers):
        kv_rows = torch.randn(1, int(lengths.sum()), 32)
        StoredEvents(st, i).append(kv_rows, kv_rows, lengths, reprs.reshape(-1, 3, 32) * (i + 1))
    st.events.append(lengths.to(torch.int32))
    st.commit({}, {})
    return st


@pytest.mark.parametrize("kv,spread", [(None, 0.3), (None, 0.0), ("int4", 0.3), ("bfloat16", 0.3), ("bfloat16", 0.0)])
def test_a_store_selects_from_resident_keys_what_its_scan_selects(tmp_path, kv, spread):
    st = _store(tmp_path / "s", 700, None, kv, spread)
    st.close()
    with Store.open(tmp_path / "s") as fast_store, Store.open(tmp_path / "s") as scan_store:
        scan_store.manifest["profile"]["repr_cache_mb"] = 0  # nothing resident: the scan of layers/NN.r
        g = torch.Generator().manual_seed(5)
        for layer in range(G.layers):
            fast, scan = StoredEvents(fast_store, layer), StoredEvents(scan_store, layer)
            assert scan.resident_cap == 0 and fast.resident_cap >= len(fast)
            assert fast.resident.buf.dtype == (torch.bfloat16 if kv == "bfloat16" else torch.float32)
            for _ in range(10):
                q = torch.randn(3, 32, generator=g)
                for budget in (8, 100):
                    a, b = fast.select(q, budget), scan.select(q, budget)
                    assert a.ids.tolist() == b.ids.tolist() and torch.equal(a.scores, b.scores)
            assert fast.resident.n == len(fast) and scan.resident.n == 0


@pytest.mark.parametrize("kv", [None, "bfloat16"])
def test_a_store_with_more_events_than_it_keeps_resident_selects_what_its_scan_selects(tmp_path, kv):
    _store(tmp_path / "s", 3000, None, kv).close()
    with Store.open(tmp_path / "s") as fast_store, Store.open(tmp_path / "s") as scan_store:
        scan_store.manifest["profile"]["repr_cache_mb"] = 0
        g = torch.Generator().manual_seed(11)
        fast, scan = StoredEvents(fast_store, 1), StoredEvents(scan_store, 1)
        fast.resident_cap = 2500  # (a cap of repr_cache_mb's size: 2,500 of 3,000 events resident)
        for _ in range(6):
            q = torch.randn(3, 32, generator=g)
            for budget in (8, 100):
                a, b = fast.select(q, budget), scan.select(q, budget)
                assert a.ids.tolist() == b.ids.tolist() and torch.equal(a.scores, b.scores)
        assert fast.resident.n == 2500 and scan.resident.n == 0


def test_resident_keys_follow_events_closed_after_opening_and_a_truncate(tmp_path):
    _store(tmp_path / "s", 300, None).close()
    with Store.open(tmp_path / "s") as st:  # a reader: later events in RAM, forgotten by truncate
        ev = StoredEvents(st, 0)
        q = torch.randn(3, 32, generator=torch.Generator().manual_seed(6))
        ev.select(q, 50)
        mark = ev.mark()
        lengths, reprs = _events(40, 9, 0.3)
        kv_rows = torch.randn(1, int(lengths.sum()), 32)
        ev.append(kv_rows, kv_rows, lengths, reprs.reshape(-1, 3, 32) * 3)  # far larger: they win
        got = ev.select(q * 0 + reprs[0].reshape(3, 32), 50)
        assert ev.resident.n == 340 and int(got.ids.max()) >= 300
        want = select_events(event_scores(ev.repr_keys(), reprs[0]), ev.event_lengths(), 50)
        assert got.ids.tolist() == want.ids.tolist()
        ev.truncate(mark)
        assert ev.resident.n == 300
        got = ev.select(q, 50)
        want = select_events(event_scores(ev.repr_keys(), q), ev.event_lengths(), 50)
        assert got.ids.tolist() == want.ids.tolist() and int(got.ids.max()) < 300


def test_a_layer_reuses_the_last_steps_events_and_reads_the_same_rows():
    mem = EventMemory(2, 4, 8, torch.float32, torch.device("cpu"), None)
    mem.random_access = False  # as a store writer's: reads cost, so the window keeps what it held
    g = torch.Generator().manual_seed(8)
    lengths = torch.randint(1, 6, (60,), generator=g)
    k = torch.randn(2, int(lengths.sum()), 8, generator=g)
    mem.append(k, -k, lengths, torch.randn(60, 4, 8, generator=g))
    w = LayerWindow(0, 2, 4, 8, torch.float32, torch.device("cpu"), mem)
    reads = []
    gather = mem.gather
    mem.gather = lambda ids, prefetch=False: (reads.append(ids.tolist()), gather(ids, prefetch))[1]
    picks = [[3, 7, 9, 20], [3, 7, 9, 20], [3, 9, 21, 40, 41], [0, 59], [0, 5, 59], [], [4, 5], [5, 6]]
    for ids in picks:
        ids = torch.tensor(ids, dtype=torch.long)
        got_k, got_v = w._gather(ids)
        want_k, want_v = gather(ids)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # read from the memory: the first selection, nothing for the repeat, then only new events
    assert reads == [[3, 7, 9, 20], [21, 40, 41], [0, 59], [5], [], [4, 5], [6]]

