"""All Rich rendering in one place: progress on stderr, results on stdout, plain when piped."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from typing import Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)
for _c in (out, err):  # piped or logged, a message stays one line (Rich would wrap it at 80 columns)
    _c.soft_wrap = not _c.is_terminal


# a list of numbers as json.dumps(indent=2) writes it: newlines, which no JSON string holds raw
_NUMBERS = re.compile(r"\[\n\s+(-?[\d.eE+-]+(?:,\n\s+-?[\d.eE+-]+)*)\n\s*\]")


SHOWN_DOCUMENTS = 12  # documents `emllm show` names


def print_json(doc: Any) -> None:
    """Indented, with a list of numbers on one line (a retrieval heatmap would take a line per number)."""
    text = _NUMBERS.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", json.dumps(doc, indent=2))
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def progress(transient: bool = True, console: Console | None = None) -> Progress | LineProgress:
    """A progress bar (on stderr by default). Off a terminal it is silent, unless EMLLM_PROGRESS
    asks for a plain line every so many seconds (a long ingest run under nohup, to a log)."""
    console = console or err
    if not console.is_terminal and (every := progress_interval()) is not None:
        return LineProgress(console, every)
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        console=console, transient=transient, disable=not console.is_terminal,
        speed_estimate_period=3600,  # steps can take minutes; Rich's 30 s window would never show an ETA
    )


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner with `message` on stderr while a slow step runs (a model loading, a store opening);
    off a terminal, one plain line when EMLLM_PROGRESS asks for progress lines, else nothing."""
    if err.is_terminal:
        with err.status(message, spinner="dots"):
            yield
        return
    if progress_interval() is not None:
        err.print(message)
    yield


def progress_interval() -> float | None:
    """EMLLM_PROGRESS: seconds between progress lines off a terminal (unset or empty: none)."""
    from .errors import UserError

    v = os.environ.get("EMLLM_PROGRESS", "").strip()
    if not v:
        return None
    try:
        every = float(v)
    except ValueError:
        every = -1.0
    if not every >= 0 or every == float("inf"):
        raise UserError(f"EMLLM_PROGRESS={v!r}: give the seconds between progress lines, e.g. 60")
    return every


class LineProgress:
    """The progress bar's interface, as a line at most every `every` seconds and one at the end."""

    def __init__(self, console: Console, every: float) -> None:
        self.console, self.every = console, every
        self.tasks: dict[int, dict[str, Any]] = {}
        self.last = -float("inf")

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        for t in self.tasks.values():
            if t["completed"] != t["shown"]:
                self._print(t)

    def add_task(self, description: str, total: float, completed: float = 0, **fields: Any) -> int:
        self.tasks[len(self.tasks)] = {"description": description, "total": total, "completed": completed,
                                       "start": completed, "t0": time.monotonic(), "shown": None, **fields}
        return len(self.tasks) - 1

    def update(self, task: int, completed: float | None = None, advance: float | None = None, **fields: Any) -> None:
        t = self.tasks[task]
        if completed is not None:
            t["completed"] = completed
        if advance is not None:
            t["completed"] += advance
        t.update(fields)
        if time.monotonic() - self.last >= self.every:
            self._print(t)

    def _print(self, t: dict[str, Any]) -> None:
        self.last = time.monotonic()
        t["shown"] = t["completed"]
        done, total, secs = t["completed"], t["total"], self.last - t["t0"]
        speed = (done - t["start"]) / secs if secs > 0 else 0.0
        eta = f", eta {_clock((total - done) / speed)}" if speed > 0 and total > done else ""
        rate = f" {t['rate']}" if t.get("rate") else ""
        self.console.print(f"{t['description']}: {done:,.0f}/{total:,.0f} ({100 * done / max(total, 1):.0f}%){rate}, "
                           f"{_clock(secs)} elapsed{eta}", markup=False, highlight=False)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


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
    t.add_column("needle", justify="right")  # layers whose retrieval held it at the question; a re-read's text
    for n in lengths:
        for m in methods:
            row = [r for r in results if r["length"] == n and r["method"] == m]
            cells = []
            for d in depths:
                c = [r for r in row if r["depth"] == d]
                cells.append(_cell(sum(r["correct"] for r in c), len(c)))
            held = [r["needle_layers"] for r in row if r.get("needle_layers") is not None]
            read = [r["needle_read"] for r in row if r.get("needle_read") is not None]
            if read:  # a re-read: was the needle among what it read again?
                share = f"read again {sum(read)}/{len(read)}"
            else:
                share = f"held by {100 * sum(held) / len(held):.0f}% of layers" if held else ""
            t.add_row(fmt_tokens(n), m, *cells, _cell(sum(r["correct"] for r in row), len(row)), share)
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
    k = len(doc["events"])
    t.append(f"\n\n{k} event{'s' * (k != 1)}, {doc['tokens']} tokens, method {doc['method']}", style="dim")
    return t


def metrics_table(table: dict, tokens: int) -> Table:
    """Paper Table 2 style: each method's metrics as the difference to random segmentation."""
    t = Table(title=f"segmentation quality, difference to random ({tokens} tokens)")
    t.add_column("method")
    t.add_column("modularity ×10³ (↑)", justify="right")
    t.add_column("conductance (↓)", justify="right")
    t.add_column("intra/inter (↑)", justify="right")
    cell = lambda v, scale, digits: "n/a" if v is None else f"{scale * v:+.{digits}f}"  # noqa: E731
    for m, d in table.items():
        t.add_row(m, cell(d["modularity"], 1e3, 3), cell(d["conductance"], 1, 4), cell(d["intra_inter"], 1, 4))
    if any(v is None for d in table.values() for v in d.values()):
        t.caption = "n/a: no stretch of a chunk's tokens holds two events (the text is too short)"
    return t


def printable(text: object) -> str:
    """Text with its control characters (escape sequences, bidi overrides) written as escapes."""
    t = str(text)
    if not t.isprintable():
        t = "".join(c if c.isprintable() else repr(c)[1:-1] for c in t)
    return t


def shown(text: object) -> str:
    """Text from a store or a user (a document's name, a model's), safe to print through Rich:
    control characters written as escapes, markup shown as the characters it is."""
    from rich.markup import escape

    return escape(printable(text))


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_stores(rows: list[dict]) -> None:
    """The stores: a table in a terminal; piped, tab-separated lines under a header (no wrapping, no
    box characters: for cut, awk and grep)."""
    if out.is_terminal:
        out.print(stores_table(rows))
        return
    cols = ("name", "status", "model", "format", "tokens", "events", "size", "updated")
    sys.stdout.write("\t".join(cols).upper() + "\n")
    for r in rows:
        cells = (r["name"], r["status"], r["model"] or "-", r.get("format") or "-", r["tokens"],
                 "-" if r["events"] is None else r["events"], size(r["bytes"]), str(r["updated"] or "-")[:19])
        sys.stdout.write("\t".join(printable(c) for c in cells) + "\n")  # a tab or newline in a name: escaped
    sys.stdout.flush()


def stores_table(rows: list[dict]) -> Table:
    t = Table(title="stores")
    for c, j in (("name", "left"), ("status", "left"), ("model", "left"), ("format", "left"), ("tokens", "right"),
                 ("events", "right"), ("size", "right"), ("updated", "left")):
        t.add_column(c, justify=j)
    colour = {"complete": "green", "writing": "cyan", "incomplete": "yellow", "damaged": "red"}
    for r in rows:
        status = f"[{colour.get(r['status'], 'white')}]{r['status']}[/]"
        t.add_row(shown(r["name"]), status, shown(r["model"] or "-"), shown(r.get("format") or "-"), str(r["tokens"]),
                  str(r["events"] if r["events"] is not None else "-"), size(r["bytes"]), shown(r["updated"] or "-")[:19])
    return t


def store_summary(s: dict):
    from rich.console import Group

    t = Table(show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("store", shown(s["store"]))
    t.add_row("model", f"{shown(s['model'])}  [dim]config {shown(s['identity']['config_hash'])}[/dim]")
    keys = " (keys equalised)" if s.get("key_equaliser") else ""
    t.add_row("format", f"keys and values in {shown(s['format'])}{keys}, computed in {shown(s['dtype'])}")
    if "representative" in s:
        how = "the mean key of its tokens" if s["representative"] == "mean" else "its most attended tokens' keys"
        t.add_row("retrieval", f"each event found by {how} ({s['representative_heads']} heads)")
    if s.get("memory_layers"):  # a model of sliding-window and global layers: the global ones hold memory
        t.add_row("memory", f"in layers {', '.join(map(str, s['memory_layers']))} of {s['layers']} "
                            "(the others attend within a sliding window)")
    t.add_row("profile", f"{shown(s['profile']['name'])}: {shown(s['profile']['segmentation'])}, n_local {s['profile']['n_local']}, "
              f"n_mem {s['profile']['n_mem']}, chunk {s['profile']['chunk_size']}")
    unfinished = "  [cyan](an ingest is writing it now)[/cyan]" if s.get("writing") else \
        "  [yellow](ingest unfinished: --resume)[/yellow]"
    t.add_row("tokens", f"{s['tokens']}" + ("" if s["complete"] else unfinished))
    t.add_row("events", f"{s['events']}" + (f" (mean {s['mean_event_size']} tokens)" if s["mean_event_size"] else
                                               " (the text still fits the model's window)"))
    docs = s["documents"]
    listed = ", ".join(shown(d["name"]) for d in docs[:SHOWN_DOCUMENTS]) or "-"
    if len(docs) > SHOWN_DOCUMENTS:  # (a code base's thousands of files: the first, the count, --json for all)
        listed += f", … {len(docs):,} in all (--json lists them)"
    t.add_row("documents", listed)
    if s.get("perplexity") is not None:  # (stores of conversations too: their exchanges as read)
        how = "" if s.get("perplexity_exact", True) else ", estimated (surprise_head shortlist)"
        t.add_row("perplexity", f"{s['perplexity']:.2f} [dim](the documents as read: exp of their tokens' mean "
                                f"surprise{how})[/dim]")
    t.add_row("on disk", ", ".join(f"{k} {size(v)}" for k, v in s["bytes"].items() if v))
    h = Table(title="event sizes (tokens)", show_edge=False)
    h.add_column("size")
    h.add_column("events", justify="right")
    h.add_column("")
    peak = max(s["event_sizes"].values(), default=1) or 1
    for k, v in s["event_sizes"].items():
        h.add_row(k, str(v), "█" * round(30 * v / peak))
    return Group(t, h) if s["event_sizes"] else t


_SHADES = " ░▒▓█"


def retrieval_view(r: dict, tokens: int):
    """Heatmap: layers (rows) × position in the document (columns), shaded by share retrieved;
    the initial tokens and the local window, attended always and never retrieved, marked apart."""
    from rich.console import Group
    from rich.text import Text

    if not r["top_events"] and not any(x > 0 for row in r["coverage"] for x in row):
        # (a memory of no events: an empty heatmap and table would say it less plainly)
        return Text(f"retrieval for {r['query']!r}: no events yet: every token read is attended at each step, "
                    "and nothing is retrieved")
    bins = max(1, r["bins"])
    width = max(tokens, 1) / bins
    init_end, window_start = r.get("initial_tokens", 0), r.get("window_start", tokens)
    lines = Text()
    lines.append(f"retrieval for {r['query']!r}: {r['layers']} layers × document position "
                 f"(0 … {tokens} tokens)\n", style="bold")
    lines.append("shade ░▒▓█ = share of the stretch retrieved;  ", style="dim")
    lines.append("i", style="magenta")
    lines.append(" initial tokens and ", style="dim")
    lines.append("w", style="green")
    lines.append(" local window: attended always, never retrieved;  · not retrieved\n", style="dim")
    for i, row in zip(r.get("layer_ids") or range(len(r["coverage"])), r["coverage"]):
        lines.append(f"{i:>3} ", style="dim")
        for b, x in enumerate(row):
            lo, hi = b * width, (b + 1) * width
            if x > 0:
                lines.append(_SHADES[max(1, min(4, int(round(x * 4))))], style="cyan")
            elif lo < init_end:  # the stretch holds initial tokens
                lines.append("i", style="magenta")
            elif hi > window_start:  # the stretch reaches into the local window
                lines.append("w", style="green")
            else:
                lines.append("·", style="grey35")
        lines.append("\n")
    t = Table(title="most retrieved events", show_lines=False)
    t.add_column("event", justify="right")
    t.add_column("tokens", justify="right")
    t.add_column("layers", justify="right")
    named = len({e.get("document") for e in r["top_events"]}) > 1  # (events of several documents: say whose)
    if named:
        t.add_column("document")
    t.add_column("text")
    for e in r["top_events"]:
        doc = [shown(e.get("document") or "-")] if named else []
        t.add_row(str(e["event"]), f"{e['tokens'][0]}-{e['tokens'][1]}", str(e["layers"]), *doc,
                  shown(repr(e["preview"])[1:-1]))
    parts = [lines, t]
    if "layer" in r:
        steps = r["layer"]["steps"]
        z = any(s.get("scoring") == "z" for s in steps)
        lt = Table(title=f"layer {r['layer']['index']}")
        lt.add_column("step", justify="right")
        lt.add_column("event", justify="right")
        lt.add_column("score", justify="right")
        lt.add_column("text")
        for s in steps:
            unit = " z" if s.get("scoring") == "z" else ""
            for e in s["events"]:
                lt.add_row(str(s["step"]), str(e["event"]), f"{e['score']:.3f}{unit}", shown(repr(e["preview"])[1:-1]))
        parts.append(lt)
        if z:
            parts.append(Text("z: the event's z-scores over the question's tokens, their best (question_scoring max) "
                              "or a soft maximum (lse); "
                              "other scores: the query's inner product with the event's key", style="dim"))
    return Group(*parts)
