"""The sketch of a large store's representative keys (core/memory/sketch.py, Store.update_sketch):
fitted once on the first events, the same bytes however the stream was committed, readers that
select from it exactly what the scan selects (the bounds make it exact, not likely)."""

from __future__ import annotations

import hashlib

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from emllm.memory import sketch
from emllm.memory.selection import event_scores, select_events
from emllm.store import Geometry, Identity, Store, StoredEvents
from emllm.store.manifest import FORMAT_VERSION
from emllm.store.manifest import checksum as _checksum

G = Geometry(layers=2, kv_heads=1, q_heads=3, head_dim=32, vocab=10, dtype="float32")  # 96 dims > the sketch's 64
G7 = Geometry(layers=2, kv_heads=3, q_heads=6, head_dim=32, vocab=10, dtype="float32")  # a key per KV head: 96 dims too
IDENT = Identity("m", "c", "w", "t")
THRESHOLD = 200


def _events(n: int, seed: int, clusters: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """n events: lengths [n] and reprs [n, 3, 32] around a shared mean, in a few clusters (keys
    are shaped like that: one large mean, groups of similar events)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, 96, generator=g) * 2 + 5
    pick = torch.randint(0, clusters, (n,), generator=g)
    reprs = (centres[pick] + 0.3 * torch.randn(n, 96, generator=g)).reshape(n, 3, 32)
    return torch.randint(1, 9, (n,), generator=g), reprs


def _write(path: Path, batches: list[int], commit_every: int, seed: int = 0,
           outlier: tuple[int, torch.Tensor] | None = None, kv: str | None = None, per_kv_head: bool = False) -> None:
    """A store of sum(batches) events in both layers (layer i holds (i + 1) x the reprs),
    committed every `commit_every` batches; `outlier` (id, repr) replaces one event.
    per_kv_head: of geometry G7, a representative key per KV head (version 7)."""
    lengths, reprs = _events(sum(batches), seed)
    if outlier is not None:
        reprs[outlier[0]] = outlier[1].reshape(3, 32)
    g = G7 if per_kv_head else G
    # repr_cache_mb 0: a reader keeps no keys resident, as for a store past that budget, so its
    # selections go through the sketch
    st = Store.create(path, IDENT, {"name": "t", "faiss_threshold": THRESHOLD, "repr_cache_mb": 0}, g, kv=kv,
                      repr_heads=g.kv_heads if per_kv_head else None)
    evs = [StoredEvents(st, i) for i in range(g.layers)]
    done = 0
    for b, n in enumerate(batches):
        sl = slice(done, done + n)
        for i, ev in enumerate(evs):
            kv = torch.full((g.kv_heads, int(lengths[sl].sum()), 32), float(b))
            ev.append(kv, kv, lengths[sl], reprs[sl] * (i + 1))
        st.events.append(lengths[sl].to(torch.int32))
        done += n
        if (b + 1) % commit_every == 0 or b == len(batches) - 1:
            st.commit({}, {})
    st.close()


def store_files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name not in ("lock", "manifest.json") and not p.name.startswith("state-")}


def test_fit_in_blocks_finds_the_principal_directions(monkeypatch):
    # fit reads its sample a block at a time (two passes); the result is the sample's top principal
    # subspace, as a float64 SVD of the whole sample gives it, whatever the block size
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(300, 8, generator=g) * torch.linspace(8, 1, 8)) @ torch.randn(8, 96, generator=g)
    x = x + 0.01 * torch.randn(300, 96, generator=g) + 3
    xd = x.double()
    _, _, vt = torch.linalg.svd(xd - xd.mean(0), full_matrices=False)
    want = vt[:8].T @ vt[:8]  # projector on the top 8 directions
    for rows in (7, 64, 4096):
        monkeypatch.setattr(sketch, "FIT_BLOCK_ROWS", rows)
        mean, basis = sketch.fit(x, dims=8)
        torch.testing.assert_close(mean.double(), xd.mean(0), atol=1e-5, rtol=0)
        torch.testing.assert_close(basis.double() @ basis.double().T, want, atol=1e-5, rtol=0)


def test_project_is_row_by_row_and_fit_is_deterministic():
    _, reprs = _events(300, 1)
    x = reprs.reshape(300, -1)
    mean, basis = sketch.fit(x)
    m2, b2 = sketch.fit(x.clone())
    assert torch.equal(mean, m2) and torch.equal(basis, b2)
    assert torch.allclose(basis.T @ basis, torch.eye(basis.shape[1]), atol=1e-5)  # orthonormal
    coords, norms = sketch.project(x, mean, basis)
    one = [sketch.project(x[i : i + 1], mean, basis) for i in (0, 17, 299)]
    assert all(torch.equal(c[0], coords[i]) and torch.equal(n, norms[i : i + 1]) for (c, n), i in zip(one, (0, 17, 299)))
    # the norms, rounded up: outside the basis, inside it (float16 rounding), the event's length
    r = x.double() - mean.double() - coords.double() @ basis.double().T
    r_in = r @ basis.double()
    want = torch.stack(((r - r_in @ basis.double().T).norm(dim=1), r_in.norm(dim=1), x.double().norm(dim=1)), 1)
    assert bool((norms.double() >= want).all()) and torch.allclose(norms.double(), want, rtol=1e-6)
    # dims >= the data's dimension: the sketch is the data, up to float16
    full_mean, full = sketch.fit(x, dims=96)
    c, n = sketch.project(x, full_mean, full)
    assert float(n[:, 0].max()) < 1e-4 and float(n[:, 1].max()) < 0.05
    assert torch.allclose(c.double() @ full.double().T + full_mean.double(), x.double(), atol=0.05)


def test_the_bound_holds_for_every_event_and_is_tight_where_the_basis_fits():
    _, reprs = _events(400, 2)
    x = reprs.reshape(400, -1)
    mean, basis = sketch.fit(x[:200])
    x[300] += 15 * torch.randn(96, generator=torch.Generator().manual_seed(5))  # off the basis
    x[210:220] = mean + (basis @ torch.randn(64, 10, generator=torch.Generator().manual_seed(6))).T  # in it
    coords, norms = sketch.project(x, mean, basis)
    g = torch.Generator().manual_seed(11)
    for _ in range(50):
        q = torch.randn(96, generator=g) * 3
        exact = x @ q
        est = sketch.estimate(400, lambda a, b: coords[a:b], q, mean, basis)
        ub = sketch.upper_bound(est, norms, q, mean, basis)
        assert bool((ub >= exact).all())
        # events in the basis: only float16 rounding and float32 slack; off it: as far as it is
        gap = ub - exact
        assert float(gap[210:220].max()) < 0.5 < float(gap.median()) < float(gap[300])


def test_stopper_is_where_select_events_stops():
    scores = torch.tensor([5.0, 1.0, 4.0, 3.0, 2.0])
    lengths = torch.tensor([3, 1, 3, 3, 1])
    assert select_events(scores, lengths, 7).ids.tolist() == [0, 2] and sketch.stopper(scores, lengths, 7) == 3.0
    assert sketch.stopper(scores, lengths, 100) == float("-inf")


def test_candidates_are_the_best_estimates_holding_factor_times_the_budget():
    est = torch.tensor([0.5, 3.0, 2.0, -1.0, 2.5, 1.0])
    lengths = torch.tensor([4, 3, 5, 2, 2, 6])
    got = sketch.candidates(est, lengths, budget=3, factor=2)  # 6 tokens: 3 (id 1) + 2 (id 4) + 5 (id 2)
    assert got.tolist() == [1, 4, 2]
    assert sketch.candidates(est, lengths, budget=100, factor=2).sort().values.tolist() == list(range(6))
    assert sketch.candidates(est[:0], lengths[:0], 5).numel() == 0


@pytest.mark.parametrize("seed", range(6))
def test_exact_selection_is_select_events_over_everything(seed):
    # Bounds of every width, estimates good and bad (seed 3+: ranked backwards, so the first
    # stopper is far too low and the loop must climb), budgets from 1 event to all of them.
    g = torch.Generator().manual_seed(seed)
    n, extra = 500, 7
    exact = torch.randn(n + extra, generator=g).round(decimals=1)  # many exact ties
    lengths = torch.randint(1, 9, (n + extra,), generator=g)
    noise = torch.rand(n, generator=g).double() * (0.05 if seed % 3 == 0 else 2.0)
    est = (exact[:n].double() - noise) if seed < 3 else -exact[:n].double()
    ub = exact[:n].double() + (noise if seed < 3 else torch.rand(n, generator=g).double() * 3)
    for budget in (1, 8, 40, 400, 10_000):
        scored: list[int] = []
        def score(ids):
            assert bool((ids[1:] > ids[:-1]).all()) and not set(ids.tolist()) & set(scored)  # increasing, once each
            scored.extend(ids.tolist())
            return exact[ids]
        got = sketch.exact_selection(est, ub, lengths, budget, score, torch.arange(n, n + extra))
        want = select_events(exact, lengths, budget)
        assert got.ids.tolist() == want.ids.tolist() and torch.equal(got.scores, want.scores)
        assert set(range(n, n + extra)) <= set(scored)  # events without a sketch are always scored
        if budget == 10_000:
            assert len(scored) == n + extra  # everything fits: nothing can be left out
        elif seed == 0 and budget == 8:
            assert len(scored) < n // 4  # tight bounds: few scored


def test_the_sketch_is_the_same_however_the_stream_was_committed(tmp_path):
    batches = [37, 50, 61, 29, 80, 44, 33]  # the threshold (200) falls inside the 4th batch
    _write(tmp_path / "a", batches, commit_every=1)
    _write(tmp_path / "b", batches, commit_every=3)
    _write(tmp_path / "c", batches, commit_every=len(batches))
    fa, fb, fc = store_files(tmp_path / "a"), store_files(tmp_path / "b"), store_files(tmp_path / "c")
    assert "sketch.safetensors" in fa and "layers/01.p" in fa
    assert fa == fb == fc
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["version"] == FORMAT_VERSION and m["sketch"]["trained_on"] == THRESHOLD
    assert m["sketch"]["dims"] == sketch.DIMS
    assert (tmp_path / "a" / "layers/00.p").stat().st_size == sum(batches) * sketch.DIMS * 2


def test_no_sketch_below_the_threshold_or_without_one(tmp_path):
    _write(tmp_path / "s", [60, 70], commit_every=1)
    with Store.open(tmp_path / "s") as st:
        assert st.manifest["sketch"] is None and st.sketch_files is None
    assert not (tmp_path / "s" / "sketch.safetensors").exists()


def _exact(st: Store, layer: int, q: torch.Tensor, budget: int):
    lengths = st.events.read().long()
    return select_events(event_scores(st.reprs_of(st.layer_files[layer][2].read()), q), lengths, budget)


@pytest.mark.parametrize("spread,kv,per_kv_head", [(0.3, None, False), (0.0001, None, False), (0.3, "int4", False),
                                                   (0.3, None, True)])  # int4: int8 reprs, decoded; version 7
def test_readers_select_from_the_sketch_exactly_what_the_scan_selects(tmp_path, monkeypatch, spread, kv, per_kv_head):
    # spread 0.0001: near-identical events in each cluster (a repeated filler), where the
    # factor-8 candidates alone cannot tell which copies the scan takes
    monkeypatch.setattr(sketch, "FACTOR", 1)  # few candidates, so the bound has work to do
    def events(n, seed, clusters=12):
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(clusters, 96, generator=g) * 2 + 5
        pick = torch.randint(0, clusters, (n,), generator=g)
        return torch.randint(1, 9, (n,), generator=g), (centres[pick] + spread * torch.randn(n, 96, generator=g)).reshape(n, 3, 32)
    monkeypatch.setattr(sys.modules[__name__], "_events", events)
    _write(tmp_path / "s", [150, 150, 150, 150], commit_every=1, kv=kv, per_kv_head=per_kv_head)
    g = torch.Generator().manual_seed(7)
    with Store.open(tmp_path / "s") as st:
        assert st.repr_heads == 3 and st.manifest["version"] == FORMAT_VERSION
        for layer in range(G.layers):
            ev = StoredEvents(st, layer)
            assert ev.sketch is not None and ev.retrieval_mapped  # a reader of a small store: through maps
            assert ev._sketched()  # its keys past repr_cache_mb (0 here)
            # the sketch through maps, by pread (a store larger than half the memory), and the
            # resident keys' product (a store whose keys fit in repr_cache_mb)
            for resident, mapped in ((False, True), (False, False), (True, True)):
                ev.resident_cap, ev.retrieval_mapped = (len(ev) if resident else 0), mapped
                assert ev._sketched() != resident
                for _ in range(7):
                    q = torch.randn(3, 32, generator=g)
                    for budget in (8, 40):
                        got, want = ev.select(q, budget), _exact(st, layer, q, budget)
                        assert got.ids.tolist() == want.ids.tolist()
                        assert torch.equal(got.scores, want.scores)  # the same bits: a score depends on its row alone
    with Store.open(tmp_path / "s", writable=True) as st:  # a writer always scans, by pread
        ev = StoredEvents(st, 0)
        assert ev.sketch is None and not ev.retrieval_mapped


def test_an_event_off_the_basis_appended_after_the_fit_is_found(tmp_path, monkeypatch):
    # An event at the training mean plus a direction the basis cannot see (orthogonal to it).
    _, reprs = _events(390, 0)  # the events _write makes
    mean, basis = sketch.fit(reprs[:THRESHOLD].reshape(THRESHOLD, -1))
    v = torch.randn(96, generator=torch.Generator().manual_seed(3))
    v = v - basis @ (basis.T @ v)
    v = v / v.norm()
    # 390 events: fitted once, on the first 200 (a refit comes at 400)
    _write(tmp_path / "s", [150, 150, 90], commit_every=2, outlier=(320, mean + 20 * v))
    with Store.open(tmp_path / "s") as st:
        assert st.manifest["sketch"]["trained_on"] == THRESHOLD
        ev = StoredEvents(st, 1)
        q = v.reshape(3, 32)  # asks for exactly what the event holds beyond the basis
        budget = int(st.events.read()[320])
        assert ev.select(q, budget).ids.tolist() == [320]
        # its sketch alone ranks it with the rest: without the bound it is missed
        monkeypatch.setattr(sketch, "upper_bound", lambda est, *a: est)
        assert 320 not in ev.select(q, budget).ids.tolist()


def _drifting(monkeypatch) -> torch.Tensor:
    """Make _events drift: from event THRESHOLD on, a direction v (returned) that the first
    THRESHOLD events lack, with a random weight (a stream whose keys move on after the fit)."""
    plain = _events

    def events(n: int, seed: int, clusters: int = 12):
        lengths, reprs = plain(n, seed, clusters)
        g = torch.Generator().manual_seed(seed + 1)
        w = torch.zeros(n)
        w[THRESHOLD:] = 4 * torch.randn(max(0, n - THRESHOLD), generator=g)
        return lengths, reprs + (w[:, None] * v).reshape(n, 3, 32)

    _, first = plain(600, 0)  # the events of a 600-event _write (they depend on n)
    _, basis = sketch.fit(first[:THRESHOLD].reshape(THRESHOLD, -1))
    v = torch.randn(96, generator=torch.Generator().manual_seed(5))
    v = v - basis @ (basis.T @ v)
    v = v / v.norm()
    monkeypatch.setattr(sys.modules[__name__], "_events", events)
    return v


def test_the_sketch_is_refitted_as_the_store_doubles(tmp_path, monkeypatch):
    v = _drifting(monkeypatch)
    _write(tmp_path / "s", [150, 150, 150, 150], commit_every=1)  # 600 events: fitted at 200, refitted at 400
    with Store.open(tmp_path / "s") as st:
        sk = st.manifest["sketch"]
        assert {k: sk[k] for k in ("file", "dims", "trained_on")} == {"file": "sketch-400.safetensors", "dims": 64, "trained_on": 400}
        assert sk["sha256"] == hashlib.sha256((tmp_path / "s" / sk["file"]).read_bytes()).hexdigest()
        names = {str(p.relative_to(tmp_path / "s")) for p in (tmp_path / "s").rglob("*")}
        assert {"layers/00.400.p", "layers/01.400.n", "sketch-400.safetensors"} <= names
        assert not names & {"sketch.safetensors", "layers/00.p", "layers/01.n"}  # the first sketch's files are gone
        for layer in range(G.layers):
            x = st.layer_files[layer][2].read().float().reshape(600, -1)
            # the refit's basis holds the drift: events past the first fit sit in it
            _, basis = st.sketch_basis(layer)
            assert float((basis.T @ v).norm()) > 0.99
            assert float((sketch.fit(x[:THRESHOLD])[1].T @ v).norm()) < 0.05  # the first basis did not
            ev = StoredEvents(st, layer)
            g = torch.Generator().manual_seed(layer)
            for q in [v.reshape(3, 32), *torch.randn(10, 3, 32, generator=g)]:  # still the scan's selection
                for budget in (8, 40):
                    got, want = ev.select(q, budget), _exact(st, layer, q, budget)
                    assert got.ids.tolist() == want.ids.tolist() and torch.equal(got.scores, want.scores)


def test_a_refit_cut_short_before_its_commit_leaves_the_first_sketch(tmp_path, monkeypatch):
    _drifting(monkeypatch)
    _write(tmp_path / "a", [150, 150, 150, 150], commit_every=1)
    _write(tmp_path / "b", [150, 150, 90], commit_every=1)  # 390 events: the first sketch only
    lengths, reprs = _events(600, 0)
    with Store.open(tmp_path / "b", writable=True) as st:  # 210 more events, refitted, never committed
        evs = [StoredEvents(st, i) for i in range(G.layers)]
        sl = slice(390, 600)
        for i, ev in enumerate(evs):
            kv = torch.full((1, int(lengths[sl].sum()), 32), 3.0)
            ev.append(kv, kv, lengths[sl], reprs[sl] * (i + 1))
        st.events.append(lengths[sl].to(torch.int32))
        assert st.update_sketch() and st.manifest["sketch"]["trained_on"] == 400
    with Store.open(tmp_path / "b") as st:  # a reader sees the last commit: 390 events, the first sketch
        assert st.manifest["rows"]["events"] == 390 and st.manifest["sketch"]["trained_on"] == THRESHOLD
        q = torch.randn(3, 32, generator=torch.Generator().manual_seed(9))
        assert StoredEvents(st, 1).select(q, 40).ids.tolist() == _exact(st, 1, q, 40).ids.tolist()
    with Store.open(tmp_path / "b", writable=True) as st:  # a writer drops what no manifest names, before it writes
        assert list((tmp_path / "b").glob("sketch-*"))  # not at open: a writer refused then changed nothing
        st.tidy()
    assert not list((tmp_path / "b").glob("sketch-*")) and not list((tmp_path / "b" / "layers").glob("*.400.*"))


def test_a_reader_keeps_its_sketch_while_a_writer_refits(tmp_path, monkeypatch):
    _drifting(monkeypatch)
    _write(tmp_path / "s", [150, 150, 90], commit_every=1)
    lengths, reprs = _events(600, 0)
    q = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    with Store.open(tmp_path / "s") as reader:
        want = _exact(reader, 1, q, 40)
        with Store.open(tmp_path / "s", writable=True) as st:  # 210 more events, refitted and committed
            sl = slice(390, 600)
            for i in range(G.layers):
                kv = torch.full((1, int(lengths[sl].sum()), 32), 3.0)
                StoredEvents(st, i).append(kv, kv, lengths[sl], reprs[sl] * (i + 1))
            st.events.append(lengths[sl].to(torch.int32))
            st.commit({}, {})
        assert not (tmp_path / "s" / "layers" / "01.p").exists()  # the first sketch's files are gone...
        got = StoredEvents(reader, 1).select(q, 40)  # ...but the reader opened them: still its commit's answer
        assert got.ids.tolist() == want.ids.tolist() and torch.equal(got.scores, want.scores)
    with Store.open(tmp_path / "s") as st:
        assert st.manifest["sketch"]["trained_on"] == 400 and st.manifest["rows"]["events"] == 600


def test_a_version_1_store_gets_its_sketch_when_next_written(tmp_path):
    batches = [100, 100, 100]
    _write(tmp_path / "new", batches, commit_every=1)
    # The same store as an older emllm wrote it: no sketch, version 1.
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "new", old)
    for p in [old / "sketch.safetensors", *old.glob("layers/*.p"), *old.glob("layers/*.n")]:
        p.unlink()
    m = json.loads((tmp_path / "new" / "manifest.json").read_text())
    m.pop("sketch")
    m["version"] = 1
    m["checksum"] = _checksum(m)
    (old / "manifest.json").write_text(json.dumps(m))
    with Store.open(old) as st:  # readable, scanned
        assert st.sketch_files is None and StoredEvents(st, 0).sketch is None
    with Store.open(old, writable=True) as st:
        assert st.commit_sketch()
        assert not st.commit_sketch()  # nothing left to do
    assert store_files(old) == store_files(tmp_path / "new")


def test_a_fit_interrupted_before_its_commit_is_redone_to_the_same_bytes(tmp_path):
    _write(tmp_path / "ref", [120, 120], commit_every=2)
    _write(tmp_path / "s", [120], commit_every=1)
    with Store.open(tmp_path / "s", writable=True) as st:  # a crash after the fit's files, before the manifest
        ev = [StoredEvents(st, i) for i in range(G.layers)]
        lengths, reprs = _events(240, 0)
        for i, e in enumerate(ev):
            kv = torch.full((1, int(lengths[120:].sum()), 32), 1.0)
            e.append(kv, kv, lengths[120:], reprs[120:] * (i + 1))
        st.events.append(lengths[120:].to(torch.int32))
        for rf in st.all_files():
            rf.sync()
        st.update_sketch()
        assert (tmp_path / "s" / "sketch.safetensors").exists()
    with Store.open(tmp_path / "s", writable=True) as st:  # the uncommitted fit is dropped before a write
        st.tidy()
        assert st.manifest["sketch"] is None and not (tmp_path / "s" / "sketch.safetensors").exists()
    _write(tmp_path / "s2", [120, 120], commit_every=2)
    assert store_files(tmp_path / "s2") == store_files(tmp_path / "ref")


@pytest.mark.parametrize("what", ["sketch.safetensors", "layers/00.p", "layers/01.n"])
def test_a_damaged_sketch_is_refused(tmp_path, what):
    _write(tmp_path / "s", [150, 150], commit_every=1)
    p = tmp_path / "s" / what
    if what.endswith((".p", ".n")):
        p.write_bytes(p.read_bytes()[:100])
        with pytest.raises(Exception, match="truncated"):
            Store.open(tmp_path / "s")
    else:
        p.unlink()
        with pytest.raises(Exception, match="missing"):
            Store.open(tmp_path / "s")


def test_a_version_2_sketch_is_not_used_and_is_replaced_when_next_written(tmp_path):
    batches = [100, 100, 100]
    _write(tmp_path / "new", batches, commit_every=1)
    # As emllm wrote it with format 2: outlier lists (.o) instead of norms, a "radius" per layer.
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "new", old)
    for p in old.glob("layers/*.n"):
        p.unlink()
        (old / "layers" / (p.stem + ".o")).write_bytes(b"")
    m = json.loads((tmp_path / "new" / "manifest.json").read_text())
    m["sketch"]["outliers"] = [0] * G.layers
    m["version"] = 2
    m["checksum"] = _checksum(m)
    (old / "manifest.json").write_text(json.dumps(m))
    with Store.open(old) as st:  # readable, scanned
        assert st.sketch_files is None and StoredEvents(st, 0).sketch is None
    with Store.open(old, writable=True) as st:  # the old sketch is dropped from the manifest, then its files
        st.tidy()
        assert st.manifest["sketch"] is None and not list(old.glob("layers/*.o"))
        assert json.loads((old / "manifest.json").read_text())["sketch"] is None
        assert st.commit_sketch()
    assert store_files(old) == store_files(tmp_path / "new")
