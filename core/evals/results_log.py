"""An append-only JSON-lines log of results, for runs longer than a process.

Each run writes a header line (`{"run": its start, "id": ..., "grid": {...}, ...}`), then one line per
result as it finishes, flushed and synced, so that a killed run keeps what it measured. A later run
of the same grid (equal header `grid`) reads back the results written under such headers and skips
them. A result names its run's id (`run_id`): runs of other grids appending to the same file at the
same time interleave their lines, and a result belongs to its own header, not to the last one
above it (results without an id, from older runs, to the last header above them). A line cut
short by a kill is ended before anything is appended, and ignored when read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from emllm.config import Profile
from emllm.store.manifest import BEFORE_THE_KEY


def end_line(path: Path | str) -> None:
    """End a line cut short when a run died writing it, so that what follows is a line of its own."""
    with open(path, "a+b") as f:
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def append(path: Path | str, record: dict[str, Any], run: str | None = None) -> None:
    """Append one record as a line and put it on disk before returning (a result costs hours).
    run: the id `start_run` returned, when the record is a result of that run."""
    if run is not None:
        record = {**record, "run_id": run}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def start_run(path: Path | str, grid: dict[str, Any], **header: Any) -> str:
    """Begin a run of `grid`: end a line a dead run cut short, then write the header. Returns the
    run's id, for `append(..., run=)`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    end_line(path)
    run = uuid.uuid4().hex[:16]
    append(path, {"run": time.strftime("%Y-%m-%d %H:%M:%S"), "id": run, **header, "grid": grid})
    return run


def normal(grid: dict[str, Any] | None) -> dict[str, Any] | None:
    """`grid` as it reads back from the log (tuples become lists), its profile (if it has one)
    with every key: a key added since the log was written has the value that code used."""
    grid = json.loads(json.dumps(grid))
    if isinstance(grid, dict) and isinstance(grid.get("profile"), dict):
        grid["profile"] = {**_profile_defaults(), **BEFORE_THE_KEY, **grid["profile"]}
    return grid


def _profile_defaults() -> dict[str, Any]:
    return json.loads(json.dumps({f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                                  for f in dataclasses.fields(Profile)
                                  if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}))


def records(path: Path | str) -> Iterator[dict[str, Any]]:
    with contextlib.suppress(FileNotFoundError), open(path, errors="replace") as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:  # a line cut short when a run died writing it
                continue
            if isinstance(r, dict):
                yield r


def results_of(path: Path | str, grid: dict[str, Any]) -> list[dict[str, Any]]:
    """The result records in `path` written by runs of `grid` (none if the file does not exist),
    as they were appended (without their `run_id`)."""
    grid, out, ours, our_runs = normal(grid), [], False, set()
    for r in records(path):
        if "run" in r:  # a header (older ones have no grid: never ours)
            ours = normal(r.get("grid")) == grid
            if ours and "id" in r:
                our_runs.add(r["id"])
        elif "run_id" in r:
            if r["run_id"] in our_runs:
                out.append({k: v for k, v in r.items() if k != "run_id"})
        elif ours:
            out.append(r)
    return out


def last_grid(path: Path | str) -> dict[str, Any] | None:
    """The grid of the last run begun in `path` (None: no run, or one of an older format)."""
    last = None
    for r in records(path):
        if "run" in r:
            last = r.get("grid")
    return normal(last) if last is not None else None


__all__ = ["append", "end_line", "last_grid", "normal", "records", "results_of", "start_run"]
