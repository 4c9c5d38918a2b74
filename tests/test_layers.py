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
    "errors": set(),
    "home": set(),
    "config": set(),
    "embedded": {"home"},
    "models": {"config", "home", "embedded"},
    "math": set(),
    "memory": {"math", "config"},
    "engine": {"math", "memory", "config", "embedded", "models"},
    "store": {"memory", "math", "config"},
    "app": {"engine", "store", "memory", "math", "config", "embedded", "models", "home"},
    "serve": {"surface"},  # the server calls the public API, as the CLI does
    "evals": {"app", "engine", "store", "memory", "math", "config", "embedded", "models", "home"},
    "surface": {"app", "engine", "store", "memory", "math", "config", "embedded", "models", "home", "evals", "serve"},
}
for _layer, _deps in ALLOWED.items():  # every layer may raise the base of the user's errors
    if _layer != "errors":
        _deps.add("errors")


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


CLI = ROOT.parent / "emllm_cli"


def front_door_breaches(root: Path, allowed_packages: tuple[str, ...]) -> list[str]:
    """Imports of the library in the files under `root` that do not go through its public surface
    (`emllm` and the names in `emllm.__all__`), or one of `allowed_packages`."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            else:
                continue
            for mod in mods:
                if mod.split(".")[0] == "emllm" and mod != "emllm" and not mod.startswith(allowed_packages):
                    bad.append(f"{path.name}: {mod}")
    return bad


def test_the_cli_and_the_server_go_through_the_front_door():
    """The CLI and the server call the library's public surface only (the evaluations and the
    HTTP app are commands of their own); each name they import from `emllm` is in its __all__."""
    import emllm

    assert front_door_breaches(CLI, ("emllm.evals.", "emllm.evals", "emllm.serve.")) == []
    assert front_door_breaches(ROOT / "serve", ()) == []
    for root in (CLI, ROOT / "serve"):
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "emllm":
                    assert {a.name for a in node.names} <= set(emllm.__all__), path
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "emllm":
                    assert node.attr in emllm.__all__, (path.name, node.attr)


def test_the_front_door_check_fails_on_an_internal_import(tmp_path):
    (tmp_path / "cmd.py").write_text("def f():\n    from emllm.app.ask import Session\n")
    assert front_door_breaches(tmp_path, ()) == ["cmd.py: emllm.app.ask"]


def raw_manifest_reads(roots: list[Path]) -> list[str]:
    """Places that read a store's manifest as a raw dict (`x.manifest`, `read_manifest`) outside
    emllm.store: the rest of the code reads the typed `Store.info` (`emllm.store.manifest.Manifest`)."""
    out = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if ROOT / "store" in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
                if name in ("manifest", "read_manifest", "pending_count"):
                    out.append(f"{path.name}:{node.lineno}: {name}")
    return out


def test_the_manifest_is_read_typed_outside_the_store():
    assert raw_manifest_reads([ROOT, CLI]) == []


def test_the_manifest_check_fails_on_a_raw_read(tmp_path):
    (tmp_path / "x.py").write_text("def f(st):\n    return st.manifest['rows']\n")
    assert raw_manifest_reads([tmp_path]) == ["x.py:2: manifest"]
