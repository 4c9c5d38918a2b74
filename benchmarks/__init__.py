"""Benchmark scripts; results go to docs/benchmarks.md."""

import subprocess
from pathlib import Path


def git_commit() -> str:
    """The short commit of this checkout, recorded beside a result ("" outside git)."""
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return r.stdout.strip()
