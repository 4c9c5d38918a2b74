"""Benchmark scripts; results go to docs/benchmarks.md."""

import os
import platform
import subprocess
from pathlib import Path

from transformers.utils import logging as hf_logging

from emllm.models import cache_kwargs  # noqa: F401  (the benchmarks' plain baselines import it from here)

# A benchmark's log holds its results, not the libraries' progress bar at every model load (the
# CLI silences them too).
hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()


def git_commit() -> str:
    """The short commit of this checkout, recorded beside a result. Outside git (a frozen copy
    made with `git archive`, so that an hour-long run is not reached by later edits): the
    environment's EMLLM_COMMIT, else ""."""
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return r.stdout.strip() or os.environ.get("EMLLM_COMMIT", "")


def frozen_code(rev: str, into: Path) -> Path:
    """The code of commit `rev` (any git revision; "." for the working tree) as importable
    packages under `into` (emllm/, emllm/profiles/, emllm_cli/, as pyproject's package-dir
    lays them out), for alternating two versions of the code in one benchmark run: a process
    started with PYTHONPATH=<returned folder> imports that code, not the installed one."""
    root = Path(__file__).resolve().parent.parent
    into.mkdir(parents=True, exist_ok=True)
    parts = ["core", "profiles", "emllm_cli"]
    if rev == ".":
        subprocess.run(f"tar -c {' '.join(parts)} | tar -x -C {into}", shell=True, check=True, cwd=root)
    else:
        subprocess.run(f"git archive {rev} {' '.join(parts)} | tar -x -C {into}", shell=True, check=True, cwd=root)
    (into / "core").rename(into / "emllm")
    (into / "profiles").rename(into / "emllm" / "profiles")
    return into


def machine(threads: int | None = None) -> str:
    """The processor a result was taken on, as recorded beside it: the architecture, the CPU's
    name and family/model (one cloud VM's name covers several generations, whose speeds differ
    severalfold), and the threads used."""
    name, ids = platform.machine(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in ids:
                ids[key] = value.strip()
            if len(ids) == 3:
                break
    except OSError:  # (not Linux)
        pass
    if ids:
        name += f" {ids.get('model name', '?')} (family {ids.get('cpu family', '?')} model {ids.get('model', '?')})"
    return name if threads is None else f"{name}, {threads} threads"
