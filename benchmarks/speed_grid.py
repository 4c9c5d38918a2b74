"""Per-chunk prefill time and per-token decode time against how much the model has read, side by
side: emllm (memory in a store, as `emllm ingest` keeps it), vanilla HF full attention (sdpa, a KV
cache of every past token) and a sliding window as large as emllm's attention window.

    python -m benchmarks.speed_grid --lengths 4k,16k,64k,256k --out docs/results/speed-smollm2.jsonl --plot docs/results/speed-smollm2.png
    python -m benchmarks.speed_grid --config llama-3.2-1b --lengths 16k,64k --out docs/results/speed-llama1b.jsonl

How a length is reached: a chunk's cost depends on how much memory it works against, not on what
the memory holds. So each run reads a real prefix (the initial tokens, a full local window and
two more chunks, the state of a real stream), and is then brought to L tokens read with random
keys and values: emllm's store gets events of the prefix's size distribution until its events
hold L tokens (the files, and the representative keys scanned at every step, are as large as a
real stream's at L); full attention's cache gets L random positions; the sliding window is full
from the prefix on. Then, in lockstep (one chunk of each method in turn, so load on the machine
hits all alike), one real chunk is run untimed (the fill has just written GBs: the first chunk
after it would time the disk's write-back and a cold event cache, not the steady cost), then
`--chunks` real chunks are timed, then `--decode` tokens continuing the document (each retrieving),
then, after a question's chunk, `--decode` tokens of emllm's answer (`emllm_answer_token_s`: the
profile's answer_retrieval, as `ask` generates them) beside the window's. Lengths are
visited in increasing order with the same engine, so the whole grid costs one fill to the
largest L (and full attention's cache only up to --full-max).

`--config llama-3.2-1b` (or `llama-3.1-8b`) builds that model's shapes with random weights (no download) and uses the
llama3.1 profile; `--random-weights` does the same with `--model`'s own config (its shapes without
its weights file: timing where the weights cannot travel). `--device cuda` runs every method on the
GPU (times taken after a device synchronise); `--dtype` as `emllm ingest --dtype`.

    python -m benchmarks.speed_grid --device cuda --dtype bfloat16 --random-weights --lengths 4k,32k,256k --out gpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import cache_kwargs, machine
from benchmarks.ingest_speed import Vanilla, plain_cache
from emllm import models
from emllm.config import load_profile
from emllm.evals.passkey import parse_length
from emllm.evals.scratch import ScratchStores
from emllm.memory.quant import FORMATS

LLAMA_3_2_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)
LLAMA_3_1_8B = dict(
    LLAMA_3_2_1B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, head_dim=128,
    tie_word_embeddings=False, rope_scaling={**LLAMA_3_2_1B["rope_scaling"], "factor": 8.0},
)
CONFIGS = {"llama-3.2-1b": LLAMA_3_2_1B, "llama-3.1-8b": LLAMA_3_1_8B}


class Full:
    """Vanilla full attention: every past token in the cache."""

    def __init__(self, model) -> None:
        self.model, self.cache = model, plain_cache(model)

    @property
    def n(self) -> int:
        return self.cache.get_seq_length()

    def pad_to(self, n: int, cfg) -> None:
        """Append random keys and values until the cache holds n positions."""
        m = n - self.n
        if m <= 0:
            return
        h, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        p = next(self.model.parameters())
        for i in range(cfg.num_hidden_layers):
            kv = torch.randn(1, h, m, d, dtype=p.dtype, device=p.device)
            self.cache.update(kv, kv.clone(), i)

    @torch.no_grad()
    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.model.set_attn_implementation("sdpa")
        dev = models.input_device(self.model)
        pos = torch.arange(self.n, self.n + x.numel(), device=dev)[None]
        return self.model(input_ids=x.to(dev)[None], **cache_kwargs(self.model, self.cache), position_ids=pos, use_cache=True,
                          logits_to_keep=1).logits[0, -1]  # the last token's logits, as a plain prefill computes


def fill_memory(engine, m: int, gen: torch.Generator) -> None:
    """Append m tokens of random events to every layer, sized like the engine's real events."""
    if m <= 0:
        return
    real = engine.windows[0].events.event_lengths().cpu()
    lengths = real.repeat(-(-m // int(real.sum())) + 1)
    lengths = lengths[: int((torch.cumsum(lengths, 0) <= m).sum()) + 1]
    lengths[-1] -= int(lengths.sum()) - m
    lengths = lengths[lengths > 0]
    block = 65536
    batch = (torch.cumsum(lengths, 0) - 1) // block  # events in batches of ~64k tokens: bounded RAM
    for w in engine.windows:
        h_kv, d = w.n_kv_heads, w.head_dim
        # one random block a layer, its slices appended batch after batch: what the rows hold does not
        # change a chunk's cost, and drawing a million tokens' rows afresh took minutes of the host
        most = int(max(int(lengths[batch == b].sum()) for b in batch.unique()))
        # on the engine's device: a store's rows are then encoded there (an integer format) and
        # written at each batch's end, as a step's are
        kb = torch.randn(h_kv, most, d, generator=gen).to(engine.device, engine.dtype)
        vb = torch.randn(h_kv, most, d, generator=gen).to(engine.device, engine.dtype)
        rb = torch.randn(block, w.events.repr_heads, d, generator=gen).to(engine.device, engine.dtype)
        for b in batch.unique():
            ls = lengths[batch == b]
            m = int(ls.sum())
            k, v, reprs = kb[:, :m], vb[:, :m], rb[: ls.numel()]
            # a store from version 5 keeps every token's rows (add_tokens) and events index them;
            # these events then span the real window's rows and the random ones: the same cost
            w.events.add_tokens(k, v)
            w.events.append(k, v, ls, reprs)
            if hasattr(w.events, "flush"):
                w.events.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="smollm2")
    ap.add_argument("--config", choices=sorted(CONFIGS), default=None, help="random weights of these shapes instead")
    ap.add_argument("--random-weights", action="store_true", help="--model's shapes with random weights")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where torch sees one)")
    ap.add_argument("--dtype", default=None, choices=models.DTYPES, help="compute dtype (default: the profile's, auto)")
    ap.add_argument("--format", default=None, choices=FORMATS,
                    help="how emllm's store keeps keys and values, as `emllm ingest --format` (default: the compute dtype)")
    ap.add_argument("--lengths", default="4k,16k,64k,256k")
    ap.add_argument("--chunks", type=int, default=2, help="timed chunks per method and length")
    ap.add_argument("--decode", type=int, default=4, help="timed greedy tokens per method and length")
    ap.add_argument("--full-max", default=None,
                    help="longest length for full attention (default: as far as its cache fits in half the free RAM)")
    ap.add_argument("--device-budget", type=float, default=None, metavar="GB",
                    help="GB of the device's memory emllm's events may take, all layers ($EMLLM_DEVICE_MEMORY; default: "
                         "half its free memory); below the store's rows, its keys stay there and its rows pass through a ring")
    ap.add_argument("--out", default=None, help="JSON lines, appended (with --replot: the file to read); none: printed only")
    ap.add_argument("--replot", action="store_true", help="measure nothing: table and plot of the last run in --out")
    ap.add_argument("--plot", default=None, help="PNG of time per chunk against length (needs matplotlib)")
    a = ap.parse_args()
    if a.replot and not a.out:
        ap.error("--replot reads the file --out names")
    if a.replot:
        meta, rows = last_run(a.out)
        print(table(rows, meta))
        if a.plot:
            plot(rows, meta, a.plot)
        return
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.device_budget is not None:  # (as a user sets it)
        os.environ["EMLLM_DEVICE_MEMORY"] = str(a.device_budget)
    if a.config or a.random_weights:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

        src = models.resolve(a.model)
        cfg = LlamaConfig(**CONFIGS[a.config]) if a.config else AutoConfig.from_pretrained(src.path)
        prof, name = (load_profile("llama3.1"), a.config) if a.config else (src.profile, f"{a.model} (random weights)")
        dt = models.compute_dtype(a.dtype or os.environ.get("EMLLM_DTYPE") or prof.dtype, device)
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it computes: a 1B model's random init is slow on a CPU
            model = AutoModelForCausalLM.from_config(cfg, dtype=dt).eval()
        tok = AutoTokenizer.from_pretrained(src.path)
        ids_all = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1))  # noqa: E731
    else:
        from emllm.evals.corpus import tokens as corpus_tokens

        src = models.resolve(a.model)
        model, tok = models.load(src, dtype=a.dtype, device=device)
        prof, name = src.profile, a.model
        ids_all = lambda n: torch.tensor(corpus_tokens(tok, "prose", n))  # noqa: E731
    cfg = model.config
    lengths = sorted(parse_length(x) for x in a.lengths.split(","))
    cs, w_size = prof.chunk_size, prof.n_init + prof.n_mem + prof.n_local
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * next(model.parameters()).element_size()
    if a.full_max is None:
        if device.startswith("cuda"):
            avail = torch.cuda.mem_get_info()[0]
        else:
            avail = int(next(ln for ln in open("/proc/meminfo") if ln.startswith("MemAvailable")).split()[1]) * 1024
        full_max = avail // 2 // kv_bytes
    else:
        full_max = parse_length(a.full_max)
    prefix = prof.n_init + prof.n_local + 2 * cs
    need = prefix + len(lengths) * (a.chunks + 4) * cs
    ids = ids_all(need)
    gen = torch.Generator().manual_seed(0)
    tmp = tempfile.TemporaryDirectory(dir=Path.cwd())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: still remove the store (GBs)
    stores = ScratchStores(model, tok, prof, tmp.name, name, kv_format=a.format)
    em = stores()
    win, full = Vanilla(model, w_size), Full(model)
    runs = {"emllm": em.step, "window": win.step, "full": full.step}
    for off in range(0, prefix, cs):  # a real prefix for every method
        for f in runs.values():
            with torch.no_grad():
                f(ids[off : off + cs])
    pos = prefix
    where = torch.cuda.get_device_name() if device.startswith("cuda") else machine(torch.get_num_threads())
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(f, *args) -> float:
        """Seconds f(*args) takes, the device idle before and after."""
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            f(*args)
        sync()
        return time.perf_counter() - t

    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": where, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "store_format": a.format or "compute dtype",
            "model": name, "profile": prof.name, "window": w_size, "chunk": cs, "kv_bytes_per_token": kv_bytes,
            "full_max": full_max, **({"device_budget_gb": a.device_budget} if a.device_budget is not None else {})}
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps({"run": meta}) + "\n")
    rows = []
    synthetic = 0  # random tokens in emllm's memory; tokens read = em.n_tokens + synthetic
    for n in lengths:
        fill_memory(em, n - em.n_tokens - synthetic, gen)
        synthetic = max(synthetic, n - em.n_tokens)
        active = {"emllm": runs["emllm"], "window": runs["window"]}
        if n <= full_max:
            full.pad_to(n, cfg)
            active["full"] = runs["full"]
        os.sync()  # the fill's dirty pages written back before any timing
        for f in active.values():  # warm-up: untimed
            with torch.no_grad():
                f(ids[pos : pos + cs])
        pos += cs
        read = em.n_tokens + synthetic  # tokens read before the first timed chunk (full: the same, as far as it runs)
        times: dict[str, list[float]] = {m: [] for m in active}
        for _ in range(a.chunks):
            x = ids[pos : pos + cs]
            pos += cs
            for m, f in active.items():
                times[m].append(timed(f, x))
        dec: dict[str, list[float]] = {m: [] for m in active}
        for i in range(a.decode):
            x = ids[pos + i : pos + i + 1]
            for m, f in active.items():
                dec[m].append(timed(f, x))
        pos += cs
        # an answer's tokens (a question read as its chunk, then the answer generated as `ask`
        # does, the profile's answer_retrieval), in lockstep with the window's tokens again
        em.begin_question()
        kept_profile = em.profile  # (the filled events have no token ids to tell copies apart by)
        em.profile = em.profile.replace(distinct_events=False)
        with torch.no_grad():
            em.step(ids[pos : pos + cs])
            em.profile = kept_profile
            pos += cs
            answer = em.generate_iter(a.decode + 1)
            next(answer)  # (the first token comes from the question's logits: no step)
            for i in range(a.decode):
                # an answer's token: the last token's step, and the next token chosen
                dec.setdefault("emllm_answer", []).append(timed(next, answer))
                dec.setdefault("window", []).append(timed(win.step, ids[pos + i : pos + i + 1]))
            answer.close()
        pos += cs
        on_dev = getattr(em.windows[0].events, "on_dev", None)  # (a store's layer on the device: all its rows, or a ring)
        ring = getattr(on_dev, "ring", None)
        held = {} if on_dev is None else {"device_rows": "ring" if ring is not None else "all"}
        if ring is not None:
            held["ring_hit_share"] = round(ring.hit_tokens / max(1, ring.hit_tokens + ring.miss_tokens), 3)
        row = {"length": n, "tokens_read": read, "events": em.n_events, "memory_tokens": em.windows[0].events.n_tokens, "full_cache": full.n, **held,
               **{f"{m}_chunk_s": round(sum(t) / len(t), 3) for m, t in times.items()},
               **{f"{m}_token_s": round(sum(t) / len(t), 4) for m, t in dec.items()}}
        rows.append(row)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    stores.close()
    tmp.cleanup()
    print(table(rows, meta))
    if a.plot:
        plot(rows, meta, a.plot)


def last_run(path: str) -> tuple[dict, list[dict]]:
    """The meta line and rows of the last run recorded in a --out file."""
    meta, rows = None, []
    for line in open(path):
        rec = json.loads(line)
        if "run" in rec:
            meta, rows = rec["run"], []
        else:
            rows.append(rec)
    if meta is None or not rows:
        sys.exit(f"{path}: no recorded run")
    return meta, rows


def table(rows: list[dict], meta: dict) -> str:
    out = [f"{meta['model']} ({meta['profile']} profile, window {meta['window']}, {meta.get('dtype', 'float32')}), {meta['machine']}, {meta['date']}",
           "", "| tokens read | events/layer | emllm s/chunk | window s/chunk | full s/chunk | emllm/window | emllm/full "
           "| emllm s/token | emllm s/answer token | window s/token | full s/token |", "|" + "---:|" * 11]
    base = rows[0]["emllm_chunk_s"]
    for r in rows:
        full = r.get("full_chunk_s")
        vs_full = f"{r['emllm_chunk_s'] / full:.2f}" if full else "–"
        out.append(
            f"| {r.get('tokens_read', r['length']):,} | {r['events']:,} | {r['emllm_chunk_s']} ({r['emllm_chunk_s'] / base:.2f}x) | {r['window_chunk_s']} "
            f"| {full or '–'} | {r['emllm_chunk_s'] / r['window_chunk_s']:.2f} | {vs_full} | {r['emllm_token_s']} "
            f"| {r.get('emllm_answer_token_s', '–')} "
            f"| {r['window_token_s']} | {r.get('full_token_s', '–')} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], meta: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: pip install matplotlib")
        return
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for m, style in (("emllm", "o-"), ("window", "s--"), ("full", "^:")):
        pts = [(r["length"], r[f"{m}_chunk_s"]) for r in rows if f"{m}_chunk_s" in r]
        if pts:
            ax.plot(*zip(*pts), style, label={"emllm": "emllm (store)", "window": f"sliding window ({meta['window']})",
                                              "full": "full attention"}[m])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([r["length"] for r in rows], [f"{r['length'] // 1024}k" for r in rows])
    ax.minorticks_off()
    ys = [r[k] for r in rows for k in r if k.endswith("_chunk_s")]
    nice = [x * 10.0**e for e in range(-2, 4) for x in (1, 2, 3, 5)]  # labelled ticks: a log axis over less than a decade has none
    ticks = [y for y in nice if min(ys) / 1.3 <= y <= max(ys) * 1.3]
    ax.set_yticks(ticks, [f"{y:g}" for y in ticks])
    ax.set_xlabel("tokens read before the chunk")
    ax.set_ylabel(f"seconds per chunk of {meta['chunk']}")
    ax.set_title(f"{meta['model']}: prefill time per chunk", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
