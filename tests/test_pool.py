"""`emllm.ModelPool`: stores opened with their own models, a bounded number loaded at a time (the
server's), the model used least recently unloaded first, a loaded model reused whatever its name."""

from __future__ import annotations

import gc
import shutil
import weakref

import pytest

import emllm
from emllm.app.ask import Session
from emllm.store import Store

from .helpers import ingest_store, load_tiny, words


@pytest.fixture(scope="module")
def stores(tiny, tmp_path_factory):
    """Two tiny models' stores, written once: (store of the first model's, of the second's)."""
    folder, prof, other, _ = tiny
    root = tmp_path_factory.mktemp("pool")
    ingest_store(root / "mine", folder, prof, [("doc", "The pass key is 71432. " + words(1, 200))])
    ingest_store(root / "theirs", other, prof, [("doc", "The pass key is 55108. " + words(2, 200))])
    return root / "mine", root / "theirs"


@pytest.fixture
def two_stores(tiny, stores, tmp_path):
    """(folder, other, store of folder's model, store of other's), copies this test may change."""
    for s in stores:
        shutil.copytree(s, tmp_path / s.name)
    return tiny[0], tiny[2], tmp_path / "mine", tmp_path / "theirs"


def _answer(mem: emllm.Memory) -> str:
    return "".join(mem.answer("what is the pass key?", 12, reread=False))


def _reference(store, folder) -> str:
    model, tok = load_tiny(folder)
    with Store.open(store) as st:
        return "".join(Session(st, model, tok).answer_text("what is the pass key?", 12))


def test_each_store_is_answered_by_its_own_model_one_loaded_at_a_time(two_stores):
    folder, other, mine, theirs = two_stores
    log: list[str] = []
    pool = emllm.ModelPool(max_loaded=1, log=log.append)
    a = pool.memory(mine)
    assert [m.name for m in pool.models] == [str(folder)]
    assert _answer(a) == _reference(mine, folder)
    assert pool.memory(mine) is a  # held: its stream's tail read once
    first = weakref.ref(a.loaded.model)
    b = pool.memory(theirs)
    assert [m.name for m in pool.models] == [str(other)]  # the first unloaded to make room
    del a
    gc.collect()
    assert first() is None, "the unloaded model's weights are still referenced"
    assert _answer(b) == _reference(theirs, other)
    again = pool.memory(mine)  # loaded again, the other unloaded
    assert [m.name for m in pool.models] == [str(folder)]
    assert _answer(again) == _reference(mine, folder)
    assert [line.split()[0] for line in log] == ["loading", "unloading", "loading", "unloading", "loading"], log
    pool.close()
    assert pool.models == []


def test_the_least_recently_used_model_is_unloaded_first(two_stores, tiny, tmp_path):
    folder, other, mine, theirs = two_stores
    _, prof, _, other_tok = tiny
    ingest_store(tmp_path / "third", other_tok, prof, [("doc", words(3, 40))])
    pool = emllm.ModelPool(max_loaded=2)
    pool.memory(mine)
    pool.memory(theirs)
    pool.memory(mine)  # used last: `other` is now the least recent
    pool.memory(tmp_path / "third")
    assert [m.name for m in pool.models] == [str(folder), str(other_tok)]


def test_a_loaded_model_serves_stores_of_the_same_weights_under_another_name(two_stores, tmp_path):
    """A store of a folder since moved opens with the model loaded from its new place (the same
    config, weights, tokenizer and dtype): nothing more is loaded."""
    folder, _, mine, _ = two_stores
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    loaded = emllm.load(str(moved), dtype="float32")
    pool = emllm.ModelPool(max_loaded=1)
    pool.add(loaded)
    mem = pool.memory(mine)
    assert mem.loaded is loaded and pool.models == [loaded]
    assert _answer(mem) == _reference(mine, folder)


def test_a_model_that_cannot_be_found_unloads_nothing(two_stores, tiny, tmp_path):
    folder, _, mine, _ = two_stores
    _, prof, other, _ = tiny
    gone = tmp_path / "gone-model"
    shutil.copytree(other, gone)
    ingest_store(tmp_path / "orphan", gone, prof, [("doc", words(4, 40))])
    shutil.rmtree(gone)
    pool = emllm.ModelPool(max_loaded=1)
    mem = pool.memory(mine)
    with pytest.raises(emllm.ModelNotFoundError):
        pool.memory(tmp_path / "orphan")
    assert pool.models == [mem.loaded] and pool.memory(mine) is mem


def test_a_store_made_again_by_another_model_is_opened_with_that_model(two_stores, tiny):
    folder, other, mine, _ = two_stores
    _, prof, _, _ = tiny
    pool = emllm.ModelPool(max_loaded=2)
    before = pool.memory(mine)
    shutil.rmtree(mine)
    ingest_store(mine, other, prof, [("doc", "The pass key is 90210. " + words(5, 60))])
    after = pool.memory(mine)
    assert after is not before and after.loaded.name == str(other)
    assert _answer(after) == _reference(mine, other)


def test_at_least_one_model_stays_loaded():
    with pytest.raises(emllm.UsageError):
        emllm.ModelPool(max_loaded=0)
    with pytest.raises(emllm.UsageError):
        emllm.ModelPool(max_stores=0)


def test_at_most_max_stores_are_held_open_the_least_recently_used_closed_first(two_stores, tmp_path):
    """A server over many stores held every store it had answered open (its window, a few open
    files a layer) until a 1,024-file limit failed every later request, naming the store "damaged"."""
    folder, _, mine, _ = two_stores
    paths = [mine] + [tmp_path / f"copy{i}" for i in range(3)]
    for p in paths[1:]:
        shutil.copytree(mine, p)
    pool = emllm.ModelPool(max_stores=2)
    first = pool.memory(paths[0])
    pool.memory(paths[1])
    assert pool.memory(paths[0]) is first and pool.stores == [paths[1], paths[0]]  # used again: the most recent
    third = pool.memory(paths[2])
    assert pool.stores == [paths[0], paths[2]] and _answer(third) == _reference(paths[2], folder)
    pool.memory(paths[3])
    assert pool.stores == [paths[2], paths[3]]
    with pytest.raises(emllm.UsageError, match="closed"):  # (closed, its files with it)
        _answer(first)
    assert _answer(pool.memory(paths[0])) == _reference(paths[0], folder)  # opened again


@pytest.fixture
def open_files_limit():
    """Lowers this process's soft limit of open files for the test (`set(n)`), restored after."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield lambda n: resource.setrlimit(resource.RLIMIT_NOFILE, (n, before[1]))
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_out_of_file_descriptors_is_said_so_and_the_pool_makes_room(two_stores, tmp_path, open_files_limit):
    from emllm.store.files import descriptors_in_use

    _, _, mine, _ = two_stores
    gc.collect()
    open_files_limit(descriptors_in_use() + 2)  # (a store's folder, its manifest: no more)
    with pytest.raises(emllm.TooManyOpenFiles, match=r"too many files open \(this process may open \d+, `ulimit -n`\)"):
        Store.open(mine)  # (was StoreError: "manifest.json is unreadable (Too many open files): the store is damaged")
    open_files_limit(4096)
    paths = [mine] + [tmp_path / f"copy{i}" for i in range(5)]
    for p in paths[1:]:
        shutil.copytree(mine, p)
    pool = emllm.ModelPool(max_stores=10)
    want = _reference(mine, two_stores[0])
    assert _answer(pool.memory(paths[0])) == want
    per_store = descriptors_in_use()
    pool.close()
    gc.collect()
    base = descriptors_in_use()
    per_store -= base
    assert per_store > 4
    # room for the process's own files and about two stores: half of it kept free, then the limit
    open_files_limit(base + 4 * per_store)
    for p in paths + paths:  # (max_stores alone would hold all six)
        assert _answer(pool.memory(p)) == want
        assert 1 <= len(pool.stores) <= 2 and descriptors_in_use() <= base + 4 * per_store
