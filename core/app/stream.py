"""A stream opened on a store with its model: how documents and questions are laid out in it,
the model's identity and geometry, creating a store, opening one with its model (resolve, load,
check identity: one way, for every command), and an engine continuing its stream.

    with open_store(path) as o:                 # the store's own model, checked
        engine = open_engine(o.store, o.model)
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from emllm import models
from emllm.config import Profile, ProfileMismatchError
from emllm.engine.stream import Engine, check_supported, repr_heads, sliding_layers
from emllm.models import ModelNotFoundError, ModelSource, config_hash, leading_ids
from emllm.store import Geometry, Identity, Store, StoreError, StoredEvents, tokenizer_hash, weights_hash, weights_sample


SEPARATOR = "\n\n"
_MARK = "\x00EMLLM\x00"


@dataclass(frozen=True)
class StreamFormat:
    """How documents and questions are laid out in the stream (recorded in the manifest)."""

    chat: bool
    prefix: str  # before the first document: the opening of a user turn
    suffix: str  # after the question: end of the user turn, start of the answer

    @classmethod
    def for_tokenizer(cls, tok: Any, chat: bool = True) -> "StreamFormat":
        if chat and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": _MARK}], add_generation_prompt=True, tokenize=False)
            if text.count(_MARK) == 1:
                prefix, suffix = text.split(_MARK)
                return cls(True, prefix, suffix)
        lead = leading_ids(tok)  # (a BOS-adding tokenizer's BOS: the plain model's input starts with it)
        return cls(False, tok.convert_ids_to_tokens(lead[0]) if lead else "", "\nAnswer:")


def reopen_text(tok: Any, chat: bool) -> str:
    """What follows an answer in the stream so that the next document or question is again inside
    a user turn: the template's end of the assistant's turn and start of the user's ("" without
    a chat template)."""
    if chat and getattr(tok, "chat_template", None):
        turns = [{"role": "user", "content": "A"}, {"role": "assistant", "content": _MARK + "B" + _MARK},
                 {"role": "user", "content": _MARK + "C"}]
        text = tok.apply_chat_template(turns, tokenize=False)
        parts = text.split(_MARK)
        if len(parts) == 4 and parts[1] == "B":
            return parts[2]
    return ""


def identity_of(name: str, model: Any, tok: Any) -> Identity:
    return Identity(name, config_hash(model), weights_hash(model), tokenizer_hash(tok), weights_sample(model))


def geometry_of(model: Any) -> Geometry:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    sliding = sliding_layers(cfg)
    memory_layers = tuple(i for i, w in enumerate(sliding) if w is None) if any(sliding) else None
    return Geometry(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, head_dim, cfg.vocab_size,
                    dtype, memory_layers)


def encode(tok: Any, text: str) -> list[int]:
    """Token ids of user text (a document, a question): special tokens written in it are read as
    the characters they are, so a document cannot forge the chat template's turns."""
    return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def decode_after(tok: Any, before: list[int], ids: list[int]) -> str:
    """The text `ids` add after `before`: a continuation's own text. Decoded alone, a
    SentencePiece tokenizer's (Llama 2's, Mistral's) drops the space its first word opens with."""
    if before:
        head = tok.decode(before, skip_special_tokens=True)
        full = tok.decode(before + ids, skip_special_tokens=True)
        if full.startswith(head):
            return full[len(head):]
    return tok.decode(ids, skip_special_tokens=True)


def token_texts(tok: Any, ids: list[int], before: int | None | list[int | None] = None) -> list[str]:
    """Each token's text as it reads after the token before it (`before`, then each of `ids`):
    they join to the text of `ids` read after `before`. `before` a list: each token's own
    predecessor (None: none), as for a token's alternatives."""
    if not ids:
        return []
    prev = before if isinstance(before, list) else [before] + ids[:-1]
    pairs = tok.batch_decode([[p, t] if p is not None else [t] for p, t in zip(prev, ids)])
    heads = tok.batch_decode([[p] if p is not None else [] for p in prev])
    return [pair[len(head):] if p is not None and pair.startswith(head) else tok.decode([t])
            for p, t, pair, head in zip(prev, ids, pairs, heads)]


def logprob_texts(tok: Any, entries: list, before: int | None = None) -> list[tuple[str, list[str]]]:
    """For each TokenLogprob of a run of tokens (`entries`, after the token `before`): its token's
    text and its alternatives', each read after the token before it (`token_texts`), in one pass."""
    ids = [e.token for e in entries]
    prev = [before] + ids[:-1]
    alts = iter(token_texts(tok, [t for e in entries for t, _ in e.top], [p for p, e in zip(prev, entries) for _ in e.top]))
    return [(text, [next(alts) for _ in e.top]) for e, text in zip(entries, token_texts(tok, ids, before))]


def encode_framing(tok: Any, text: str) -> list[int]:
    """Token ids of emllm's own framing (the chat template's prefix and suffix): special tokens count."""
    return tok(text, add_special_tokens=False)["input_ids"]


def create_store(path: Path, model_name: str, model: Any, tok: Any, profile: Profile, chat: bool = True,
                 kv_format: str | None = None) -> Store:
    """A new store for `model`; keys and values kept in `kv_format` (float32, bfloat16, int8, int4;
    None or "auto": the model's compute dtype, lossless)."""
    check_supported(model)  # before its geometry is read: an unsupported config may lack the fields
    fmt = StreamFormat.for_tokenizer(tok, chat)
    g = geometry_of(model)
    return Store.create(
        path, identity_of(model_name, model, tok), profile_dict(profile), g,
        extra={"stream": asdict(fmt)}, kv=None if kv_format == "auto" else kv_format,
        repr_heads=repr_heads(profile, g.kv_heads, g.q_heads),
    )


def store_profile(store: Store) -> Profile:
    return store.info.profile


def open_engine(store: Store, model: Any, kv_cache_mb: int | None = None) -> Engine:
    """An engine that continues the store's stream: its events are the store's, its state the
    last committed one. kv_cache_mb: RAM for recently read events (None: the profile's)."""
    mine = geometry_of(model)
    if mine.dtype != store.geometry.dtype and dataclasses.replace(mine, dtype=store.geometry.dtype) == store.geometry:
        raise StoreError(f"{store.path}: the store computes in {store.geometry.dtype}, this model in {mine.dtype}: "
                         f"load the model with --dtype {store.geometry.dtype}")
    if mine != store.geometry:
        raise StoreError(f"{store.path}: the store's geometry ({_geometry_text(store.geometry)}) is not this "
                         f"model's ({_geometry_text(mine)}): the store is damaged, or of another model")
    profile = store_profile(store)
    if store.repr_heads != store.geometry.q_heads and profile.representative != "mean":
        raise StoreError(f"{store.path}: representative keys per KV head with representative "
                         f"{profile.representative!r}: the store is damaged or was edited")
    engine = Engine(model, profile, memory=lambda i: StoredEvents(store, i, kv_cache_mb))
    engine.source = str(store.path)
    state = store.load_state()
    if state:
        try:
            engine.load_state_dict(state, store.tokens.read(), store.surprise.read(), store.flags.read())
        except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as e:
            raise StoreError(f"{store.path}: its state does not fit the model ({e}): the store is damaged") from None
    if engine.n_tokens != store.tokens.rows or engine.n_events != store.events.rows:
        raise StoreError(f"{store.path}: the state does not match the arrays: the store is damaged; re-ingest")
    return engine


def _geometry_text(g: Geometry) -> str:
    mem = "" if g.memory_layers is None else f" (memory in {', '.join(map(str, g.memory_layers))})"
    return f"{g.layers} layers{mem}, {g.q_heads}/{g.kv_heads} heads of {g.head_dim}, vocabulary {g.vocab}, {g.dtype}"


def pending_tokens(store: Store) -> list[int]:
    """Tokens received but not processed yet (less than a chunk once a job is complete)."""
    job = store.info.job
    return store.job.read(job.done, job.tokens).tolist() if job is not None and store.job is not None else []


def opens_a_turn(store: Store, tok: Any, pending: list[int]) -> bool:
    """Whether the stream (the store's tokens, then `pending`) ends with the chat template's
    reopening of a user turn, as a remembered exchange leaves it: what comes next is that turn's
    text, laid out as the template lays it out, with no SEPARATOR before it."""
    reopen = encode_framing(tok, reopen_text(tok, store.info.stream.chat))
    if not reopen:
        return False
    k = len(reopen)
    last = pending[-k:]
    if len(last) < k:
        last = store.tokens.read(max(0, store.tokens.rows - (k - len(last)))).tolist() + last  # (its last rows only)
    return last == reopen


def profile_dict(p: Profile) -> dict:
    d = asdict(p)
    d["aliases"] = list(d["aliases"])
    return d


@dataclass
class OpenStore:
    """A store opened with the model it was written with (loaded and checked)."""

    store: Store
    model: Any
    tok: Any
    source: ModelSource

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> "OpenStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(path: Path, writable: bool = False, model: str | None = None, profile: str | None = None,
               log: Callable[[str], None] | None = None, dtype: str | None = None) -> OpenStore:
    """Open the store at `path` with its model: the one it records, or `model` (another name for the
    same weights, e.g. a moved folder), loaded and checked against the store's identity (config,
    weights, tokenizer); `profile`, if given, must be the store's. Raises StoreError (or a subclass:
    ModelMismatchError), ProfileMismatchError, or the model's errors; the store is closed then.

    The model computes in the dtype the store was computed in (its stream continues exactly);
    `dtype`, if given, must resolve to that one."""
    st = Store.open(path, writable=writable)
    try:
        name = st.info.model
        try:
            src = models.resolve(model or name, log=log)
        except ModelNotFoundError as e:
            if model is not None:
                raise
            if not Path(name).is_absolute():  # an alias, a hub id (org/name): what to install or fetch says the rest
                raise ModelNotFoundError(f"{path}: the store's model: {e}") from None
            raise ModelNotFoundError(f"{path}: the store's model {name} is not there (moved or deleted): name it where "
                                     "it is now (--model PATH; emllm.open(..., model=PATH)), checked against the "
                                     "weights the store was written with") from None
        prof = store_profile(st)
        if profile is not None and models.load_profile(profile, prof) != prof:
            raise ProfileMismatchError(f"the store uses profile {prof.name!r}; a store keeps one profile")
        stored = st.geometry.dtype
        if dtype is not None and str(models.compute_dtype(dtype)).removeprefix("torch.") != stored:
            raise StoreError(f"{path}: the store computes in {stored} (fixed when it was created); "
                             f"--dtype {dtype} cannot continue it: omit --dtype, or ingest into a new store")
        mdl, tok = models.load(src, dtype=stored)
        st.check_identity(identity_of(name, mdl, tok))
    except BaseException:
        st.close()
        raise
    return OpenStore(st, mdl, tok, src)


__all__ = [
    "SEPARATOR", "StreamFormat", "opens_a_turn", "OpenStore", "open_store", "create_store", "open_engine", "pending_tokens",
    "identity_of", "geometry_of", "store_profile", "encode", "encode_framing", "reopen_text",
]
