"""Long texts available offline on any machine with this project installed, for benchmarks and
the quality grid's haystacks (text nobody here wrote).

- code: Python standard-library sources (a fixed list of modules, concatenated)
- prose: the docstrings of those modules, and the Markdown files transformers ships, as paragraphs
- chat: chat logs, the English dialogues of chatterbot-corpus (a data package installed with the
  tests: `scripts/install.sh`), one turn a line ("User: ..." / "Assistant: ..."), dialogues apart
- haystack: the passkey filler (repetitive, low surprise)

code and prose are read from a snapshot in corpus_text/ (xz, 0.3 MB; taken from Python 3.11.7 and
transformers 5.24.0, whose licences lie beside it), not from the running interpreter: built from
its own files, another Python (the lent GPU's 3.12 against the VM's 3.11) made other haystacks from
the same seed, and runs on two machines could not be compared. The snapshot holds the same text
the interpreter gave before, so prompts and results from before it keep their `ruler.Prompt.digest`.
`python -m emllm.evals.corpus SNAPSHOT_DIR` writes a snapshot from the running interpreter.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import lzma
import re
import sys
from pathlib import Path

from emllm.evals.passkey import FILLER

STDLIB = ["argparse", "typing", "dataclasses", "inspect", "collections", "functools", "email.message",
          "http.client", "logging", "pathlib", "subprocess", "tarfile", "zipfile", "json.decoder",
          "asyncio.base_events", "unittest.case", "difflib", "textwrap", "calendar", "statistics"]


def _modules():
    import importlib

    return [importlib.import_module(m) for m in STDLIB]


SNAPSHOT = Path(__file__).parent / "corpus_text"
# sha256 of each snapshot's text: a file changed or cut short is refused, not read as another haystack
SHA256 = {"code": "3ddefdd80099ed520ff3faa481025e0df2f2784f5983cb0bb9c099ce54728c80",
          "prose": "5ad5afd5ee2549807f5f93321c6617c017a93ed2a0c1ee9b8d97e18cb84229bd"}


@functools.lru_cache(maxsize=4)  # a benchmark asks for a haystack once per length: decompressed once (~3 MB)
def _snapshot(kind: str, folder: Path = SNAPSHOT) -> str:
    path = folder / f"{kind}.txt.xz"
    try:
        data = lzma.decompress(path.read_bytes())
    except (OSError, lzma.LZMAError) as e:
        raise RuntimeError(f"the {kind} haystack's snapshot {path} cannot be read: {e}") from None
    if hashlib.sha256(data).hexdigest() != SHA256[kind]:
        raise RuntimeError(f"the {kind} haystack's snapshot {path} is not the one this version ships (sha256 differs)")
    return data.decode("utf-8")


def code() -> str:
    return _snapshot("code")


def prose() -> str:
    return _snapshot("prose")


def code_of_interpreter() -> str:
    return "\n\n".join(inspect.getsource(m) for m in _modules())


def prose_of_interpreter() -> str:
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


def write_snapshot(folder: Path) -> dict[str, str]:
    """Write code and prose, as this interpreter and this transformers give them, to folder/KIND.txt.xz;
    returns each text's sha256 (for SHA256)."""
    folder.mkdir(parents=True, exist_ok=True)
    sums = {}
    for kind, build in (("code", code_of_interpreter), ("prose", prose_of_interpreter)):
        data = build().encode("utf-8")
        (folder / f"{kind}.txt.xz").write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
        sums[kind] = hashlib.sha256(data).hexdigest()
    return sums


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m emllm.evals.corpus SNAPSHOT_DIR")
    for kind, digest in write_snapshot(Path(sys.argv[1])).items():
        print(kind, digest)
