"""What several test files share: the executable, tiny stores, reference implementations, data.

Fixtures live in conftest.py; no test file imports another.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from emllm.app import ingest as ing

from emllm.app import stream
from emllm.config import load_profile_file

H_Q, H_KV, D = 9, 3, 64  # SmolLM2-135M's heads and head size (model_like)

EMLLM = shutil.which("emllm", path=str(Path(sys.executable).parent)) or "emllm"


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    """The variables a test's `emllm` runs with: its own home, this machine's models (never a
    download), offline; `extra` added. Without os.environ (`run_in_process` sets only these)."""
    from emllm.home import models_dir

    return {"EMLLM_HOME": str(home), "EMLLM_MODELS": str(models_dir()), "HF_HUB_OFFLINE": "1",
            "EMLLM_MODEL": os.environ.get("EMLLM_MODEL", ""), **extra}


def run(*args: str, home: Path, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **cli_env(home, **(env or {}))}
    return subprocess.run([EMLLM, *args], capture_output=True, text=True, env=env, timeout=timeout)


TOL = 1e-4  # emllm against the plain model in float32, where the whole stream fits the window


@torch.no_grad()
def vanilla_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The plain model's logits [n, V] float32 over ids [n] (eager attention), on the ids' device."""
    model.set_attn_implementation("eager")
    return model(ids[None]).logits[0].float()


def engine_logits(model, profile, ids, split: list[int]) -> torch.Tensor:
    """Feed ids in pieces of the given sizes, each one forward; concatenated logits."""
    from emllm.engine.stream import Engine

    eng = Engine(model, profile)
    out, off = [], 0
    for n in split:
        out.append(eng.step(ids[off : off + n]))
        off += n
    assert off == ids.numel()
    return torch.cat(out).float()


# For a command whose store is compared bit for bit with one this process computes (on the CPU):
# the executable computes on the CPU too where a GPU is (two devices' float sums differ in their
# last bits; a GPU run of the suite found two tests comparing across devices).
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def run_in_process(*args: str, home: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`run`, in this process: the executable's entry point (`emllm_cli.main.cli`) with these
    arguments, its exit code, stdout and stderr. Saves the ~3 s start-up of a new interpreter
    (torch and transformers imported again) where a test runs many commands; tests of the
    executable itself use `run`."""
    import contextlib
    import io

    from emllm_cli.main import cli

    env = cli_env(home, **(env or {}))
    saved_env = {k: os.environ.get(k) for k in env}
    saved_argv = sys.argv
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        os.environ.update(env)
        sys.argv = ["emllm", *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved_argv
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["emllm", *args], code, out.getvalue(), err.getvalue())


TINY_PROFILE = """\
description: tiny test profile
chunk_size: 16
n_init: 4
n_local: 32
n_mem: 32
repr_topk: 2
min_block: 2
max_block: 8
segmentation: S
"""


QUESTION = "What is the pass key?"


def words(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = "the grass is green sky blue sun yellow key door river stone night bread".split()
    return " ".join(rng.choice(vocab) for _ in range(words)) + "."


def load_tiny(folder: Path):
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    m.eval()
    return m, AutoTokenizer.from_pretrained(folder)


def ingest_store(path: Path, folder: Path, prof: Path, docs: list[tuple[str, str]], commit_every: int = 2,
                 kv_format: str | None = None, model=None) -> None:
    """`emllm ingest`'s loop into a new store; `model`: one already loaded (on a device, split),
    else the tiny model of `folder` on the CPU."""
    loaded, tok = load_tiny(folder)
    model = loaded if model is None else model
    with stream.create_store(path, str(folder), model, tok, load_profile_file(prof), kv_format=kv_format) as st:
        engine = stream.open_engine(st, model)
        ing.add_documents(st, tok, docs)
        ing.run_job(st, engine, commit_every)


def interrupted_ingest(path: Path, folder: Path, prof: Path, docs: list) -> None:
    """A store whose first ingest of `docs` stopped after its first commit (as a kill -9 would
    leave it), written by the tiny model of `folder`."""
    import pytest

    model, tok = load_tiny(folder)

    class Stop(Exception):
        pass

    def stop(p: ing.Progress) -> None:
        if p.done >= 32:
            raise Stop

    with stream.create_store(path, str(folder), model, tok, load_profile_file(prof)) as st:
        eng = stream.open_engine(st, model)
        ing.add_documents(st, tok, docs)
        with pytest.raises(Stop):
            ing.run_job(st, eng, commit_every=1, progress=stop)


def named_context(stream_ids: list[int], n_init: int, passages: list[tuple[int, int]],
                  named: list[tuple[int, int, list[int]]]) -> tuple[list[int], int]:
    """A re-read's context by brute force: the initial tokens, then each passage, after the line
    naming the document it starts in (strictly after its start) unless it goes on from the
    passage before. (context, lines read)."""
    ids, end, lines = list(stream_ids[:n_init]), n_init, 0
    for s, e in passages:
        doc = [d for d in named if d[0] < s < d[1]]
        if doc and s != end:
            ids += doc[0][2]
            lines += 1
        ids += stream_ids[s:e]
        end = e
    return ids, lines


def ingest_now_and_later(root: Path, folder: Path, prof: Path, first: list[tuple[str, str]],
                         later: list[tuple[str, str]]) -> tuple[Path, Path]:
    """Two stores of the same documents: `root/one` reads them all in one ingest, `root/two` reads
    `first`, then `later` with a new engine over the reopened store (an append). (one, two)."""
    from emllm.store import Store

    ingest_store(root / "one", folder, prof, first + later)
    ingest_store(root / "two", folder, prof, first)
    model, tok = load_tiny(folder)
    with Store.open(root / "two", writable=True) as st:
        engine = stream.open_engine(st, model)
        ing.add_documents(st, tok, later)
        ing.run_job(st, engine, 2)
    return root / "one", root / "two"


def answers_of(store: Path, models: list, tok, max_new_tokens: int) -> list[list[int]]:
    """Each model's greedy answer to QUESTION from the store, opened anew for each."""
    from emllm.app.ask import Session
    from emllm.store import Store

    out = []
    for m in models:
        with Store.open(store) as st:
            out.append(list(Session(st, m, tok).answer(QUESTION, max_new_tokens)))
    return out


def store_files(store: Path) -> dict[str, bytes]:
    """Every file's bytes, the lock file aside (flock needs it; its content is empty)."""
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file() and p.name != "lock"}


def store_arrays(store: Path) -> dict[str, bytes]:
    """The arrays, the sketch's included."""
    return {k: v for k, v in store_files(store).items()
            if k.endswith((".i32", ".f32", ".u8", ".k", ".v", ".e", ".r", ".p", ".n", ".o")) and not k.startswith("job")
            or k.startswith("sketch") and k.endswith(".safetensors")}


def store_state(store: Path) -> dict[str, torch.Tensor]:
    """The state that continues the store's stream: its state file, and (from version 5) each
    layer's initial tokens', remainder's and window's keys and values, read from the layer files."""
    from emllm.store import Store

    with Store.open(store) as st:
        return st.load_state()


def assert_same_state(a: Path, b: Path) -> None:
    sa, sb = store_state(a), store_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def brute_select(scores: list[float], lengths: list[int], budget: int) -> list[int]:
    order = sorted(range(len(scores)), key=lambda e: (-scores[e], e))
    out, used = [], 0
    for e in order:
        if used + lengths[e] > budget:
            break
        out.append(e)
        used += lengths[e]
    return sorted(out)


def brute_contiguity(queue, selected, lengths, n, budget):
    q = list(queue)
    for c in sorted({e + o for e in selected for o in range(-n, n + 1) if o}):
        if 0 <= c < len(lengths) and c not in selected and c not in q:
            q.append(c)
    while q and sum(lengths[e] for e in q) > budget:
        q.pop(0)
    return q


def model_like(n_events: int, n_queries: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Representative keys [E, 9, 64] and queries [Q, 9, 64] shaped like SmolLM2's, and lengths [E].

    Measured on SmolLM2-135M (pre-RoPE keys of 8k tokens of code and prose, layers 0..29, events of
    32 tokens, mean of 4 keys): every event shares one large mean direction (its norm ~3x the RMS
    deviation), the deviations are low-rank (half the variance in ~6 directions, 90% in ~45 of
    the 192 key dims), event norms vary little (~7%), and queries too have a mean (~2x their
    deviation) nearly orthogonal to the keys' (cosine 0.1). The generator copies that:
    - per KV head (3 x 64 = 192 dims): key = mean + U diag(s) z + noise, with U a random
      orthonormal 192 x 64 basis, s_i^2 ~ 1/i (power-law spectrum), noise 10% of the variance;
    - z = centre of the event's topic + its own variation: topics are runs of ~50 consecutive
      events (a document is read in sections), 400 topic centres;
    - the 3 query heads of a KV head (GQA) get that head's key plus a small per-head part (their
      top-4 tokens differ); each event is then scaled by 1 + 0.05 N(0, 1) (norm spread);
    - queries: their own mean (cosine 0.1 with the keys'), plus U9 diag(s) z for a topic's z,
      plus noise; so a query is near one topic, as a query about a passage is.
    Lengths are 8..128 tokens, mean ~32 (min_block and max_block of the profiles).
    """
    g = torch.Generator().manual_seed(seed)
    dkv, r = H_KV * D, 64
    basis = torch.linalg.qr(torch.randn(dkv, r, generator=g)).Q  # [192, r]
    s = torch.arange(1, r + 1).float() ** -0.5  # variance ~ 1/i
    s = s / s.norm()  # RMS deviation of the low-rank part ~1
    n_topics = 400
    centres = torch.randn(n_topics, r, generator=g)
    topic = (torch.arange(n_events) // 50) % n_topics
    z = 0.8 * centres[topic] + 0.6 * torch.randn(n_events, r, generator=g)
    mean = torch.randn(dkv, generator=g)
    mean = 3.0 * mean / mean.norm()
    keys = mean + (z * s) @ basis.T + (0.1 / math.sqrt(dkv)) * torch.randn(n_events, dkv, generator=g)
    reprs = keys.reshape(n_events, H_KV, 1, D).expand(n_events, H_KV, H_Q // H_KV, D).reshape(n_events, H_Q, D)
    reprs = reprs + (0.3 / math.sqrt(H_Q * D)) * torch.randn(n_events, H_Q, D, generator=g)
    reprs = reprs * (1 + 0.05 * torch.randn(n_events, 1, 1, generator=g))  # norms vary by ~6%, as measured

    qz = 0.8 * centres[torch.randint(0, n_topics, (n_queries,), generator=g)] + 0.6 * torch.randn(n_queries, r, generator=g)
    basis9 = basis.reshape(H_KV, 1, D, r).expand(H_KV, H_Q // H_KV, D, r).reshape(H_Q * D, r)
    q_mean = torch.randn(H_Q * D, generator=g)
    key_mean9 = mean.reshape(H_KV, 1, D).expand(H_KV, H_Q // H_KV, D).reshape(-1)
    q_mean = q_mean - (q_mean @ key_mean9) / key_mean9.norm() ** 2 * key_mean9  # orthogonal, then
    q_mean = q_mean / q_mean.norm() * math.sqrt(1 - 0.1**2) + 0.1 * key_mean9 / key_mean9.norm()  # cos 0.1
    q_dev = (qz * s) @ basis9.T + (0.3 / math.sqrt(H_Q * D)) * torch.randn(n_queries, H_Q * D, generator=g)
    queries = 2.0 * q_dev.pow(2).sum(1).mean().sqrt() * q_mean + q_dev
    lengths = torch.randint(8, 129, (n_events,), generator=g)
    lengths = torch.where(torch.rand(n_events, generator=g) < 0.8, (lengths // 4).clamp_min(8), lengths)  # mean ~30
    return reprs.contiguous(), queries.reshape(n_queries, H_Q, D), lengths


def reseal(store: Path, change=None) -> None:
    """Recompute every digest of a store (and its manifest's checksum) after `change(manifest)`,
    as someone crafting a store would: anyone can. What a store's digests cannot refuse, its
    readers must."""
    import hashlib

    from emllm.store.manifest import checksum
    from emllm.store.store import Store

    m = json.loads((store / "manifest.json").read_text())
    if change is not None:
        change(m)
    m["digests"]["records"] = 0
    st = Store(store, m, True, None)
    try:
        st.digests.sealed = {}  # hash every block again
        m["digests"] = st.digests.seal(st.all_files())
    finally:
        st.close()
    for part in ("state", "sketch"):
        if m.get(part):
            m[part]["sha256"] = hashlib.sha256((store / m[part]["file"]).read_bytes()).hexdigest()
    m["checksum"] = checksum(m)
    (store / "manifest.json").write_text(json.dumps(m))


def before_digests(store: Path) -> None:
    """Make a store one written before digests (version 7): nothing of them left."""
    from emllm.store.manifest import checksum

    m = json.loads((store / "manifest.json").read_text())
    m["version"] = 7
    m.pop("digests")
    for part in ("state", "sketch"):
        if m.get(part):
            m[part].pop("sha256")
    m["checksum"] = checksum(m)
    (store / "manifest.json").write_text(json.dumps(m))
    (store / "digests.bin").unlink()
