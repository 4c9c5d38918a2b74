"""Benchmark scripts; results go to docs/benchmarks.md."""

import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """The short commit of this checkout, recorded beside a result. Outside git (a frozen copy
    made with `git archive`, so that an hour-long run is not reached by later edits): the
    environment's EMLLM_COMMIT, else ""."""
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return r.stdout.strip() or os.environ.get("EMLLM_COMMIT", "")


def cache_kwargs(model, cache) -> dict:
    """The keyword that hands a model's forward its KV cache: `cache` in recent transformers 5.x
    (which warns on the old name), `past_key_values` before the rename."""
    import inspect

    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


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
