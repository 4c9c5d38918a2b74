"""Benchmark scripts; results go to docs/benchmarks.md."""

import os
import subprocess
from pathlib import Path

from emllm.models import cache_kwargs  # noqa: F401  (the benchmarks' plain baselines import it from here)


def git_commit() -> str:
    """The short commit of this checkout, recorded beside a result. Outside git (a frozen copy
    made with `git archive`, so that an hour-long run is not reached by later edits): the
    environment's EMLLM_COMMIT, else ""."""
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return r.stdout.strip() or os.environ.get("EMLLM_COMMIT", "")
