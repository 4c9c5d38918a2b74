"""Profiles: the EM-LLM parameters of one model family, loaded from `profiles/*.yaml` and validated.

A profile is data, not code: every key is a field of `Profile`, unknown keys and bad values are
errors (`ProfileError`) with a message that names the file, the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from emllm.errors import EmllmError, UsageError

import yaml

SEGMENTATIONS = ("F", "S", "SM", "SC", "FM", "FC")


class ProfileError(EmllmError, ValueError):
    """A profile that cannot be used; the message is meant for the user."""


class ProfileMismatchError(ProfileError):
    """A profile other than the one a store keeps."""


# Far above any real setting, far below what would exhaust memory or overflow: a profile (or a
# store's copy of one) is input, and n_local: 10**12 must be refused, not allocated.
_INT_MAX = 1 << 24
REPRESENTATIVES = ("attention", "mean")
QUESTION_SCORINGS = ("mean", "max", "lse")
ANSWER_RETRIEVALS = ("token", "question")
DTYPES = ("auto", "float32", "bfloat16")
SURPRISE_HEADS = ("full", "shortlist")


@dataclass(frozen=True)
class Rule:
    """What values a profile key takes (a field's metadata["rule"]): `validate` checks them all."""

    kind: str  # "int", "number", "bool", "choice", "text", "texts"
    lo: float | None = None
    hi: float | None = None
    hi_open: bool = False  # numbers: hi itself excluded
    null: bool = False  # None allowed
    choices: tuple[str, ...] = ()

    def why(self, v: Any) -> str | None:
        """Why `v` is refused (None: it is allowed)."""
        if v is None and self.null:
            return None
        null = " or null" if self.null else ""
        if self.kind == "int":
            if not isinstance(v, int) or isinstance(v, bool) or v < self.lo:
                return f"must be an integer >= {self.lo}{null}, got {v!r}"
            if v > self.hi:
                return f"must be at most {self.hi}, got {v!r}"
        elif self.kind == "number":
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
            if ok and self.lo is not None:
                ok = self.lo <= v and (v < self.hi if self.hi_open else v <= self.hi)
            if not ok:
                where = "" if self.lo is None else f" in [{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
                return f"must be a number{where}{null}, got {v!r}"
        elif self.kind == "bool":
            if not isinstance(v, bool):
                return f"must be true or false, got {v!r}"
        elif self.kind == "choice":
            if v not in self.choices:
                return f"must be one of {', '.join(self.choices)}, got {v!r}"
        elif self.kind == "text":
            if not isinstance(v, str):
                return f"must be text, got {v!r}"
        elif self.kind == "texts":
            if not isinstance(v, (tuple, list)) or not all(isinstance(x, str) for x in v):
                return f"must be a list of names, got {v!r}"
        return None


def _key(default: Any, rule: Rule) -> Any:
    return field(default=default, metadata={"rule": rule})


def _int(default: int | None, lo: int, null: bool = False) -> Any:
    return _key(default, Rule("int", lo, _INT_MAX, null=null))


def _number(default: float, lo: float | None = None, hi: float | None = None, hi_open: bool = False) -> Any:
    return _key(default, Rule("number", lo, hi, hi_open))


def _bool(default: bool) -> Any:
    return _key(default, Rule("bool"))


def _choice(default: str, choices: tuple[str, ...]) -> Any:
    return _key(default, Rule("choice", choices=choices))


@dataclass(frozen=True)
class Profile:
    name: str = field(metadata={"rule": Rule("text")})
    model: str = _key("", Rule("text"))  # what `--model <alias>` loads: "embedded:smollm2" or a hub id
    description: str = _key("", Rule("text"))
    chunk_size: int = _int(512, 1)
    n_init: int = _int(128, 0)
    n_local: int = _int(4096, 1)
    n_mem: int = _int(2048, 1)  # retrieved tokens per layer (the budget is counted in tokens)
    repr_topk: int = _int(4, 1)
    min_block: int = _int(8, 1)
    max_block: int = _int(128, 1)
    gamma: float = _number(1.0)
    tau: int | None = _int(None, 2, null=True)  # None: n_local - chunk_size (spec §2)
    segmentation: str = _choice("S", SEGMENTATIONS)
    contiguity: bool = _bool(False)
    contiguity_ratio: float = _number(0.3, 0.0, 1.0, hi_open=True)
    neighbours: int = _int(1, 0)
    refine_from_layer: int | None = _int(None, 0, null=True)  # None: the last third of the layers
    # Events per layer from which an engine in RAM searches a faiss graph (approximate candidates,
    # re-scored exactly) instead of scoring every event; null: always exact, the default (the graph
    # lost passkeys that exact search found: docs/benchmarks.md).
    faiss_threshold: int | None = _int(None, 1, null=True)
    # Events per layer from which a store keeps a sketch of its representative keys (its readers'
    # selections stay exact; null: never). Unset where faiss_threshold is set: the same value, as
    # profiles and stores written before the two keys were separate meant.
    sketch_threshold: int | None = _int(20000, 1, null=True)
    # RAM for recently read events' keys and values, all layers (stores; 0: none): the page cache
    # serves most re-reads, and a layer keeps its last step's events anyway (engine/window.py).
    kv_cache_mb: int = _int(0, 0)
    # RAM for every event's representative key, all layers (stores): retrieval then estimates all
    # scores with one matrix-vector product and scores exactly only the events that can be
    # selected (memory/prune.py; the same selection). Past it: the exact scan of the files.
    repr_cache_mb: int = _int(2048, 0)
    # Retrieval scores each event against the query minus this share of the layer's running mean
    # query (0: the paper's plain inner product): an event that aligns with the mean query (a
    # "hub", selected for any query) loses that advantage.
    query_centering: float = _number(0.0, 0.0, 1.0)
    # The same, only while a question is read and answered (after `Engine.begin_question`; 0: as
    # query_centering): the document is read with the paper's scoring, the question's retrieval
    # is taken away from the hubs. Stores keep the scoring they were made with.
    question_centering: float = _number(1.0, 0.0, 1.0)
    # Whether the answer's tokens score with question_centering too; false: only the question's
    # chunks do (centring the answer made digits drift while a retrieved needle was copied).
    question_centering_answer: bool = _bool(False)
    # What a generated answer's tokens attend to in memory: "question", the events the question's
    # last chunk retrieved, kept for the whole answer (no retrieval per token: a token copying one
    # value of a list does not take the memory away from the others, and a GPU's decode step runs
    # no selection); "token" (the paper's), the events each token's own query retrieves. Only after
    # a question (`Engine.begin_question`); a document's continuation retrieves at every token.
    answer_retrieval: str = _choice("question", ANSWER_RETRIEVALS)
    # How a question's chunk scores events: "mean" (the paper's), its tokens' mean query; "max",
    # every token scores every event, each token's scores standardised over the events (z-scores),
    # an event taking its best token's, so that the one token that singles a needle out is not
    # averaged away; "lse", a soft maximum of those z-scores (`selection.token_lse`), so that an
    # event several tokens find also gains. Only while a question is read and for chunks of several
    # tokens; it needs the centring above. Stores keep the scoring they were made with.
    question_scoring: str = _choice("lse", QUESTION_SCORINGS)
    # Identical events (the same token ids: `emllm.memory.distinct`) take one place in a question's
    # selection: the best scoring of each set first, the other copies only fill what is left (a
    # conversation's template framing and repeated replies made copies that crowded facts out).
    # Only where the question's tokens score every event ("max", "lse").
    distinct_events: bool = _bool(True)
    # Representative keys scaled to unit length per head when events close: an event then scores
    # the sum over heads of |q_h| cos(q_h, r_h), and long keys win no more often.
    repr_normalise: bool = _bool(True)
    # What an event's representative key is: "attention" (the paper's), the mean pre-RoPE key of
    # the repr_topk tokens that drew the most attention in the local window; "mean", the mean key
    # of all its tokens, which needs no attention mass (docs/benchmarks.md compares them).
    representative: str = _choice("mean", REPRESENTATIVES)
    # How surprise is computed: "full", every token's logits over the whole vocabulary (exact);
    # "shortlist", over the tokens a chunk makes likely (exact there) and a sample standing for the
    # rest (`math.surprise.shortlist_nll`), for models whose head outweighs the rest of the model
    # (Gemma 3's 262k vocabulary): boundaries then cost a small share of a chunk instead of most of it.
    surprise_head: str = _choice("full", SURPRISE_HEADS)
    # compute dtype: auto is bfloat16 where the device computes it natively (CUDA, CPUs with
    # AVX-512 BF16 or AMX), else float32. A store records the dtype it was computed in.
    dtype: str = _choice("auto", DTYPES)
    aliases: tuple[str, ...] = field(default_factory=tuple, metadata={"rule": Rule("texts")})

    @property
    def surprise_window(self) -> int:
        if self.tau is not None:
            return self.tau
        # Spec §2: the tokens of the window before the chunk; the whole window if the chunk fills it.
        return self.n_local - self.chunk_size if self.n_local - self.chunk_size >= 2 else self.n_local

    def replace(self, **changes: Any) -> "Profile":
        return validate(dataclasses.replace(self, **changes))


def validate(p: Profile, where: str = "") -> Profile:
    """`p` if every key obeys its field's rule and the keys agree with each other, else ProfileError."""
    def bad(key: str, why: str) -> ProfileError:
        return ProfileError(f"profile {p.name!r}{where}: {key}: {why}")

    for f in dataclasses.fields(Profile):
        why = f.metadata["rule"].why(getattr(p, f.name))
        if why is not None:
            raise bad(f.name, why)
    if p.min_block > p.max_block:
        raise bad("min_block", f"({p.min_block}) must not exceed max_block ({p.max_block})")
    if p.chunk_size > p.n_local:
        raise bad("chunk_size", f"({p.chunk_size}) must not exceed n_local ({p.n_local})")
    return p


_FIELDS = {f.name for f in dataclasses.fields(Profile)}


def profile_from_dict(data: Any, name: str, where: str = "", base: Profile | None = None) -> Profile:
    """The profile `data` (a YAML file's mapping) sets; keys it leaves out are `base`'s (the model's
    own profile), or Profile's defaults where there is no base."""
    if not isinstance(data, dict):
        raise ProfileError(f"profile {name!r}{where}: expected a mapping of keys to values")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ProfileError(
            f"profile {name!r}{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_FIELDS - {'name'}))})"
        )
    data = dict(data)
    data.setdefault("name", name)
    if "sketch_threshold" not in data and "faiss_threshold" in data:  # written before the key existed:
        data["sketch_threshold"] = data["faiss_threshold"]  # the sketch followed faiss_threshold
    if "aliases" in data:
        data["aliases"] = tuple(data["aliases"] or ())
    if base is not None:  # (its aliases name the model's profile, not this one)
        data = {**{f: getattr(base, f) for f in _FIELDS}, "aliases": (), **data}
    return validate(Profile(**data), where)


def load_profile_file(path: str | Path, base: Profile | None = None) -> Profile:
    """A profile from a YAML file: the keys it sets over `base`'s (see `profile_from_dict`)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ProfileError(f"cannot read profile {str(path)!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ProfileError(f"profile {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    return profile_from_dict(data, path.stem, f" ({path})", base)


def builtin_profile_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("emllm.profiles").iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str, base: Profile | None = None) -> Profile:
    """A built-in profile by name (`smollm2`, `llama3.1`, ...), whole; or a YAML file by path, its
    keys over `base`'s (the model's profile: a file that sets `n_local` keeps the rest of it)."""
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        return load_profile_file(name_or_path, base)
    f = resources.files("emllm.profiles") / f"{name_or_path}.yaml"
    if not f.is_file():
        raise ProfileError(
            f"unknown profile {name_or_path!r} (built-in: {', '.join(builtin_profile_names())}; or give a .yaml path)"
        )
    with resources.as_file(f) as path:
        return load_profile_file(path)


# A setting of the machine, not of a model family: read where the engine needs it, and checked by
# `models.load` before the weights load.
def device_memory_setting() -> float | None:
    """$EMLLM_DEVICE_MEMORY: the GB of an accelerator's memory a store's events may take, all
    layers together (a GPU shared with other work), or None where it is not set."""
    value = os.environ.get("EMLLM_DEVICE_MEMORY")
    if not value:
        return None
    try:
        gb = float(value)
    except ValueError:
        gb = -1.0
    if not 0 < gb < float("inf"):
        raise UsageError(f"EMLLM_DEVICE_MEMORY={value!r}: the GB of GPU memory emllm's events may take, a number above 0 (e.g. 8)")
    return gb
