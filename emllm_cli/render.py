"""All Rich rendering in one place: progress on stderr, results on stdout, plain when piped."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


def progress(transient: bool = True) -> Progress:
    """A progress bar on stderr; silent when stderr is not a terminal."""
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        console=err, transient=transient, disable=not err.is_terminal,
    )


def _cell(ok: int, n: int) -> str:
    if n == 0:
        return "[dim]·[/dim]"
    pct = 100 * ok / n
    colour = "green" if pct >= 90 else "yellow" if pct >= 50 else "red"
    return f"[{colour}]{pct:.0f}%[/{colour}] [dim]{ok}/{n}[/dim]"


def passkey_table(results: list[dict], lengths: list[int], depths: list[float], methods: list[str]) -> Table:
    t = Table(title="passkey accuracy", show_lines=False)
    t.add_column("length", justify="right")
    t.add_column("method")
    for d in depths:
        t.add_column(f"depth {d:g}", justify="center")
    t.add_column("all", justify="center")
    for n in lengths:
        for m in methods:
            row = [r for r in results if r["length"] == n and r["method"] == m]
            cells = []
            for d in depths:
                c = [r for r in row if r["depth"] == d]
                cells.append(_cell(sum(r["correct"] for r in c), len(c)))
            t.add_row(fmt_tokens(n), m, *cells, _cell(sum(r["correct"] for r in row), len(row)))
    return t


def fmt_tokens(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    if n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)


def events_view(text: str, doc: dict):
    """The text with event boundaries marked: alternating shades, a ▌ and the surprise at each start."""
    from rich.text import Text

    t = Text()
    styles = ("", "on grey15")
    for ev in doc["events"]:
        c0, c1 = ev["chars"]
        s = ev["surprise"]
        mark = f"▌{s:.1f} " if s is not None else "▌"
        t.append(mark, style="bold magenta" if s is not None and s > 8 else "magenta")
        t.append(text[c0:c1], style=styles[ev["index"] % 2])
    t.append(f"\n\n{len(doc['events'])} events, {doc['tokens']} tokens, method {doc['method']}", style="dim")
    return t


def metrics_table(table: dict, tokens: int) -> Table:
    """Paper Table 2 style: each method's metrics as the difference to random segmentation."""
    t = Table(title=f"segmentation quality, difference to random ({tokens} tokens)")
    t.add_column("method")
    t.add_column("modularity ×10³ (↑)", justify="right")
    t.add_column("conductance (↓)", justify="right")
    t.add_column("intra/inter (↑)", justify="right")
    for m, d in table.items():
        t.add_row(m, f"{1e3 * d['modularity']:+.3f}", f"{d['conductance']:+.4f}", f"{d['intra_inter']:+.4f}")
    return t
