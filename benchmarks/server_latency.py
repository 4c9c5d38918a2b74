"""Time to the first answer token: a cold `emllm ask` (a new process: imports, model load, store
open) against a request to a warm `emllm serve` (model loaded, store held open), on the same
store and question, alternated so load on the machine hits both alike. Then four clients at once
against one: answers per minute, errors, and the store unchanged byte for byte. With --stores N:
a server over N stores (hard links of the one named, in a home of their own) at a limit of 1,024
open files, each asked twice in turn: errors, the most files open, resident memory.

    python -m benchmarks.server_latency --store NAME [--runs 3] [--clients 4] [--stores 40]

Cold is measured from the process's start to its first byte on stdout (what a user waits for);
warm from sending the request to the first streamed token of the answer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

EMLLM = str(Path(sys.executable).parent / "emllm")
QUESTION = "What does a crash in the middle of an ingest leave behind?"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(url: str) -> None:
    for _ in range(1200):  # (a model's load: up to two minutes)
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.1)


def cold(store: str, n: int) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen([EMLLM, "ask", QUESTION, "--store", store, "-n", str(n)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    p.stdout.read(1)
    first = time.perf_counter() - t0
    p.communicate()
    return first


def warm(url: str, store: str, n: int) -> tuple[float, float]:
    body = json.dumps({"model": store, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": n,
                       "stream": True, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req) as r:
        for line in r:
            if first is None and line.startswith(b"data: {") and b'"content": "' in line and b'"content": ""' not in line:
                first = time.perf_counter() - t0
    return first or time.perf_counter() - t0, time.perf_counter() - t0


def many_stores(store: str, model: str, n: int, limit: int = 1024) -> None:
    """N hard-linked copies of `store` served at a soft and hard limit of `limit` open files."""
    import resource
    import tempfile

    from emllm.home import models_dir, stores_dir

    with tempfile.TemporaryDirectory(dir=stores_dir().parent) as tmp:  # (hard links: the stores' file system)
        home = Path(tmp)
        src = stores_dir() / store
        for i in range(n):
            for f in src.rglob("*"):
                if f.is_file() and f.name != "lock":
                    dst = home / "stores" / f"s{i:03d}" / f.relative_to(src)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    os.link(f, dst)
        port = _port()
        server = subprocess.Popen([EMLLM, "serve", "--port", str(port), "-m", model], stderr=subprocess.DEVNULL,
                                  env={**os.environ, "EMLLM_HOME": str(home), "EMLLM_MODELS": str(models_dir())},
                                  preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
        url = f"http://127.0.0.1:{port}"
        errors, most_files, most_rss = [], 0, 0
        try:
            _wait_until_up(url)
            t0 = time.perf_counter()
            for i in list(range(n)) * 2:
                try:
                    warm(url, f"s{i:03d}", 2)
                except Exception as e:  # noqa: BLE001 - counted
                    errors.append(f"s{i:03d}: {e}")
                most_files = max(most_files, len(os.listdir(f"/proc/{server.pid}/fd")))
                status = Path(f"/proc/{server.pid}/status").read_text()
                most_rss = max(most_rss, int(status.split("VmRSS:")[1].split()[0]) // 1024)
            secs = time.perf_counter() - t0
        finally:
            server.terminate()
            server.wait()
        print(f"{n} stores, each asked twice in turn, at a limit of {limit} open files: {2 * n - len(errors)} answered, "
              f"{len(errors)} errors{': ' + errors[0] if errors else ''}; at most {most_files} files open, "
              f"{most_rss} MiB resident; {secs / (2 * n):.2f} s a request")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="a store's name under the emllm home (a server serves names, not paths)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16, help="answer length of the concurrency test")
    ap.add_argument("--stores", type=int, default=0, help="only the test of a server over this many stores")
    a = ap.parse_args()
    # the server loads one model: the store's own (`emllm serve` alone loads the default)
    shown = subprocess.run([EMLLM, "show", a.store, "--json"], capture_output=True, text=True)
    if shown.returncode:
        ap.error(f"--store {a.store}: {shown.stderr.strip()}")
    model = json.loads(shown.stdout)["model"]
    if a.stores:
        many_stores(a.store, model, a.stores)
        return
    port = _port()
    server = subprocess.Popen([EMLLM, "serve", "--port", str(port), "-m", model], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(url)
        warm(url, a.store, 1)  # the store opened and held
        colds, warms = [], []
        for _ in range(a.runs):
            colds.append(cold(a.store, 1))
            warms.append(warm(url, a.store, 1)[0])
        c, w = statistics.median(colds), statistics.median(warms)
        print(f"first token: cold ask {c:.2f} s (runs {', '.join(f'{x:.2f}' for x in colds)}), warm server "
              f"{w:.2f} s ({', '.join(f'{x:.2f}' for x in warms)}): {c / w:.1f}x sooner")
        from emllm.home import stores_dir

        home = stores_dir() / a.store
        digest = lambda: hashlib.sha256(b"".join(p.read_bytes() for p in sorted(home.rglob("*")) if p.is_file() and p.name != "lock")).hexdigest()  # noqa: E731
        before = digest()
        for clients in (1, a.clients):
            errors, done = [], []

            def one() -> None:
                try:
                    warm(url, a.store, a.tokens)
                    done.append(1)
                except Exception as e:  # noqa: BLE001 - counted
                    errors.append(repr(e))

            t0 = time.perf_counter()
            threads = [threading.Thread(target=one) for _ in range(clients * 2)]  # two requests per client
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            secs = time.perf_counter() - t0
            print(f"{clients} client(s): {len(done)} answers in {secs:.1f} s = {60 * len(done) / secs:.1f} per minute, "
                  f"{len(errors)} errors{': ' + errors[0] if errors else ''}")
        print(f"store unchanged byte for byte: {digest() == before}")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
