"""The README's library example, run as written, from a folder that holds a `core/` package of its
own (the library must not be shadowed by it, nor shadow it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _example() -> str:
    text = README.read_text()
    at = text.index("<!-- library-example")
    return re.search(r"```python\n(.*?)```", text[at:], re.S).group(1)


def test_import_emllm_is_light_and_names_its_surface():
    code = "import sys, emllm; print('torch' in sys.modules, sorted(emllm.__all__))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("False") and "'create'" in r.stdout and "'open'" in r.stdout


@pytest.mark.slow
def test_the_readme_example_runs_beside_a_core_package_of_its_own(tmp_path, smollm2):
    (tmp_path / "core").mkdir()  # a project's own `core` package, as Django-style projects have
    (tmp_path / "core" / "__init__.py").write_text("")
    (tmp_path / "core" / "models.py").write_text("raise ImportError('the project core package was imported')\n")
    (tmp_path / "example.py").write_text(_example())
    from emllm.home import models_dir

    env = {**os.environ, "EMLLM_MODELS": str(models_dir()), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "example.py"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3, r.stdout
    assert re.fullmatch(r"\d+ of 30 layers retrieved the top event", lines[1])
    assert re.fullmatch(r"\d+ tokens in the store", lines[2]) and int(lines[2].split()[0]) > 4096
    assert (tmp_path / "garden-memory" / "manifest.json").is_file()
    # `import core` still finds the project's own package: emllm installs nothing under that name
    r = subprocess.run([sys.executable, "-c", "import core, emllm; print(core.__file__)"], capture_output=True,
                       text=True, cwd=tmp_path, env=env)
    assert r.stdout.strip() == str(tmp_path / "core" / "__init__.py"), r.stderr
