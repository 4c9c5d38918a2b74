"""A store is untrusted input: damaged and hostile stores, each under every command that opens it.

For each case a good store is copied, damaged, and surrounded by decoys outside it (files and a
folder its links and names point at). Each command must end with exit code 1 and one line on
stderr (no traceback, no "internal error"); every decoy must keep its bytes and never be opened
(inotify watches them); the store's own files must be unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from inotify_simple import INotify, flags as inflags

from emllm.store.manifest import checksum as _checksum
from .helpers import before_digests, ingest_store, reseal, run, run_in_process, words


DECOY = b"decoy: a file outside the store that emllm must never open\n"


@pytest.fixture(scope="module")
def good_store(tiny, tmp_path_factory) -> Path:  # noqa: F811
    folder, prof, _, _ = tiny
    root = tmp_path_factory.mktemp("good")
    ingest_store(root / "s", folder, prof, [("doc", words(3, 300))])
    return root / "s"


@pytest.fixture(scope="module")
def good_int4_store(tiny, tmp_path_factory) -> Path:  # noqa: F811
    folder, prof, _, _ = tiny
    root = tmp_path_factory.mktemp("good4")
    ingest_store(root / "s", folder, prof, [("doc", words(3, 300))], kv_format="int4")
    return root / "s"


def _equaliser(store: Path, layer: int, row: int, value: float) -> None:
    """Overwrite one row (0: centre, 1: scale) of a layer's key equaliser."""
    p = store / "layers" / f"{layer:02d}.e"
    eq = torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.float32).reshape(2, -1)
    eq[row] = value
    p.write_bytes(eq.numpy().tobytes())
    reseal(store)  # (crafted: what digests cannot refuse, the reader must)


def _manifest(store: Path, change) -> None:
    """Edit the manifest as an attacker would: the checksum recomputed (anyone can)."""
    m = json.loads((store / "manifest.json").read_text())
    change(m)
    m["checksum"] = _checksum(m)
    (store / "manifest.json").write_text(json.dumps(m))


def _link(store: Path, rel: str, target: Path) -> None:
    (store / rel).unlink()
    (store / rel).symlink_to(target)


def _state_of_other_shapes(store: Path, key: str = "layer0.local_mass", value=None) -> None:
    from safetensors.torch import load_file, save_file

    name = json.loads((store / "manifest.json").read_text())["state"]["file"]
    st = load_file(str(store / name))
    st[key] = torch.zeros(7, 5) if value is None else value  # (the window's keys are rows of the layer files)
    save_file(st, str(store / name))
    reseal(store)


def _events(store: Path, lengths: list[int]) -> None:
    (store / "events.i32").write_bytes(torch.tensor(lengths, dtype=torch.int32).numpy().tobytes())
    reseal(store)


def _flip(store: Path, rel: str, at: int) -> None:
    """Flip one bit of a file at byte `at` (from its end where negative)."""
    p = store / rel
    b = bytearray(p.read_bytes())
    b[at] ^= 0x10
    p.write_bytes(bytes(b))


def _not_finite(store: Path, rel: str, sealed: bool, where: slice = slice(None)) -> None:
    """NaN in a layer's key or value file (all of it, or rows `where` of 64 numbers): a store
    written before digests (`sealed` False), or one crafted with its digests recomputed."""
    p = store / rel
    x = torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.float32)
    x.view(-1, 64)[where] = float("nan")
    p.write_bytes(x.numpy().tobytes())
    reseal(store) if sealed else before_digests(store)


def _kv_format(m: dict, name: str) -> None:
    m.update(kv_format=name, key_equaliser=name in ("int8", "int4") and m.get("key_equaliser", False))


def _fifo(store: Path, rel: str) -> None:
    (store / rel).unlink()
    os.mkfifo(store / rel)


def _hard_link(store: Path, rel: str, target: Path) -> None:
    (store / rel).unlink()
    os.link(target, store / rel)


# case: (damage(store, outside), commands, words the message must hold)
READ, WRITE, RESUME, INSPECT = "ask", "append", "resume", "inspect"
RECALL = "ask from the memory"  # the events' own keys and values, not the re-read
CASES = {
    "job file ../../x": (lambda s, o: _manifest(s, lambda m: m["job"].update(file="../../outside/decoy")),
                         (READ, WRITE, RESUME, INSPECT), "not of this store's layout"),
    "state file by absolute path": (lambda s, o: _manifest(s, lambda m: m["state"].update(file=str(o / "decoy"))),
                                    (READ, WRITE, INSPECT), "not of this store's layout"),
    "sketch file ../x": (lambda s, o: _manifest(s, lambda m: m.update(sketch={"file": "../outside/decoy", "dims": 4, "trained_on": 1})),
                         (READ, WRITE), "not of this store's layout"),
    "tokens.i32 a link out": (lambda s, o: _link(s, "tokens.i32", o / "decoy"), (READ, WRITE, RESUME), "symbolic link"),
    "events.i32 a link to passwd": (lambda s, o: _link(s, "events.i32", o / "passwd"), (READ, WRITE, INSPECT), "symbolic link"),
    "layers/00.k a link out": (lambda s, o: _link(s, "layers/00.k", o / "decoy"), (READ, WRITE), "symbolic link"),
    "layers a link to a folder": (lambda s, o: (shutil.rmtree(s / "layers"), (s / "layers").symlink_to(o / "dir")),
                                  (READ, WRITE, INSPECT), "link"),
    "manifest a link": (lambda s, o: _link(s, "manifest.json", o / "manifest.json"), (READ, WRITE, INSPECT), "symbolic link"),
    "lock a link": (lambda s, o: _link(s, "lock", o / "decoy"), (WRITE,), "symbolic link"),
    "tokens.i32 a FIFO": (lambda s, o: _fifo(s, "tokens.i32"), (READ, WRITE), "not a regular file"),
    "tokens.i32 a hard link out": (lambda s, o: _hard_link(s, "tokens.i32", o / "hard"), (WRITE,), "hard link"),
    "zero rows, huge head_dim": (lambda s, o: reseal(s, lambda m: (m["rows"].update(tokens=0, events=0, event_tokens=0, kv_tokens=0),
                                                                     m.update(state=None), m["geometry"].update(head_dim=4096))),
                                 (WRITE, READ), "geometry"),
    # (crafted: the digests recomputed)
    "head_dim edited": (lambda s, o: reseal(s, lambda m: m["geometry"].update(head_dim=8)), (READ, WRITE), "geometry"),
    # opened in the dtype it names, the model hashes otherwise: refused as weights that differ
    "dtype edited": (lambda s, o: reseal(s, lambda m: m["geometry"].update(dtype="bfloat16")), (READ, WRITE), "weights differ"),
    # the bytes tied to what the manifest says they are: a layout edited, a bit flipped, digests gone
    "head_dim edited, digests kept": (lambda s, o: _manifest(s, lambda m: m["geometry"].update(head_dim=8)),
                                      (READ, WRITE, INSPECT), "differ from their digest"),
    "kv_format edited to bfloat16": (lambda s, o: _manifest(s, lambda m: _kv_format(m, "bfloat16")), (READ, WRITE, INSPECT), "another format"),
    "kv_format edited to int8": (lambda s, o: _manifest(s, lambda m: _kv_format(m, "int8")), (READ, WRITE, INSPECT), "another format"),
    "kv_format edited to int4": (lambda s, o: _manifest(s, lambda m: _kv_format(m, "int4")), (READ, WRITE, INSPECT), "another format"),
    "kv_format int4 edited to int8": (lambda s, o: _manifest(s, lambda m: _kv_format(m, "int8")), (READ, WRITE), "truncated", "int4"),
    "kv_format int4 edited to float32": (lambda s, o: _manifest(s, lambda m: _kv_format(m, "float32")), (READ, WRITE), "truncated", "int4"),
    "repr_heads edited": (lambda s, o: _manifest(s, lambda m: m.update(repr_heads=m["geometry"]["q_heads"])), (READ, WRITE), "truncated"),
    "a bit flipped in the last block of layers/01.v": (lambda s, o: _flip(s, "layers/01.v", -5), (READ, WRITE, INSPECT), "layers/01.v"),
    "a bit flipped in tokens.i32": (lambda s, o: _flip(s, "tokens.i32", -1), (READ, WRITE), "tokens.i32"),
    "a bit flipped in the state": (lambda s, o: _flip(s, json.loads((s / "manifest.json").read_text())["state"]["file"], -3),
                                   (READ, WRITE), "differ from their digest"),
    "digests missing": (lambda s, o: _manifest(s, lambda m: m.pop("digests")), (READ, WRITE, INSPECT), "no digests"),
    "digests of another file": (lambda s, o: _manifest(s, lambda m: m["digests"]["tails"].update({"layers/99.k": "0" * 64})),
                                (READ, WRITE), "not one of the store's files"),
    "digests.bin shorter than its records": (lambda s, o: _manifest(s, lambda m: m["digests"].update(records=3)), (READ, WRITE),
                                             "digests.bin is truncated"),
    # the window's rows are read at open; an event's when it is retrieved
    "NaN keys, before digests": (lambda s, o: _not_finite(s, "layers/01.k", False), (READ, WRITE), "not finite"),
    "NaN values, digests recomputed": (lambda s, o: _not_finite(s, "layers/00.v", True), (READ, WRITE), "not finite"),
    "NaN in events' keys, digests recomputed": (lambda s, o: _not_finite(s, "layers/00.k", True, slice(8, 40)), (RECALL,), "not finite"),
    "kv_tokens not the stream's": (lambda s, o: _manifest(s, lambda m: m["rows"].update(kv_tokens=m["rows"]["tokens"] - 1)),
                                   (READ, WRITE), "rows do not add up"),
    "kv_format unknown": (lambda s, o: _manifest(s, lambda m: m.update(kv_format="int3")), (READ, WRITE), "kv_format"),
    "dtype unknown": (lambda s, o: _manifest(s, lambda m: m["geometry"].update(dtype="int8")), (READ,), "dtype"),
    "event lengths huge": (lambda s, o: _events(s, [1 << 30] * (json.loads((s / "manifest.json").read_text())["rows"]["events"])),
                           (READ, WRITE, INSPECT), "events.i32 does not match"),
    "event lengths negative": (lambda s, o: _events(s, [-1] * (json.loads((s / "manifest.json").read_text())["rows"]["events"])),
                               (READ,), "events.i32 does not match"),
    "rows past the files": (lambda s, o: _manifest(s, lambda m: (m["rows"].update(tokens=m["rows"]["tokens"] * 100,
                                                                                 kv_tokens=m["rows"]["tokens"] * 100),
                                                                m["state"].update(tokens=m["rows"]["tokens"]))),
                            (READ, WRITE), "truncated"),
    "version 0": (lambda s, o: _manifest(s, lambda m: m.update(version=0)), (READ, WRITE, INSPECT), "version 0"),
    "version from the future": (lambda s, o: _manifest(s, lambda m: m.update(version=99)), (READ,), "upgrade emllm"),
    "state of other shapes": (lambda s, o: _state_of_other_shapes(s), (READ, WRITE), "state does not fit"),
    "running mean query not finite": (lambda s, o: _state_of_other_shapes(s, "layer1.query_sum", torch.full((4, 16), float("nan"))),
                                      (READ, WRITE), "state does not fit"),
    "negative query count": (lambda s, o: _state_of_other_shapes(s, "layer0.query_n", torch.tensor(-3)),
                             (READ, WRITE), "state does not fit"),
    "state not safetensors": (lambda s, o: ((s / json.loads((s / "manifest.json").read_text())["state"]["file"]).write_bytes(b"\xff" * 64),
                                            reseal(s)), (READ,), "cannot read state"),
    "profile n_local 10**12": (lambda s, o: _manifest(s, lambda m: m["profile"].update(n_local=10**12)), (READ, WRITE), "n_local"),
    # a store's profile obeys the rules of a profile file (emllm.config's); show and list refuse it too
    "profile memory budget 0": (lambda s, o: _manifest(s, lambda m: m["profile"].update(n_mem=0)), (READ, WRITE, INSPECT), "n_mem"),
    "profile chunk past the window": (lambda s, o: _manifest(s, lambda m: m["profile"].update(chunk_size=10**6)),
                                      (READ, WRITE, INSPECT), "chunk_size"),
    "profile segmentation unknown": (lambda s, o: _manifest(s, lambda m: m["profile"].update(segmentation="XYZ")),
                                     (READ, INSPECT), "segmentation"),
    "profile key unknown": (lambda s, o: _manifest(s, lambda m: m["profile"].update(secret=1)), (READ, INSPECT), "unknown key"),
    "profile gamma NaN": (lambda s, o: _manifest(s, lambda m: m["profile"].update(gamma=float("nan"))), (READ,), "gamma"),
    "identity missing": (lambda s, o: _manifest(s, lambda m: m.pop("identity")), (READ, WRITE, INSPECT), "identity"),
    "rows not numbers": (lambda s, o: _manifest(s, lambda m: m["rows"].update(tokens="many")), (READ, INSPECT), "tokens"),
    "job done past its tokens": (lambda s, o: _manifest(s, lambda m: m["job"].update(done=10**9)), (READ, RESUME), "done"),
    "job tokens outside the vocabulary": (lambda s, o: ((s / json.loads((s / "manifest.json").read_text())["job"]["file"]).write_bytes(
        torch.full((json.loads((s / "manifest.json").read_text())["job"]["tokens"],), 10**8, dtype=torch.int32).numpy().tobytes()),
        reseal(s)), (READ, RESUME), "outside the vocabulary"),
    "manifest not JSON": (lambda s, o: (s / "manifest.json").write_text("{\"format\": "), (READ, INSPECT), "unreadable"),
    "manifest nested deep": (lambda s, o: (s / "manifest.json").write_text("[" * 100000 + "]" * 100000), (READ,), "unreadable"),
    "manifest a list": (lambda s, o: (s / "manifest.json").write_text("[]"), (READ,), "not an emllm store"),
    "key_equaliser not true or false": (lambda s, o: _manifest(s, lambda m: m.update(key_equaliser="yes")), (READ, WRITE), "key_equaliser"),
    "key_equaliser on a float store": (lambda s, o: _manifest(s, lambda m: m.update(key_equaliser=True)), (READ, WRITE), "not integer"),
    # an int4 store's key equalisers (layers/NN.e)
    "key equaliser scale zero": (lambda s, o: _equaliser(s, 1, 1, 0.0), (READ, WRITE), "not a key equaliser", "int4"),
    "key equaliser centre NaN": (lambda s, o: _equaliser(s, 0, 0, float("nan")), (READ, WRITE), "not a key equaliser", "int4"),
    "key equaliser missing": (lambda s, o: (s / "layers/00.e").unlink(), (READ, WRITE), "missing", "int4"),
    "key equaliser truncated": (lambda s, o: (s / "layers/01.e").write_bytes(b"\0" * 8), (READ, WRITE), "truncated", "int4"),
    "key equaliser a link out": (lambda s, o: _link(s, "layers/00.e", o / "decoy"), (READ, WRITE), "symbolic link", "int4"),
}


EXECUTABLE_CASES = ("job file ../../x", "tokens.i32 a FIFO", "manifest nested deep")


def _decoys(outside: Path) -> None:
    outside.mkdir()
    for name in ("decoy", "passwd", "hard"):
        (outside / name).write_bytes(DECOY + name.encode())
    (outside / "dir").mkdir()
    for i in range(2):
        (outside / "dir" / f"{i:02d}.k").write_bytes(DECOY)
    (outside / "manifest.json").write_text("{}")


def _hashes(folder: Path) -> dict[str, str]:
    """Each entry under folder: a file's sha256, a link's target (links are not followed)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            if p.is_symlink():
                out[str(p.relative_to(folder))] = "-> " + os.readlink(p)
            elif p.is_file() and name != "lock":
                out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _args(cmd: str, store: Path, doc: Path) -> list[str]:
    return {READ: ["ask", "what is it?", "--store", str(store), "-n", "2"],
            WRITE: ["ingest", str(doc), "--append", "--store", str(store)],
            RECALL: ["ask", "what is it?", "--store", str(store), "-n", "2", "--no-reread"],
            RESUME: ["ingest", "--resume", "--store", str(store)],
            INSPECT: ["inspect", str(store)]}[cmd]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_store_is_refused_and_nothing_outside_it_is_touched(case, request, tmp_path):
    damage, commands, needle, *kind = CASES[case]
    good_store = request.getfixturevalue("good_int4_store" if kind == ["int4"] else "good_store")
    outside = tmp_path / "outside"
    _decoys(outside)
    store = tmp_path / "store"
    shutil.copytree(good_store, store, symlinks=True)
    damage(store, outside)
    doc = tmp_path / "more.txt"
    doc.write_text(words(4, 40))
    before_out = _hashes(outside)
    before = _hashes(store)
    watch = INotify()
    mask = inflags.OPEN | inflags.ACCESS | inflags.MODIFY | inflags.ATTRIB | inflags.DELETE | inflags.CREATE | inflags.MOVED_FROM
    for d in (outside, outside / "dir"):
        watch.add_watch(str(d), mask)
    rows = []
    try:
        for cmd in commands:
            # the executable itself for the first cases; the others run its entry point in this
            # process (the same code and output, ~3 s less start-up a command)
            if case in EXECUTABLE_CASES:
                r = run(*_args(cmd, store, doc), home=tmp_path / "home", timeout=600)
            else:
                r = run_in_process(*_args(cmd, store, doc), home=tmp_path / "home")
            lines = r.stderr.strip().splitlines()
            rows.append({"case": case, "command": cmd, "exit": r.returncode, "message": r.stderr.strip().replace(str(tmp_path), "…")})
            assert r.returncode == 1, (cmd, r.stdout, r.stderr)
            assert len(lines) == 1 and lines[0].startswith("emllm: error:"), (cmd, r.stderr)
            assert "internal error" not in r.stderr and "Traceback" not in r.stderr, (cmd, r.stderr)
            assert needle in r.stderr, (cmd, r.stderr)
            events = watch.read(timeout=0)
            assert not events, (cmd, [(e, watch) for e in events])
    finally:
        watch.close()
    assert _hashes(outside) == before_out
    assert _hashes(store) == before
    if os.environ.get("EMLLM_HOSTILE_TABLE"):  # the table of the closing note
        with open(os.environ["EMLLM_HOSTILE_TABLE"], "a") as f:
            for row in rows:
                f.write(json.dumps({**row, "outside touched": "none", "store unchanged": True}) + "\n")


def test_names_from_a_store_are_shown_escaped(good_store, tmp_path):
    """A document's name with an escape sequence and Rich markup is printed as the characters it is."""
    store = tmp_path / "store"
    shutil.copytree(good_store, store)
    _manifest(store, lambda m: m["documents"][0].update(name="\x1b[2J\x1b]0;pwned\x07[bold red]x[/]"))
    r = run("inspect", str(store), home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    assert "\\x1b[2J" in r.stdout and "[bold red]x[/]" in r.stdout
