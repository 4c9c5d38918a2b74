"""Long texts available offline on any machine with this project installed, for benchmarks and
the quality grid's haystacks (text nobody here wrote).

- code: Python standard-library sources (a fixed list of modules, concatenated)
- prose: the docstrings of those modules and of transformers' model docs, joined as paragraphs
- chat: chat logs, the English dialogues of chatterbot-corpus (a data package installed with the
  tests: `scripts/install.sh`), one turn a line ("User: ..." / "Assistant: ..."), dialogues apart
- haystack: the passkey filler (repetitive, low surprise)

code and prose are this interpreter's and this transformers' own files: another Python (the lent
GPU's 3.12 against this VM's 3.11) builds other haystacks from the same seed. Results record
each prompt's `ruler.Prompt.digest`; compare runs only where the digests match.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from emllm.evals.passkey import FILLER

STDLIB = ["argparse", "typing", "dataclasses", "inspect", "collections", "functools", "email.message",
          "http.client", "logging", "pathlib", "subprocess", "tarfile", "zipfile", "json.decoder",
          "asyncio.base_events", "unittest.case", "difflib", "textwrap", "calendar", "statistics"]


def _modules():
    import importlib

    return [importlib.import_module(m) for m in STDLIB]


def code() -> str:
    return "\n\n".join(inspect.getsource(m) for m in _modules())


def prose() -> str:
    parts = []
    for m in _modules():
        tree = ast.parse(inspect.getsource(m))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                d = ast.get_docstring(node)
                if d and len(d) > 200:
                    parts.append(d)
    import transformers

    docs = Path(transformers.__file__).parent
    for f in sorted(docs.rglob("*.md"))[:200]:
        parts.append(f.read_text(errors="replace"))
    return "\n\n".join(parts)


def chat() -> str:
    """Every English dialogue of chatterbot-corpus, in the order of its files (sorted), the turns
    given to a user and an assistant in turn."""
    import importlib.util

    import yaml

    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the chat haystack needs chatterbot-corpus: pip install --no-deps chatterbot-corpus==1.3.3")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / "english"
    dialogues = []
    for f in sorted(folder.glob("*.yml")):
        for conv in yaml.safe_load(f.read_text(encoding="utf-8")).get("conversations") or []:
            turns = [str(t).strip() for t in conv if isinstance(t, (str, int, float)) and str(t).strip()]
            if len(turns) >= 2:
                dialogues.append("\n".join(f"{('User', 'Assistant')[i % 2]}: {t}" for i, t in enumerate(turns)))
    return "\n\n".join(dialogues) + "\n"


_CACHE: dict[str, list[str]] = {}


def units(kind: str) -> list[str]:
    """The corpus `kind` ("prose", "code" or "chat") cut where a needle may go: after a sentence's
    end punctuation or a line break (prose), after each line (code; chat: each turn). Joined, they
    give the text back."""
    if kind not in _CACHE:
        text = TEXTS[kind]()
        cut = r"(?<=\n)" if kind in ("code", "chat") else r"(?<=[.!?]\s)|(?<=\n)"
        _CACHE[kind] = [u for u in re.split(cut, text) if u]
    return _CACHE[kind]


def haystack(n_chars: int = 400_000) -> str:
    return (FILLER * (n_chars // len(FILLER) + 1))[:n_chars]


TEXTS = {"code": code, "prose": prose, "chat": chat, "haystack": haystack}


def tokens(tok, kind: str, n: int) -> list[int]:
    ids = tok(TEXTS[kind](), add_special_tokens=False)["input_ids"]
    while len(ids) < n:  # repeat if the text is short of n tokens
        ids = ids + ids
    return ids[:n]
