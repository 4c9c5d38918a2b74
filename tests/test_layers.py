"""The package's layers: imports point down the table below only, and no modules import each other
in a circle (imports inside functions count: a lazy import is still an arrow).

The table is the one place the allowed arrows are written; each subpackage's docstring repeats
its own row in words.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "core"  # installed as the package `emllm`

# layer -> the layers it may import (besides itself). Foundations first, evaluation last.
ALLOWED: dict[str, set[str]] = {
    "home": set(),
    "config": set(),
    "embedded": {"home"},
    "models": {"config", "home", "embedded"},
    "math": set(),
    "memory": {"math"},
    "engine": {"math", "memory", "config", "embedded", "models"},
    "store": {"memory", "math", "config"},
    "app": {"engine", "store", "memory", "math", "config", "embedded", "models", "home"},
    "serve": {"app", "engine", "store", "memory", "math", "config", "embedded", "models", "home"},
    "evals": {"app", "engine", "store", "memory", "math", "config", "embedded", "models", "home"},
    "surface": {"app", "engine", "store", "memory", "math", "config", "embedded", "models", "home", "evals", "serve"},
}


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = ["emllm", *rel.parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return "surface" if len(parts) == 1 else parts[1]


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """The emllm modules a file imports, anywhere in it (absolute or relative)."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "emllm"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "emllm":
                continue
            # `from emllm.store import rows` names a module; `from emllm.store import Store` a name in one
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if _exists(sub, root) else mod)
    return out


def _exists(module: str, root: Path) -> bool:
    rel = Path(*module.split(".")[1:])
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    return {module_name(p, root): imports(p, root) - {module_name(p, root)} for p in sorted(root.rglob("*.py"))}


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import across layers that the table does not allow."""
    bad = []
    for mod, deps in g.items():
        for d in deps:
            a, b = layer_of(mod), layer_of(d)
            if a != b and b not in ALLOWED[a]:
                bad.append(f"{mod} -> {d} ({a} may not import {b})")
    return sorted(bad)


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles between modules (each found once, from its smallest module)."""
    found, seen = [], set()

    def visit(path: list[str]) -> None:
        for d in sorted(g.get(path[-1], ())):
            if d == path[0]:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    found.append(path + [d])
            elif d not in path and d > path[0]:
                visit(path + [d])

    for m in sorted(g):
        visit([m])
    return found


def test_the_package_imports_down_its_layers_only():
    g = graph()
    assert len(g) > 30 and all(layer_of(m) in ALLOWED for m in g), sorted({layer_of(m) for m in g} - set(ALLOWED))
    assert upward(g) == []


def test_no_modules_import_each_other_in_a_circle():
    assert circles(graph()) == []


def test_the_engine_never_imports_the_cli():
    assert not any("emllm_cli" in p.read_text() for p in ROOT.rglob("*.py"))


@pytest.mark.parametrize("arrow", ["upward", "circle"])
def test_the_checks_fail_on_an_added_arrow(tmp_path, arrow):
    """A copy of the package with one bad import added: the checks above report exactly it."""
    import shutil

    root = tmp_path / "core"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    target = root / "math" / "rope.py"
    line = "from emllm.store import rows\n" if arrow == "upward" else "from emllm.math import attention\n"
    target.write_text(target.read_text() + "\n\ndef _added():\n    " + line)
    g = graph(root)
    if arrow == "upward":
        assert upward(g) == ["emllm.math.rope -> emllm.store.rows (math may not import store)"]
    else:
        assert upward(g) == [] and circles(g) == [["emllm.math.attention", "emllm.math.rope", "emllm.math.attention"]]
