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
    m = re.fullmatch(r"\d+ of (\d+) layers retrieved the top event", lines[1])
    assert m and m.group(1) == "30", lines[1]  # SmolLM2's layers: the tests' EMLLM_MODEL (conftest.py)
    assert re.fullmatch(r"\d+ tokens in the store", lines[2]) and int(lines[2].split()[0]) > 4096
    assert (tmp_path / "garden-memory" / "manifest.json").is_file()
    # `import core` still finds the project's own package: emllm installs nothing under that name
    r = subprocess.run([sys.executable, "-c", "import core, emllm; print(core.__file__)"], capture_output=True,
                       text=True, cwd=tmp_path, env=env)
    assert r.stdout.strip() == str(tmp_path / "core" / "__init__.py"), r.stderr


@pytest.mark.slow
def test_the_distribution_installs_emllm_and_the_cli_only(tmp_path):
    """`pip install .` puts `emllm` (with its profiles) and `emllm_cli` at the top level, nothing else."""
    import zipfile

    root = README.parent
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(root)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("emllm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("top_level.txt"))).decode().split()
    assert sorted(top) == ["emllm", "emllm_cli"]
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"emllm", "emllm_cli"}
    assert "emllm/profiles/smollm2.yaml" in names and "emllm/store/manifest.py" in names
