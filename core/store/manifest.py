"""The manifest: what a store commits, and its validation (a store is untrusted input)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from emllm.config import Profile, ProfileError, profile_from_dict
from emllm.store.errors import StoreError
from emllm.store.files import Folder, UnsafePath
from emllm.store.identity import Geometry

# 2 added the sketch, 3 replaced its outlier lists by per-event norms (exact bounds), 4 refits it
# as the store doubles (files named by the events it was fitted on). Older stores are read (scanned:
# a version-2 sketch is not used); a version-3 sketch is a version-4 one fitted once.

FORMAT_VERSION = 9  # 5: kv_format (keys and values in a format of their own: bfloat16, int8, int4);
# 6: key_equaliser (an integer store's keys equalised per channel before they are quantised);
# 7: repr_heads (representative keys kept per KV head: mean keys of a GQA model, 1/group the bytes);
# 8: digests (every committed byte hashed: emllm.store.digests); 9: geometry.memory_layers (a model
# that mixes sliding-window and global layers keeps files for the global ones only). Every store is
# written as the newest version: an emllm before 8 could read a version-8 store, but an append of its
# own would leave the digests behind the bytes, and the store would then be refused as damaged.
MANIFEST = "manifest.json"

def checksum(manifest: dict) -> str:
    """SHA-256 of the manifest without its checksum: catches accidents (anyone can recompute it)."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()



def pending_count(manifest: dict) -> int:
    """Tokens the store's job holds and has not read yet."""
    job = manifest.get("job") or {}
    return job.get("tokens", 0) - job.get("done", 0)


def is_store(path: Path) -> bool:
    return (path / MANIFEST).is_file()



MANIFEST_LIMIT = 256 << 20  # bytes: a manifest larger than this is refused unread
MIN_VERSION = 1
_INT_LIMIT = 1 << 40  # rows, tokens, generations: far above any real store, far below overflow


def read_manifest(path: Path, folder: Folder | None = None) -> dict:
    """The committed manifest, validated: every field's type and range, and every file it names a
    plain name of this store's layout (it is read without following a link, and never past 256 MiB).
    A store is untrusted input; the checksum only catches accidents (anyone can recompute it)."""
    own = folder is None
    try:
        folder = folder or Folder(path)
    except OSError as e:
        raise StoreError(f"cannot open the store at {path}: {e.strerror or e}") from None
    try:
        raw = folder.read(MANIFEST, MANIFEST_LIMIT)
        manifest = json.loads(raw.decode("utf-8"))
    except UnsafePath as e:
        raise StoreError(f"{e}: the store is refused") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise StoreError(f"{path / MANIFEST} is unreadable ({getattr(e, 'strerror', None) or e}): the store is damaged") from None
    finally:
        if own:
            folder.close()
    if not isinstance(manifest, dict) or manifest.get("format") != "emllm-store":
        raise StoreError(f"{path} is not an emllm store (its {MANIFEST} is of another kind)")
    v = manifest.get("version")
    if type(v) is not int or v < MIN_VERSION:
        raise StoreError(f"{path} has store format version {v!r}, which no emllm wrote: the store is damaged")
    if v > FORMAT_VERSION:
        raise StoreError(
            f"{path} has store format version {v}, newer than this emllm reads ({FORMAT_VERSION}): upgrade emllm"
        )
    if manifest.get("checksum") != checksum(manifest):
        raise StoreError(f"{path / MANIFEST} fails its checksum: it was edited or damaged; restore it or re-ingest")
    try:
        _validate(manifest)
    except _Invalid as e:
        raise StoreError(f"{path / MANIFEST}: {e}: the store is damaged or was edited") from None
    return manifest


class _Invalid(Exception):
    pass


# What a store's profile meant by keys it was written without (before they existed): the values
# the code that wrote it used, whatever today's defaults are.
BEFORE_THE_KEY = {"question_centering": 0.0, "question_centering_answer": True, "representative": "attention",
                  "repr_normalise": False, "question_scoring": "mean", "distinct_events": False,
                  "answer_retrieval": "token"}


def profile_of(manifest: dict) -> Profile:
    """The profile a store was written with, validated by the rules a profile file or a flag obeys
    (ProfileError names the key)."""
    data = {**BEFORE_THE_KEY, **manifest["profile"]}
    return profile_from_dict(data, str(data.get("name")), " (in the store)")


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Invalid(what)


def _int(d: Any, key: str, lo: int = 0, hi: int = _INT_LIMIT, at: str = "") -> int:
    _need(isinstance(d, dict) and key in d, f"no {at}{key}")
    x = d[key]
    _need(type(x) is int and lo <= x <= hi, f"{at}{key} is {str(x)[:40]!r}, not an integer in [{lo}, {hi}]")
    return x


def _str(d: Any, key: str, optional: bool = False, at: str = "") -> None:
    _need(isinstance(d, dict), f"no {at}{key}")
    if optional and key not in d:
        return
    _need(isinstance(d.get(key), str), f"{at}{key} is missing or not a string")


def _validate(m: dict) -> None:
    """Every field a store's readers and writers use, its type and range (raises _Invalid)."""
    v = m["version"]
    for k in ("created", "updated"):
        _str(m, k)
    ident = m.get("identity")
    for k in ("model", "config_hash", "weights_hash", "tokenizer_hash"):
        _str(ident, k, at="identity.")
    _str(ident, "weights_sample", optional=True, at="identity.")
    prof = m.get("profile")
    _need(isinstance(prof, dict), "no profile")
    _str(prof, "name", at="profile.")
    try:
        profile_of(m)
    except ProfileError as e:
        raise _Invalid(str(e).replace(f"profile {prof['name']!r} (in the store): ", "profile.")) from None
    g = m.get("geometry")
    fields = set(Geometry.__dataclass_fields__)
    _need(isinstance(g, dict) and fields - {"memory_layers"} <= set(g) <= fields, "geometry has other fields")
    for k, hi in (("layers", 1024), ("kv_heads", 1024), ("q_heads", 4096), ("head_dim", 4096), ("vocab", 1 << 24)):
        _int(g, k, 1, hi, at="geometry.")
    _need(g["q_heads"] % g["kv_heads"] == 0, "q_heads is not a multiple of kv_heads")
    if "memory_layers" in g:  # version 9: a model whose sliding-window layers hold no memory
        ml = g["memory_layers"]
        _need(v >= 9 and isinstance(ml, list) and ml and all(type(i) is int for i in ml)
              and ml == sorted(set(ml)) and 0 <= ml[0] and ml[-1] < g["layers"],
              "geometry.memory_layers is not a list of increasing layer indices")
    _need(g["dtype"] in ("float32", "float16", "bfloat16"), f"dtype {g['dtype']!r} is not one a store holds")
    if "kv_format" in m:
        from emllm.memory.quant import FORMATS

        _need(m["kv_format"] in FORMATS, f"kv_format {m['kv_format']!r} is not one a store holds")
        _need(g["head_dim"] % 2 == 0 or m["kv_format"] != "int4", "int4 needs an even head size")
    if "repr_heads" in m:
        r = _int(m, "repr_heads", 1, 4096)
        _need(r in (g["kv_heads"], g["q_heads"]), f"repr_heads is {r}, neither the KV heads nor the query heads")
    if "key_equaliser" in m:
        _need(isinstance(m["key_equaliser"], bool), "key_equaliser is not true or false")
        _need(not m["key_equaliser"] or m.get("kv_format") in ("int8", "int4"), "key_equaliser on a store that is not integer")
    rows = m.get("rows")
    t, e, et = (_int(rows, k, at="rows.") for k in ("tokens", "events", "event_tokens"))
    _need(e <= et, f"rows do not add up ({e} events of {et} tokens)")
    if "kv_tokens" in rows:  # version 5: the layer files hold every token of the stream
        _need(_int(rows, "kv_tokens", at="rows.") == t, "rows do not add up (keys and values of another stream's length)")
    st = m.get("state")
    if st is not None:
        gen = _int(st, "generation", 1)
        _need(st.get("file") == f"state-{gen}.safetensors", "state names a file not of this store's layout")
        if "tokens" in st or "events" in st:  # a stream's state (stores of the tests' own have none)
            _need(_int(st, "tokens") == t and _int(st, "events") == e, "the state is not the one of these rows")
            _need(et <= t, f"rows do not add up ({et} event tokens in a stream of {t})")
    else:
        _need(t == 0, "rows without a state")
    job = m.get("job")
    if job is not None:
        gen = _int(job, "generation", 1, at="job.")
        _need(job.get("file") == f"job-{gen}.i32", "job names a file not of this store's layout")
        n = _int(job, "tokens", at="job.")
        _int(job, "done", 0, n, at="job.")
        _need(isinstance(job.get("complete"), bool), "job.complete is not true or false")
        if "documents" in job:
            _int(job, "documents")
    sk = m.get("sketch")
    if sk is not None:
        f = _int(sk, "trained_on", 1)
        _int(sk, "dims", 1, 4096)
        _need(sk.get("file") in ("sketch.safetensors", f"sketch-{f}.safetensors"), "sketch names a file not of this store's layout")
    docs = m.get("documents", [])
    _need(isinstance(docs, list), "documents is not a list")
    for d in docs:
        _str(d, "name")
        _str(d, "sha256", optional=True)
        _str(d, "header", optional=True)
        for k in ("start", "tokens"):
            _int(d, k)
        if "chars" in d:
            _int(d, "chars")
    if v >= 8:
        _digests(m, st, sk)
    if "stream" in m:
        s = m["stream"]
        _need(isinstance(s, dict) and isinstance(s.get("chat"), bool), "stream.chat is not true or false")
        _str(s, "prefix")
        _str(s, "suffix")


def _hex(d: Any, key: str, at: str) -> None:
    x = d.get(key) if isinstance(d, dict) else None
    _need(isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x), f"{at}{key} is not a SHA-256")


def _digests(m: dict, state: Any, sketch: Any) -> None:
    """A version-8 store's digests: their entry, and the state's and sketch's."""
    from emllm.store.digests import BLOCK, NAME

    d = m.get("digests")
    _need(isinstance(d, dict) and d.get("file") == NAME, "no digests (every store of version 8 has them)")
    _need(d.get("block") == BLOCK, f"digests.block is {str(d.get('block'))[:20]!r}, not {BLOCK}")
    _int(d, "records", at="digests.")
    tails = d.get("tails")
    _need(isinstance(tails, dict), "digests.tails is not a table")
    for name in tails:
        _need(isinstance(name, str) and len(name) < 256, "digests.tails names something that is not a file name")
        _hex(tails, name, "digests.tails.")
    if state is not None:
        _hex(state, "sha256", "state.")
    if sketch is not None:
        _hex(sketch, "sha256", "sketch.")


# -- the manifest as code outside emllm.store reads it ----------------------------------------------
@dataclass(frozen=True)
class Rows:
    tokens: int  # processed tokens of the stream
    events: int
    event_tokens: int  # tokens the events hold


@dataclass(frozen=True)
class Job:
    """The current (or last) ingest job: its tokens in the store's job file, how far it got."""

    tokens: int
    done: int
    complete: bool
    documents: int | None  # documents the job added (None: a store older than the key)

    @property
    def pending(self) -> int:
        return self.tokens - self.done


@dataclass(frozen=True)
class StreamFormat:
    """How the stream is laid out: a chat template's turns, text before the first document, after a question."""

    chat: bool
    prefix: str
    suffix: str


@dataclass(frozen=True)
class Document:
    name: str
    start: int  # its first token's stream position
    tokens: int
    sha256: str | None = None  # of its text (None: an exchange emllm laid out, or an older store)
    chars: int | None = None
    kind: str | None = None  # "exchange": a conversation's turn
    header: str | None = None  # the line naming it that opens its text (a folder's file), re-read before its passages

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Manifest:
    """A store's committed manifest, typed and validated: what code outside emllm.store reads."""

    version: int
    created: str
    updated: str
    identity: dict[str, str]  # model, config_hash, weights_hash, tokenizer_hash (, weights_sample)
    profile: Profile
    profile_keys: dict  # the profile as the store keeps it (the keys it was written with)
    geometry: Geometry
    kv_format: str
    rows: Rows
    job: Job | None
    stream: StreamFormat | None  # None: a store older than the key
    documents: tuple[Document, ...]
    has_sketch: bool

    @property
    def model(self) -> str:
        return self.identity["model"]

    @property
    def pending(self) -> int:
        """Tokens the job holds and has not read yet."""
        return self.job.pending if self.job is not None else 0

    @property
    def complete(self) -> bool:
        return self.job is None or self.job.complete

    @property
    def empty(self) -> bool:
        """Nothing in it: no rows, no job, no document (a create interrupted by an emllm that named
        its store at once)."""
        return not self.rows.tokens and self.job is None and not self.documents

    @classmethod
    def of(cls, m: dict) -> "Manifest":
        """The typed view of a manifest `read_manifest` validated."""
        job, s = m.get("job"), m.get("stream")
        g = m["geometry"]
        return cls(
            version=m["version"], created=m["created"], updated=m["updated"], identity=dict(m["identity"]),
            profile=profile_of(m), profile_keys=dict(m["profile"]), geometry=Geometry.of(g),
            kv_format=m.get("kv_format", g["dtype"]),
            rows=Rows(m["rows"]["tokens"], m["rows"]["events"], m["rows"]["event_tokens"]),
            job=Job(job["tokens"], job["done"], job["complete"], job.get("documents")) if job else None,
            stream=StreamFormat(s["chat"], s.get("prefix", ""), s.get("suffix", "")) if s else None,
            documents=tuple(Document(**{k: d.get(k) for k in Document.__dataclass_fields__}) for d in m.get("documents", [])),
            has_sketch=bool(m.get("sketch")),
        )


def read_info(path: Path) -> Manifest:
    """The typed, validated manifest of the store at `path` (StoreError where it is refused)."""
    return Manifest.of(read_manifest(path))
