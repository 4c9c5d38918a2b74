"""Event formation in the streaming engine: sizes, refinement, determinism, causality."""

from __future__ import annotations

import pytest
import torch

from emllm.engine.stream import Engine
from tests.conftest import tiny_model, tiny_profile


def event_starts(eng: Engine) -> list[int]:
    lengths = eng.windows[0].events.event_lengths()
    return (torch.cumsum(lengths, 0) - lengths + eng.profile.n_init).tolist()


@pytest.mark.parametrize("seg", ["F", "S", "SM", "SC", "FM", "FC"])
def test_events_respect_sizes_and_cover_the_evicted_stream(seg):
    model = tiny_model("qwen2")
    prof = tiny_profile(segmentation=seg, min_block=3, max_block=8)
    eng = Engine(model, prof)
    eng.feed(torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(2)))
    lengths = eng.windows[0].events.event_lengths()
    cap = 16 if seg in ("FM", "FC") else 8  # refined fixed blocks may grow to twice max_block
    assert lengths.min() >= 3 and lengths.max() <= cap
    assert int(lengths.sum()) == eng.rem_start - prof.n_init
    assert eng.n_tokens - prof.n_local - eng.rem_start < 8  # what stays open is less than one block
    for w in eng.windows:  # all layers share one segmentation
        assert torch.equal(w.events.event_lengths(), lengths)
        assert w.events.n_tokens == int(lengths.sum())
    if seg.startswith("F") and len(seg) == 1:
        assert set(lengths.tolist()) == {8}


@pytest.mark.parametrize("seg", ["SM", "SC"])
@pytest.mark.parametrize("sizes", [(4, 6), (2, 5)])
def test_refined_events_respect_sizes(seg, sizes):
    # Tight bounds: refinement moving a boundary left used to grow the next event past max_block,
    # and cutting it afterwards left pieces shorter than min_block (as short as 1 token).
    mn, mx = sizes
    eng = Engine(tiny_model("qwen2"), tiny_profile(segmentation=seg, min_block=mn, max_block=mx))
    eng.feed(torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(0)))
    lengths = eng.windows[0].events.event_lengths()
    assert lengths.numel() > 20
    assert lengths.min() >= mn and lengths.max() <= mx, lengths.tolist()
    assert int(lengths.sum()) == eng.rem_start - eng.profile.n_init


@pytest.mark.parametrize("seg", ["FM", "FC"])
def test_refined_fixed_blocks_differ_from_fixed_blocks(seg):
    # Fixed blocks are all max_block long: held to max_block, refinement could move no boundary
    # and FM, FC were F under another name. (Chunks of 4 blocks: a stretch closed at once is refined.)
    model = tiny_model("llama3.1")
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(4))
    runs = {}
    for s in ("F", seg):
        eng = Engine(model, tiny_profile(segmentation=s, min_block=2, max_block=8, chunk_size=32))
        eng.feed(ids)
        runs[s] = eng.windows[0].events.event_lengths()
    assert set(runs["F"].tolist()) == {8}
    assert runs[seg].numel() == runs["F"].numel()  # same events, boundaries moved
    assert runs[seg].max() > 8 and runs[seg].max() <= 16 and runs[seg].min() >= 2


def test_refine_from_layer_beyond_the_model_is_refused():
    from emllm.config import ProfileError

    model = tiny_model("qwen2")  # 2 layers
    with pytest.raises(ProfileError, match="refine_from_layer = 2 but the model has 2 layers"):
        Engine(model, tiny_profile(segmentation="SM", refine_from_layer=2))
    with pytest.raises(ProfileError, match="refine_from_layer = 40"):
        Engine(model, tiny_profile(segmentation="S", refine_from_layer=40))  # analyse() uses it too
    eng = Engine(model, tiny_profile(segmentation="SM", refine_from_layer=1))  # the last layer: fine
    eng.feed(torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(1)))
    assert eng.n_events > 0


def test_refinement_moves_some_boundaries():
    model = tiny_model("llama3.1")
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(4))
    runs = {}
    for seg in ("S", "SM"):
        eng = Engine(model, tiny_profile(segmentation=seg))
        eng.feed(ids)
        runs[seg] = event_starts(eng)
    assert runs["S"] != runs["SM"]


@pytest.mark.slow
def test_s_boundaries_are_deterministic_and_causal_on_smollm2(smollm2):
    model, tok, prof = smollm2
    prof = prof.replace(n_local=256, chunk_size=64, n_mem=128, n_init=16)
    text = " ".join(f"Line {i}: the {['cat', 'dog', 'river', 'engine'][i % 4]} moved {i * 7 % 13} steps." for i in range(200))
    ids = torch.tensor(tok(text)["input_ids"])[:1500]
    cut = 1000
    other = ids.clone()
    other[cut:] = torch.randint(0, 49152, (ids.numel() - cut,), generator=torch.Generator().manual_seed(0))
    starts = []
    for x in (ids, ids, other):
        eng = Engine(model, prof)
        eng.feed(x)
        starts.append(event_starts(eng))
        lengths = eng.windows[0].events.event_lengths()
        assert lengths.min() >= prof.min_block and lengths.max() <= prof.max_block
    assert starts[0] == starts[1]  # deterministic
    early = lambda s: [b for b in s if b < cut - prof.chunk_size]  # noqa: E731
    assert early(starts[0]) == early(starts[2]) and len(early(starts[0])) > 10


def test_growbuffer_reserve_keeps_rows_and_appends_after_them():
    from emllm.memory.buffers import GrowBuffer
    b = GrowBuffer((0, 3), 0, torch.float32, torch.device("cpu"), cap=2)
    x = torch.arange(12.0).view(4, 3)
    b.append(x[:3])
    b.reserve(100)
    assert b.buf.shape[0] == 100 and torch.equal(b.view(), x[:3])
    b.reserve(10)  # never shrinks
    assert b.buf.shape[0] == 100
    b.append(x[3:])
    assert torch.equal(b.view(), x)


def test_both_event_storages_implement_the_engines_seam(tmp_path, tiny):
    """The engine's seam is a Protocol (`EventStorage`): the events in RAM and the store's events
    both have every method and attribute it names."""
    from emllm.memory.events import EventMemory, EventStorage
    from emllm.store import Store

    from .helpers import ingest_store, words

    folder, prof, _, _ = tiny
    ingest_store(tmp_path / "s", folder, prof, [("a", words(1, 200))])
    ram = EventMemory(2, 4, 8, torch.float32, torch.device("cpu"))
    with Store.open(tmp_path / "s") as st:
        from emllm.store import StoredEvents

        stored = StoredEvents(st, 0)
        assert isinstance(ram, EventStorage) and isinstance(stored, EventStorage)
    assert not isinstance(object(), EventStorage)
