"""Profiles: the EM-LLM parameters of one model family, loaded from `profiles/*.yaml` and validated.

A profile is data, not code: every key is a field of `Profile`, unknown keys and bad values are
errors (`ProfileError`) with a message that names the file, the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from emllm.errors import EmllmError

import yaml

SEGMENTATIONS = ("F", "S", "SM", "SC", "FM", "FC")


class ProfileError(EmllmError, ValueError):
    """A profile that cannot be used; the message is meant for the user."""


class ProfileMismatchError(ProfileError):
    """A profile other than the one a store keeps."""


@dataclass(frozen=True)
class Profile:
    name: str
    model: str = ""  # what `--model <alias>` loads: "embedded:smollm2" or a hub id
    description: str = ""
    chunk_size: int = 512
    n_init: int = 128
    n_local: int = 4096
    n_mem: int = 2048  # retrieved tokens per layer (the budget is counted in tokens)
    repr_topk: int = 4
    min_block: int = 8
    max_block: int = 128
    gamma: float = 1.0
    tau: int | None = None  # None: n_local - chunk_size (spec §2)
    segmentation: str = "S"
    contiguity: bool = False
    contiguity_ratio: float = 0.3
    neighbours: int = 1
    refine_from_layer: int | None = None  # None: the last third of the layers
    # Events per layer from which an engine in RAM searches a faiss graph (approximate candidates,
    # re-scored exactly) instead of scoring every event; null: always exact, the default (the graph
    # lost passkeys that exact search found: docs/benchmarks.md).
    faiss_threshold: int | None = None
    # Events per layer from which a store keeps a sketch of its representative keys (its readers'
    # selections stay exact; null: never). Unset where faiss_threshold is set: the same value, as
    # profiles and stores written before the two keys were separate meant.
    sketch_threshold: int | None = 20000
    # RAM for recently read events' keys and values, all layers (stores; 0: none): the page cache
    # serves most re-reads, and a layer keeps its last step's events anyway (engine/window.py).
    kv_cache_mb: int = 0
    # RAM for every event's representative key, all layers (stores): retrieval then estimates all
    # scores with one matrix-vector product and scores exactly only the events that can be
    # selected (memory/prune.py; the same selection). Past it: the exact scan of the files.
    repr_cache_mb: int = 2048
    # Retrieval scores each event against the query minus this share of the layer's running mean
    # query (0: the paper's plain inner product): an event that aligns with the mean query (a
    # "hub", selected for any query) loses that advantage.
    query_centering: float = 0.0
    # The same, only while a question is read and answered (after `Engine.begin_question`; 0: as
    # query_centering): the document is read with the paper's scoring, the question's retrieval
    # is taken away from the hubs. Stores keep the scoring they were made with.
    question_centering: float = 1.0
    # Whether the answer's tokens score with question_centering too; false: only the question's
    # chunks do (centring the answer made digits drift while a retrieved needle was copied).
    question_centering_answer: bool = False
    # How a question's chunk scores events: "mean" (the paper's), its tokens' mean query; "max",
    # every token scores every event, each token's scores standardised over the events (z-scores),
    # an event taking its best token's, so that the one token that singles a needle out is not
    # averaged away; "lse", a soft maximum of those z-scores (`selection.token_lse`), so that an
    # event several tokens find also gains. Only while a question is read and for chunks of several
    # tokens; it needs the centring above. Stores keep the scoring they were made with.
    question_scoring: str = "lse"
    # Identical events (the same token ids: `emllm.memory.distinct`) take one place in a question's
    # selection: the best scoring of each set first, the other copies only fill what is left (a
    # conversation's template framing and repeated replies made copies that crowded facts out).
    # Only where the question's tokens score every event ("max", "lse").
    distinct_events: bool = True
    # Representative keys scaled to unit length per head when events close: an event then scores
    # the sum over heads of |q_h| cos(q_h, r_h), and long keys win no more often.
    repr_normalise: bool = True
    # What an event's representative key is: "attention" (the paper's), the mean pre-RoPE key of
    # the repr_topk tokens that drew the most attention in the local window; "mean", the mean key
    # of all its tokens, which needs no attention mass (docs/benchmarks.md compares them).
    representative: str = "mean"
    # compute dtype: auto is bfloat16 where the device computes it natively (CUDA, CPUs with
    # AVX-512 BF16 or AMX), else float32. A store records the dtype it was computed in.
    dtype: str = "auto"
    aliases: tuple[str, ...] = field(default_factory=tuple)

    @property
    def surprise_window(self) -> int:
        if self.tau is not None:
            return self.tau
        # Spec §2: the tokens of the window before the chunk; the whole window if the chunk fills it.
        return self.n_local - self.chunk_size if self.n_local - self.chunk_size >= 2 else self.n_local

    def replace(self, **changes: Any) -> "Profile":
        return validate(dataclasses.replace(self, **changes))


REPRESENTATIVES = ("attention", "mean")
QUESTION_SCORINGS = ("mean", "max", "lse")

_INT_MIN = {
    "chunk_size": 1, "n_init": 0, "n_local": 1, "n_mem": 0, "repr_topk": 1,
    "min_block": 1, "max_block": 1, "neighbours": 0, "kv_cache_mb": 0,
    "repr_cache_mb": 0,
}
# Far above any real setting, far below what would exhaust memory or overflow: a profile (or a
# store's copy of one) is input, and n_local: 10**12 must be refused, not allocated.
_INT_MAX = 1 << 24


def validate(p: Profile, where: str = "") -> Profile:
    def bad(key: str, why: str) -> ProfileError:
        return ProfileError(f"profile {p.name!r}{where}: {key}: {why}")

    for key, lo in _INT_MIN.items():
        v = getattr(p, key)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise bad(key, f"must be an integer >= {lo}, got {v!r}")
        if v > _INT_MAX:
            raise bad(key, f"must be at most {_INT_MAX}, got {v!r}")
    if p.tau is not None and (not isinstance(p.tau, int) or isinstance(p.tau, bool) or p.tau < 2):
        raise bad("tau", f"must be an integer >= 2 or null, got {p.tau!r}")
    if p.refine_from_layer is not None and (not isinstance(p.refine_from_layer, int) or p.refine_from_layer < 0):
        raise bad("refine_from_layer", f"must be an integer >= 0 or null, got {p.refine_from_layer!r}")
    for key in ("faiss_threshold", "sketch_threshold"):
        v = getattr(p, key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= _INT_MAX):
            raise bad(key, f"must be an integer in [1, {_INT_MAX}] or null, got {v!r}")
    if not isinstance(p.gamma, (int, float)) or isinstance(p.gamma, bool) or p.gamma != p.gamma:
        raise bad("gamma", f"must be a number, got {p.gamma!r}")
    if not isinstance(p.contiguity_ratio, (int, float)) or not 0.0 <= p.contiguity_ratio < 1.0:
        raise bad("contiguity_ratio", f"must be a number in [0, 1), got {p.contiguity_ratio!r}")
    for key in ("query_centering", "question_centering"):
        v = getattr(p, key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
            raise bad(key, f"must be a number in [0, 1], got {v!r}")
    if not isinstance(p.question_centering_answer, bool):
        raise bad("question_centering_answer", f"must be true or false, got {p.question_centering_answer!r}")
    if p.question_scoring not in QUESTION_SCORINGS:
        raise bad("question_scoring", f"must be one of {', '.join(QUESTION_SCORINGS)}, got {p.question_scoring!r}")
    if not isinstance(p.distinct_events, bool):
        raise bad("distinct_events", f"must be true or false, got {p.distinct_events!r}")
    if not isinstance(p.repr_normalise, bool):
        raise bad("repr_normalise", f"must be true or false, got {p.repr_normalise!r}")
    if p.representative not in REPRESENTATIVES:
        raise bad("representative", f"must be one of {', '.join(REPRESENTATIVES)}, got {p.representative!r}")
    if not isinstance(p.contiguity, bool):
        raise bad("contiguity", f"must be true or false, got {p.contiguity!r}")
    if p.dtype not in ("auto", "float32", "bfloat16"):
        raise bad("dtype", f"must be auto, float32 or bfloat16, got {p.dtype!r}")
    if p.segmentation not in SEGMENTATIONS:
        raise bad("segmentation", f"must be one of {', '.join(SEGMENTATIONS)}, got {p.segmentation!r}")
    if p.min_block > p.max_block:
        raise bad("min_block", f"({p.min_block}) must not exceed max_block ({p.max_block})")
    if p.chunk_size > p.n_local:
        raise bad("chunk_size", f"({p.chunk_size}) must not exceed n_local ({p.n_local})")
    return p


_FIELDS = {f.name for f in dataclasses.fields(Profile)}


def profile_from_dict(data: Any, name: str, where: str = "") -> Profile:
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
    return validate(Profile(**data), where)


def load_profile_file(path: str | Path) -> Profile:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ProfileError(f"cannot read profile {str(path)!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ProfileError(f"profile {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    return profile_from_dict(data, path.stem, f" ({path})")


def builtin_profile_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("emllm.profiles").iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name (`smollm2`, `llama3.1`, ...) or a YAML file by path."""
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        return load_profile_file(name_or_path)
    f = resources.files("emllm.profiles") / f"{name_or_path}.yaml"
    if not f.is_file():
        raise ProfileError(
            f"unknown profile {name_or_path!r} (built-in: {', '.join(builtin_profile_names())}; or give a .yaml path)"
        )
    with resources.as_file(f) as path:
        return load_profile_file(path)
