"""Whether `torch.compile` helps the device step: emllm's chunk and generated token, its pure
functions as they are and compiled (the joint attention, the rotation, the selection, the padded
gather, the token scores), side by side in one run, with the logits of both compared.

    python -m benchmarks.compile_probe --device cuda --length 128k

On a GPU the step is paced by the kernels it launches (docs/benchmarks.md › Accelerators);
compiling fuses a function's elementwise operations into fewer kernels, at the price of guards
checked at every call and a compilation at the first call of each shape. Two engines over stores
filled alike (random weights of `--model`'s shapes, the memory brought to `--length` as
`benchmarks.speed_grid` brings it) step the same chunks and tokens in lockstep, one eager and one
with the functions compiled (`--mode` as torch.compile's); the first `--warm` of each kind are
untimed (the compilations). Prints one JSON line: seconds a chunk and a token each way, their
ratio, the compile time, and the largest difference of the logits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.step_profile import random_model, step_args

# (module, name) of the functions compiled: each called through its module's global, so that
# replacing the global replaces every call
TARGETS = (
    ("emllm.math.attention", "_attend_joint"),
    ("emllm.engine.window", "rotate"),
    ("emllm.memory.selection", "select_mask"),
    ("emllm.memory.buffers", "padded_index"),
    ("emllm.memory.selection", "token_scores"),
)


class Compiled:
    """The TARGETS' compiled versions (made once), put in place while inside `with`."""

    def __init__(self, mode: str | None) -> None:
        import importlib

        self.swaps = []
        for mod, name in TARGETS:
            m = importlib.import_module(mod)
            f = getattr(m, name)
            self.swaps.append((m, name, f, torch.compile(f, dynamic=True, mode=mode)))

    def __enter__(self) -> None:
        for m, name, _, fast in self.swaps:
            setattr(m, name, fast)

    def __exit__(self, *exc: object) -> None:
        for m, name, f, _ in self.swaps:
            setattr(m, name, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    step_args(ap, "timed")
    ap.add_argument("--warm", type=int, default=2, help="untimed steps of each kind first (compilation)")
    ap.add_argument("--mode", default=None, help="torch.compile's mode (default: its default)")
    a = ap.parse_args()

    from benchmarks.speed_grid import fill_memory
    from emllm.engine import window
    from emllm.evals.passkey import parse_length
    from emllm.evals.scratch import ScratchStores

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    window.DEVICE_STEP = True  # (the step a GPU takes, also where the probe runs on a CPU)
    model, tok, prof, cfg = random_model(a.model, a.dtype, device)
    cs = prof.chunk_size
    n_ids = prof.n_init + prof.n_local + (3 + 2 * (a.warm + a.chunks)) * cs + 2 * (a.warm + a.tokens)
    ids = torch.randint(0, cfg.vocab_size, (n_ids,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp, \
            ScratchStores(model, tok, prof, Path(tmp) / "a") as make_a, ScratchStores(model, tok, prof, Path(tmp) / "b") as make_b:
        engines = {"eager": make_a(), "compiled": make_b()}
        pos = 0
        for _ in range((prof.n_init + prof.n_local) // cs + 3):  # a real prefix: the window full, events closed
            for e in engines.values():
                e.step(ids[pos : pos + cs])
            pos += cs
        read = max(engines["eager"].n_tokens, parse_length(a.length))
        for e in engines.values():
            fill_memory(e, read - e.n_tokens, torch.Generator().manual_seed(0))  # (alike: the same seed)
        times: dict[str, list[float]] = {f"{k}_{m}": [] for k in ("chunk", "token") for m in engines}
        diff, compile_s = 0.0, 0.0
        fast = Compiled(a.mode)
        for kind, n, c in (("chunk", a.chunks, cs), ("token", a.tokens, 1)):
            for i in range(a.warm + n):
                x = ids[pos : pos + c]
                pos += c
                out = {}
                for name, e in engines.items():
                    ctx = fast if name == "compiled" else contextlib.nullcontext()
                    with ctx:
                        sync()
                        t = time.perf_counter()
                        out[name] = e.step(x, with_surprise=c > 1)[-1].float()
                        sync()
                        dt = time.perf_counter() - t
                    if i >= a.warm:
                        times[f"{kind}_{name}"].append(dt)
                    elif name == "compiled":
                        compile_s += dt
                diff = max(diff, float((out["eager"] - out["compiled"]).abs().max()))
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    print(json.dumps({"model": a.model, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                      "dtype": a.dtype, "tokens_read": read, "mode": a.mode or "default",
                      **{f"{k}_s": round(v, 4) for k, v in mean.items()},
                      "chunk_compiled_over_eager": round(mean["chunk_compiled"] / mean["chunk_eager"], 3),
                      "token_compiled_over_eager": round(mean["token_compiled"] / mean["token_eager"], 3),
                      "warm_compiled_s": round(compile_s, 1), "max_logit_diff": diff}))


if __name__ == "__main__":
    main()
