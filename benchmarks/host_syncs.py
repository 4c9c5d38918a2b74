"""Host reads of a step: how often the engine reads tensor data back to the host (on a GPU, each
is a synchronisation: the host waits for the device), counted on the CPU.

    python -m benchmarks.host_syncs [--layers 2,4,8,30]

`HostReads` counts, while it is active: scalars read from a tensor (`.item()`, `bool()`, `int()`,
`float()`: the `aten._local_scalar_dense` op, seen by a dispatch mode), and the calls that copy a
tensor's data to the host or into Python (`Tensor.cpu`, `.tolist`; `.numpy` needs a host tensor,
so it adds none). On the CPU these cost nothing, yet the same code on a GPU waits at each one, so
the count taken here is the count there. A `.cpu()` of a tensor already on the host (the store's
rows) is counted as the code makes it: the count is an upper bound.

The benchmark reads 400 tokens with a tiny random Llama of each depth (the count depends on the
code's structure, not on the model's size), its events in RAM and in a store, then counts one
chunk's step and one generated token's, for the step the CPU takes and the one a GPU takes
(`engine.window.DEVICE_STEP`).

`Launches` counts the operations a step dispatches that compute (views and allocations left
out): on a GPU each is about one kernel launch, and where a layer's kernels are small (a chunk of
512 tokens, a generated token) the host's time to launch them, not the GPU's to run them, sets
the step's pace. `--launches` prints them a layer, the device step's against the plain model's
layer (sdpa, a KV cache) on the same chunk and token, in bfloat16 as a GPU runs them (`--dtype`:
in float32 the casts between the model's dtype and attention's float32 are not there to count).
Ops on the host's tensors (a store's offsets, its write buffers) are counted too, though on a GPU
they launch nothing: the count is an upper bound.

`--scoring` counts the ops of scoring a memory's events (`selection.token_scores`, three a
block) at the sizes of a long stream, a step's query and a question's 512 tokens, in a device's
blocks against the CPU's, on the meta device (shapes only): on a GPU the blocks' launches, not
their arithmetic, grow with the memory (`python -m benchmarks.host_syncs --scoring`). With
`--device cuda` it also times them there, both ways, and checks that they give the same bits.

`--time` times the host instead: the same steps over the tiny model on one thread, whose kernels
compute next to nothing, so a layer's microseconds are Python's and dispatch's, what a GPU waits
on where a step's kernels are too small to hide them (`python -m benchmarks.host_syncs --time
--layers 2,30`).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Iterator

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

_METHODS = ("cpu", "tolist")


class HostReads(TorchDispatchMode):
    """with HostReads() as reads: ...; reads.total, reads.counts (by kind)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._saved: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts["scalar"] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> "HostReads":
        for name in _METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(t, *a, _name=name, _f=original, **k):
                self.counts[_name] += 1
                return _f(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


# ops that compute nothing (views, metadata, allocations) or only read back (counted by HostReads)
_NO_KERNEL = {
    "view", "_unsafe_view", "slice", "as_strided", "unsqueeze", "transpose", "expand", "select", "narrow", "permute",
    "squeeze", "detach", "alias", "t", "split", "split_with_sizes", "unbind", "chunk", "_reshape_alias", "reshape",
    "lift_fresh", "unfold", "diagonal", "expand_as", "movedim", "resolve_conj", "resolve_neg", "empty",
    "empty_strided", "empty_like", "new_empty", "_local_scalar_dense",
}


class HostTime:
    """with HostTime() as t: ...; t.total: the seconds it took. Over a tiny model, whose kernels
    compute next to nothing, a step's time is the host's: Python and dispatch, what a GPU whose
    step is paced by its launches waits on."""

    def __enter__(self) -> "HostTime":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.total = time.perf_counter() - self._t0


class Launches(TorchDispatchMode):
    """with Launches() as n: ...; n.total, n.counts (by op): the ops dispatched that compute."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _tiny_config(layers: int, vocab: int):
    """The tiny random Llama both counts use (the count depends on the code, not the model's size)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=1024)


def plain_launches(layers: int, chunk: int = 8, dtype: torch.dtype = torch.float32,
                   count: type | None = None) -> tuple[Launches, Launches]:
    """(a chunk's launches, a generated token's) of the plain model (sdpa, a KV cache) of
    `step_reads`'s shapes, in `dtype`, having read 400 tokens (count: what to count, as
    `step_reads` takes it; None: `Launches`)."""
    count = count or Launches
    from transformers import AutoModelForCausalLM, DynamicCache

    from benchmarks import cache_kwargs

    torch.manual_seed(0)
    cfg = _tiny_config(layers, vocab=300)
    model = AutoModelForCausalLM.from_config(cfg).eval().to(dtype)
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=cfg)
    run = lambda n: model(input_ids=torch.randint(0, 300, (1, n)), **cache_kwargs(model, cache), use_cache=True,  # noqa: E731
                          logits_to_keep=n)
    with torch.no_grad():
        run(400)
        with count() as c:
            run(chunk)
        with count() as t:
            run(1)
    return c, t


def step_reads(layers: int, tokens: int = 400, device_step: bool | None = False, store: bool = False,
               device: str = "cpu", count: type = HostReads, kv_format: str | None = None,
               ring: bool = False, question: bool = False, answer_tokens: int = 1,
               dtype: torch.dtype = torch.float32) -> tuple[HostReads, HostReads]:
    """(a chunk's reads, a generated token's) of an engine over a tiny random Llama that has read
    `tokens` tokens (events closed, retrieval at every step). device_step: the step a GPU takes
    (`engine.window.DEVICE_STEP`: selection and gather on the device); else the CPU's. store: the
    events in a store (a temporary one, written as `emllm ingest` writes), else in RAM. device:
    where the model runs (device_step None: the step that device takes by default). count: what
    to count (`Launches`: the ops that compute). kv_format: the store's format (None: the compute dtype).
    ring: the device's budget too small for the store's rows, large enough for its keys and a ring
    of rows (`resident.CachedEvents`). question: the chunk counted is a question's and the tokens
    an answer's that attend to its memory (profile answer_retrieval "question"); answer_tokens:
    how many generated tokens the second count holds (events close while answering); dtype: the
    model's."""
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emllm import models
    from emllm.config import load_profile
    from emllm.engine import window
    from emllm.engine.stream import Engine

    tok = AutoTokenizer.from_pretrained(models.resolve("smollm2").path)  # (a store records its tokenizer)
    prof = load_profile("smollm2").replace(chunk_size=8, n_init=4, n_local=32, n_mem=24, min_block=2, max_block=8,
                                           repr_topk=2, answer_retrieval="question" if question else "token")
    torch.manual_seed(0)
    cfg = _tiny_config(layers, vocab=len(tok))
    model = AutoModelForCausalLM.from_config(cfg).eval().to(device, dtype)
    g = torch.Generator().manual_seed(1)
    saved, window.DEVICE_STEP = window.DEVICE_STEP, device_step
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, window, "DEVICE_STEP", saved)
        if ring:  # a layer's share: under every token's rows, over ~80 events' keys (twice) and 5 budgets' rows
            from emllm.memory import quant, resident

            token = 2 * (quant.kv_format(kv_format, 16).row_bytes(2, 16) if kv_format else 2 * 16 * 4)
            share = 2 * 80 * (32 * 4 + 8) + 5 * prof.n_mem * token
            assert share < tokens * token + 70 * (32 * 4 + 8), "every row would fit: no ring"
            dev = torch.device(device)
            if dev.type == "cuda" and dev.index is None:  # (as a step's tensors name it)
                dev = torch.device("cuda", torch.cuda.current_device())
            stack.callback(resident._BUDGETS.pop, dev, None)
            resident._BUDGETS[dev] = float(share * layers)
        if store:
            from emllm.app import stream

            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            st = stack.enter_context(stream.create_store(folder / "s", "tiny", model, tok, prof, kv_format=kv_format))
            engine = stream.open_engine(st, model)
        else:
            engine = Engine(model, prof)
        engine.feed(torch.randint(0, 300, (tokens,), generator=g))
        if question:
            engine.begin_question()
        with torch.no_grad(), count() as chunk:
            engine.step(torch.randint(0, 300, (prof.chunk_size,), generator=g))
        with torch.no_grad(), count() as token:
            for t in torch.randint(0, 300, (answer_tokens,), generator=g):
                engine.step(t.view(1), with_surprise=False, kept_memory=question)
    return chunk, token


@contextlib.contextmanager
def _blocks(device_blocks: bool) -> Iterator[None]:
    """A device's scoring blocks as they are, or the CPU's in their place (device_blocks False)."""
    from emllm.memory import selection

    saved = selection.DEVICE_BLOCK_BYTES
    if not device_blocks:
        selection.DEVICE_BLOCK_BYTES = selection.SCORE_BLOCK_BYTES
    try:
        yield
    finally:
        selection.DEVICE_BLOCK_BYTES = saved


def scoring_launches(events: int, dim: int, queries: int, device_blocks: bool = True) -> int:
    """Ops of scoring `events` representative keys of `dim` floats (bfloat16) for `queries`
    queries, in a device's blocks (else the CPU's), counted on the meta device."""
    from emllm.memory.selection import token_scores

    meta = torch.device("meta")
    rows = torch.empty(events, dim, dtype=torch.bfloat16, device=meta)
    with _blocks(device_blocks), Launches() as n:
        token_scores(events, dim, lambda a, b: rows[a:b], torch.empty(queries, dim, device=meta))
    return n.total


def scoring_seconds(events: int, dim: int, queries: int, device: str, device_blocks: bool = True,
                    repeat: int = 3) -> tuple[float, Tensor]:
    """(the fastest of `repeat` runs' seconds, the scores) of `scoring_launches`' scoring, run on
    `device` (random keys and queries, the same for every call of the same sizes)."""
    from emllm.memory.selection import token_scores

    g = torch.Generator().manual_seed(events + dim + queries)
    rows = torch.randn(events, dim, generator=g).to(device, torch.bfloat16)
    q = torch.randn(queries, dim, generator=g).to(device)
    sync = torch.cuda.synchronize if rows.device.type == "cuda" else (lambda: None)
    best = float("inf")
    with _blocks(device_blocks):
        for _ in range(repeat + 1):  # (the first: the work buffers' allocation)
            sync()
            t = time.perf_counter()
            out = token_scores(events, dim, lambda a, b: rows[a:b], q)
            sync()
            best = min(best, time.perf_counter() - t)
    return best, out


def host_time(args, lo: int, hi: int) -> None:
    """`--time`: microseconds of the host a layer (the difference between lo and hi layers), the
    device step's against the plain model's, one JSON line each. The three are run in turn within
    each repeat (lockstep: a change of the machine's load hits them alike), the fastest kept."""
    import json

    torch.set_num_threads(1)
    dtype, n_tok = getattr(torch, args.dtype), 32
    ways = (("plain model (sdpa, KV cache)", lambda n: plain_launches(n, dtype=dtype, count=HostTime)),
            ("emllm (device step, store)",
             lambda n: step_reads(n, device_step=True, store=True, count=HostTime, answer_tokens=n_tok, dtype=dtype)),
            ("emllm, an answer on its question's memory (answer_retrieval question)",
             lambda n: step_reads(n, device_step=True, store=True, count=HostTime, question=True,
                                  answer_tokens=n_tok, dtype=dtype)))
    runs: dict[tuple[str, int], list] = {(name, n): [] for name, _ in ways for n in (lo, hi)}
    for _ in range(args.repeat):
        for name, f in ways:
            for n in (lo, hi):
                runs[name, n].append(f(n))
    for name, _ in ways:
        tokens = 1 if name.startswith("plain") else n_tok
        best = {n: (min(c.total for c, _ in runs[name, n]), min(t.total for _, t in runs[name, n]) / tokens)
                for n in (lo, hi)}
        per = lambda i: round(1e6 * (best[hi][i] - best[lo][i]) / (hi - lo), 1)  # noqa: E731
        print(json.dumps({"what": name, "dtype": args.dtype, "chunk_us_per_layer": per(0), "token_us_per_layer": per(1)}),
              flush=True)


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="2,4,8,30")
    ap.add_argument("--launches", action="store_true", help="count the ops that compute (kernel launches on a GPU), a layer")
    ap.add_argument("--time", action="store_true",
                    help="time the host a layer instead (tiny model, one thread, best of --repeat): the device step's "
                         "chunk and tokens against the plain model's")
    ap.add_argument("--scoring", action="store_true",
                    help="count the ops of scoring a long memory's events, a device's blocks against the CPU's")
    ap.add_argument("--device", default=None,
                    help="with --scoring: also time the scoring on this device (e.g. cuda), both ways")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each depth for --time (the fastest counts)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="the model's dtype for --launches (a GPU's runs in bfloat16: float32 counts no casts)")
    args = ap.parse_args()
    if args.time or args.launches:  # a layer's figure: the difference between the fewest and the most layers
        depths = [int(x) for x in args.layers.split(",")]
        lo, hi = min(depths), max(depths)
        if lo == hi:
            ap.error(f"--{'time' if args.time else 'launches'} needs two depths in --layers, e.g. 2,8")
    if args.time:
        host_time(args, lo, hi)
        return
    if args.scoring:  # events of ~15 tokens: 131k and 1M tokens; SmolLM2's dim (3 heads of 64), the 0.5B's (2)
        for tokens, dim in ((131_072, 192), (1 << 20, 192), (1 << 20, 128)):
            for queries in (1, 512):
                events = tokens // 15
                row = {"tokens": tokens, "events": events, "dim": dim, "queries": queries,
                       "ops_device_blocks": scoring_launches(events, dim, queries),
                       "ops_cpu_blocks": scoring_launches(events, dim, queries, device_blocks=False)}
                if args.device:
                    (fast, a), (slow, b) = (scoring_seconds(events, dim, queries, args.device, blocks)
                                            for blocks in (True, False))
                    row.update(device=args.device, s_device_blocks=round(fast, 5), s_cpu_blocks=round(slow, 5),
                               same_bits=bool(torch.equal(a, b)))
                print(json.dumps(row), flush=True)
        return
    if args.launches:
        n_tok = 16  # generated tokens a count (some close events, some do not): their mean
        dtype = getattr(torch, args.dtype)
        for name, f in (("emllm (device step, store)",
                         lambda n: step_reads(n, device_step=True, store=True, count=Launches, answer_tokens=n_tok,
                                              dtype=dtype)),
                        ("emllm, an answer on its question's memory (answer_retrieval question)",
                         lambda n: step_reads(n, device_step=True, store=True, count=Launches, question=True,
                                              answer_tokens=n_tok, dtype=dtype)),
                        ("plain model (sdpa, KV cache)", lambda n: plain_launches(n, dtype=dtype))):
            (c_lo, t_lo), (c_hi, t_hi) = f(lo), f(hi)
            per_layer = (c_hi.total - c_lo.total) / (hi - lo)
            tokens = 1 if name.startswith("plain") else n_tok
            print(json.dumps({"what": name, "dtype": args.dtype, "chunk_per_layer": per_layer,
                              "token_per_layer": (t_hi.total - t_lo.total) / (hi - lo) / tokens,
                              "chunk_fixed": c_lo.total - lo * per_layer,
                              "top_per_layer": {k: v / (hi - lo) for k, v in (c_hi.counts - c_lo.counts).most_common(12)}}))
        return
    rows = []
    for step, store, ring in (("cpu", False, False), ("device", False, False), ("cpu", True, False), ("device", True, False),
                              ("device", True, True)):
        rows = []
        events = "store, past the budget: a ring" if ring else "store" if store else "RAM"
        for n in (int(x) for x in args.layers.split(",")):
            chunk, token = step_reads(n, device_step=step == "device", store=store, ring=ring)
            rows.append({"step": step, "events": events, "layers": n, "chunk": chunk.total, "token": token.total,
                         "chunk_by_kind": dict(chunk.counts), "token_by_kind": dict(token.counts)})
            print(json.dumps(rows[-1]))
        if len(rows) > 1:
            a, b = rows[0], rows[-1]
            span = b["layers"] - a["layers"]
            print(json.dumps({"step": step, "events": events, "per_layer_chunk": (b["chunk"] - a["chunk"]) / span,
                              "per_layer_token": (b["token"] - a["token"]) / span}))


if __name__ == "__main__":
    main()
