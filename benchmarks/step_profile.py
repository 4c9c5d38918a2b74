"""Where a step's time goes: `torch.profiler` over a few chunks and generated tokens of emllm at a
given length read, its memory in a store (random weights of `--model`'s shapes, the memory
brought to that length as `benchmarks.speed_grid` brings it). On a GPU, what it shows is how many
kernels a step launches and how long the device is busy against the step's wall time.

    python -m benchmarks.step_profile --device cuda --length 128k --out /tmp/prof

Writes chunk.txt and token.txt (the profiler's tables by host and by device time) and
python.txt (cProfile of the same chunks) under --out; prints one JSON line of totals.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch


def step_args(ap: argparse.ArgumentParser, what: str) -> None:
    """The arguments of a benchmark of a few steps of a random model at a length read."""
    ap.add_argument("--model", "-m", default="smollm2", help="whose shapes (its config; random weights)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where torch sees one)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--length", default="128k", help=f"tokens in memory before the {what} steps")
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8)


def random_model(name: str, dtype: str, device: str):
    """(model, tokenizer, profile, config): random weights of model `name`'s shapes, made on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from emllm import models

    src = models.resolve(name)
    prof, cfg = src.profile, AutoConfig.from_pretrained(src.path)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype)).eval()
    return model, AutoTokenizer.from_pretrained(src.path), prof, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    step_args(ap, "profiled")
    ap.add_argument("--out", required=True, help="folder for the tables")
    a = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.speed_grid import fill_memory
    from emllm.evals.passkey import parse_length
    from emllm.evals.scratch import ScratchStores

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, tok, prof, cfg = random_model(a.model, a.dtype, device)
    cs = prof.chunk_size
    ids = torch.randint(0, cfg.vocab_size, (prof.n_init + prof.n_local + (a.chunks * 3 + 6) * cs + 4 * a.tokens,),
                        generator=torch.Generator().manual_seed(1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort_device = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    totals: dict[str, float] = {}
    with torch.no_grad(), tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp, ScratchStores(model, tok, prof, tmp) as make:
        em, pos = make(), 0

        def steps(n: int, c: int) -> None:
            nonlocal pos
            for _ in range(n):
                em.step(ids[pos : pos + c], with_surprise=c > 1)
                pos += c
            sync()

        steps((prof.n_init + prof.n_local) // cs + 3, cs)  # a real prefix: the window full, events closed
        read = max(em.n_tokens, parse_length(a.length))
        fill_memory(em, read - em.n_tokens, torch.Generator().manual_seed(0))
        steps(2, cs)
        steps(2, 1)  # warm: the first chunk and token after the fill
        for name, n, c in (("chunk", a.chunks, cs), ("token", a.tokens, 1)):
            t = time.perf_counter()
            steps(n, c)
            totals[f"{name}_s"] = round((time.perf_counter() - t) / n, 4)
            with profile(activities=activities) as p:
                steps(n, c)
            avg = p.key_averages()
            launches = sum(e.count for e in avg if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
            busy = sum(e.self_device_time_total for e in avg) / 1e3 / n if cuda else None
            totals.update({f"{name}_kernel_launches": launches / n, f"{name}_device_busy_ms": busy})
            (out / f"{name}.txt").write_text(avg.table(sort_by="self_cpu_time_total", row_limit=45) + "\n"
                                             + avg.table(sort_by=sort_device, row_limit=30))
        pr = cProfile.Profile()
        pr.enable()
        steps(a.chunks, cs)
        pr.disable()
        with open(out / "python.txt", "w") as f:
            pstats.Stats(pr, stream=f).sort_stats("tottime").print_stats(45)
    print(json.dumps({"model": a.model, "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": a.dtype,
                      "layers": cfg.num_hidden_layers, "tokens_read": read, **totals}))


if __name__ == "__main__":
    main()
