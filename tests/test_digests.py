"""A store's bytes are tied to its manifest: every committed byte has a digest (emllm.store.digests).

Properties: a store as written verifies, however it was committed (a kill and a resume, a cut
back); every bit flipped in any file is found by a full verify, and at open where it lies in a
file's last block; every edit of the layout the manifest states is refused at open; a store written
before digests still opens and is written on as it was.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

import emllm
from emllm.memory.quant import FORMATS
from emllm.store import Store, StoreError
from emllm.store import digests
from emllm.store.manifest import FORMAT_VERSION, checksum

from .helpers import QUESTION, answers_of, before_digests, ingest_store, load_tiny, run_in_process, words

SMALL_BLOCK = 1024  # bytes: a small store's files then span several blocks


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(digests, "BLOCK", SMALL_BLOCK)


@pytest.fixture(scope="module")
def stores(tiny, tmp_path_factory):
    """A store of each format, written with small blocks."""
    mp = pytest.MonkeyPatch()
    mp.setattr(digests, "BLOCK", SMALL_BLOCK)
    folder, prof, _, _ = tiny
    root = tmp_path_factory.mktemp("digests")
    out = {}
    try:
        for name in FORMATS:
            ingest_store(root / name, folder, prof, [("doc", words(5, 300))], kv_format=name)
            out[name] = root / name
    finally:
        mp.undo()
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _named(store: Path) -> dict[str, int]:
    """Every file the manifest commits bytes of -> how many (the append-only files, state, sketch)."""
    with Store.open(store) as st:
        out = {rf.name: rf.rows * rf.row_bytes for rf in st.all_files()}
        for part in ("state", "sketch"):
            if st.manifest.get(part):
                out[st.manifest[part]["file"]] = (store / st.manifest[part]["file"]).stat().st_size
    return out


def _flip(path: Path, at: int) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0x01
    path.write_bytes(bytes(b))


def test_a_store_as_written_verifies_every_byte(stores):
    for name, store in stores.items():
        report = emllm.verify_store(store)
        sizes = _named(store)
        assert report["checked"] and report["problems"] == [], (name, report)
        assert report["files"] == len(sizes) and report["bytes"] == sum(sizes.values())
        m = json.loads((store / "manifest.json").read_text())
        assert m["version"] == FORMAT_VERSION and set(m["digests"]["tails"]) == set(sizes) - {m["state"]["file"]} - (
            {m["sketch"]["file"]} if m.get("sketch") else set())
        # one record for each complete block of each file
        blocks = sum(n // SMALL_BLOCK for f, n in sizes.items() if f in m["digests"]["tails"])
        assert m["digests"]["records"] == blocks > 0


def test_every_bit_flipped_in_any_file_is_found(stores, tmp_path):
    """Each file, a bit flipped at a random place of its committed bytes: a full verify names that
    file alone; open refuses the store where the place lies in the file's last block, or in a
    file read whole (the state)."""
    rng = random.Random(0)
    store = stores["float32"]
    sizes = _named(store)
    for i, (name, n) in enumerate(sorted(sizes.items())):
        if n == 0:
            continue
        for at in {0, rng.randrange(n), n - 1}:
            s = _copy(store, tmp_path / f"{i}-{at}")
            _flip(s / name, at)
            in_tail = at >= n - n % SMALL_BLOCK
            try:
                report = emllm.verify_store(s)
            except StoreError as e:
                assert name in str(e), (name, at, e)  # (the tail's digest, or a check of the file's content)
                continue
            assert not in_tail or name.startswith(("state", "sketch")), (name, at, "open took a flipped tail")
            assert [p.split(" ")[0] for p in report["problems"]] == [name], (name, at, report)
            shutil.rmtree(s)


@pytest.mark.parametrize("written", list(FORMATS))
def test_every_other_format_claimed_by_the_manifest_is_refused(stores, tmp_path, written):
    """The manifest edited to claim any other keys-and-values format (its checksum recomputed, the
    equaliser flag made consistent): never opened, by a reader or a writer."""
    for claimed in FORMATS:
        if claimed == written:
            continue
        s = _copy(stores[written], tmp_path / claimed)
        m = json.loads((s / "manifest.json").read_text())
        m.update(kv_format=claimed, key_equaliser=claimed in ("int8", "int4") and m["key_equaliser"])
        m["checksum"] = checksum(m)
        (s / "manifest.json").write_text(json.dumps(m))
        for writable in (False, True):
            with pytest.raises(StoreError, match="digest|truncated|equaliser"):
                Store.open(s, writable=writable).close()


def test_stores_committed_in_any_rhythm_verify_and_a_resumed_one_too(tiny, tmp_path):
    folder, prof, _, _ = tiny
    text = words(6, 500)
    for every in (1, 3, 1000):
        ingest_store(tmp_path / f"e{every}", folder, prof, [("doc", text)], commit_every=every)
        assert emllm.verify_store(tmp_path / f"e{every}")["problems"] == []
    # records of blocks an interrupted commit appended are dropped with the rest of its tail
    s = tmp_path / "e3"
    m = json.loads((s / "manifest.json").read_text())
    with open(s / "digests.bin", "ab") as f:
        f.write(b"\x07" * digests.RECORD * 5)
    with open(s / "layers/00.k", "ab") as f:
        f.write(b"\x07" * 999)
    assert emllm.verify_store(s)["problems"] == []
    model, tok = load_tiny(folder)
    from emllm.app import stream
    from emllm.app.ingest import add_documents, run_job

    with Store.open(s, writable=True) as st:
        add_documents(st, tok, [("more", words(7, 120))])
        run_job(st, stream.open_engine(st, model), 2)
    assert emllm.verify_store(s)["problems"] == []
    assert json.loads((s / "manifest.json").read_text())["digests"]["records"] > m["digests"]["records"]


def test_a_store_written_before_digests_opens_answers_alike_and_stays_as_it_was(tiny, stores, tmp_path):
    folder, prof, _, _ = tiny
    model, tok = load_tiny(folder)
    s = _copy(stores["float32"], tmp_path / "old")
    before_digests(s)
    assert answers_of(s, [model], tok, 6) == answers_of(stores["float32"], [model], tok, 6)
    assert emllm.verify_store(s) == {"store": str(s), "checked": False, "files": 0, "bytes": 0, "problems": []}
    from emllm.app import stream
    from emllm.app.ingest import add_documents, run_job

    with Store.open(s, writable=True) as st:
        add_documents(st, tok, [("more", words(8, 80))])
        run_job(st, stream.open_engine(st, model), 2)
    m = json.loads((s / "manifest.json").read_text())
    assert m["version"] == 7 and "digests" not in m and not (s / "digests.bin").exists()


def test_inspect_verify_says_what_it_read_or_names_the_file(stores, tmp_path):
    s = _copy(stores["int8"], tmp_path / "s")
    r = run_in_process("inspect", str(s), "--verify", home=tmp_path / "home")
    assert r.returncode == 0 and "every committed byte as written" in r.stdout, r.stderr
    r = run_in_process("inspect", str(s), "--verify", "--json", home=tmp_path / "home")
    assert json.loads(r.stdout)["problems"] == []
    _flip(s / "layers/01.v", 3)  # the first block: only a full read finds it
    assert run_in_process("ask", QUESTION, "--store", str(s), "-n", "1", home=tmp_path / "home").returncode == 0
    r = run_in_process("inspect", str(s), "--verify", home=tmp_path / "home")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "layers/01.v has 1 block(s) that differ" in lines[0], r.stderr
    r = run_in_process("inspect", str(s), "--verify", "--query", "x", home=tmp_path / "home")
    assert r.returncode == 2 and "--verify" in r.stderr


def test_a_store_cut_back_and_written_on_differently_verifies(tiny, tmp_path):
    """After a cut back the records past the mark's count are an uncommitted tail like the rows:
    dropped at the next write, and the blocks past the mark hashed again with their new bytes."""
    from emllm.app import stream
    from emllm.app.ingest import add_documents, run_job
    from emllm.store import cut_back, save_mark

    folder, prof, _, _ = tiny
    model, tok = load_tiny(folder)
    s = tmp_path / "s"
    ingest_store(s, folder, prof, [("doc", words(9, 200))])
    save_mark(s, tmp_path / "mark")

    def append(seed: int) -> None:
        with Store.open(s, writable=True) as st:
            add_documents(st, tok, [("more", words(seed, 300))])
            run_job(st, stream.open_engine(st, model), 2)

    append(10)
    records_before = json.loads((s / "manifest.json").read_text())["digests"]["records"]
    cut_back(s, tmp_path / "mark")
    append(11)
    m = json.loads((s / "manifest.json").read_text())
    assert m["digests"]["records"] > 0 and emllm.verify_store(s)["problems"] == []
    assert records_before > 0
