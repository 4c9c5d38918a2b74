"""Store formats (emllm.memory.quant): keys and values kept as float32, bfloat16, int8 or int4,
chosen when a store is created, recorded in it, decoded on read; and the compute dtype."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from emllm import models
from emllm.app import stream
from emllm.memory.quant import EQUALISER_MIN_ROWS, FORMATS, decode_keys, encode_keys, fit_equaliser, kv_format
from emllm.store import Store
from emllm.store.manifest import FORMAT_VERSION

from .helpers import QUESTION, ingest_store, load_tiny, run, run_in_process, words


def brute_quantise(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The integer formats' decode(encode(x)), one group at a time in Python: [n, H, D] float32."""
    levels = (1 << bits) - 1
    out = torch.empty_like(x)
    n, h, d = x.shape
    for i in range(n):
        for j in range(h):
            for s in range(0, d, group):
                g = x[i, j, s : s + group]
                lo = torch.tensor(float(g.min())).half().float()
                step = torch.tensor((float(g.max()) - float(lo)) / levels).half().float()
                if step == 0:
                    out[i, j, s : s + group] = lo
                    continue
                codes = torch.clamp(torch.round((g - lo) * (1.0 / step)), 0, levels)
                out[i, j, s : s + group] = codes * step + lo
    return out


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("head_dim", [64, 48, 6])  # groups of 32, of 16, of 2
def test_integer_formats_equal_a_brute_force_quantiser(name, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(7, 3, head_dim, generator=gen) * 4 + torch.randn(1, 3, head_dim, generator=gen) * 10
    x[0, 0] = 2.5  # a constant group (step 0): kept exactly
    fmt = kv_format(name, head_dim)
    assert fmt.group == {64: 32, 48: 16, 6: 2}[head_dim]
    rows = fmt.encode(x)
    assert rows.dtype == torch.uint8 and tuple(rows.shape[1:]) == fmt.row(3, head_dim)
    assert rows[0].numel() == fmt.row_bytes(3, head_dim)
    got = fmt.decode(rows, torch.float32)
    torch.testing.assert_close(got, brute_quantise(x, fmt.bits, fmt.group), atol=0, rtol=0)
    assert torch.equal(got[0, 0], x[0, 0])
    # within half a step of the value (the step and minimum rounded to float16: a little more)
    g = x.reshape(7, 3, -1, fmt.group)
    step = (g.amax(-1) - g.amin(-1)) / ((1 << fmt.bits) - 1)
    err = (got - x).abs().reshape(7, 3, -1, fmt.group).amax(-1)
    assert bool((err <= step * 0.51 + 1e-2).all())


def keys_with_channel_offsets(n: int, seed: int) -> torch.Tensor:
    """Keys as models make them [n, 3, 64]: every channel its own offset and range, a few large."""
    gen = torch.Generator().manual_seed(seed)
    offset = torch.randn(1, 3, 64, generator=gen) * 3
    scale = torch.rand(1, 3, 64, generator=gen) * 0.9 + 0.1
    scale[..., :4] = 8.0  # outlier channels, in every token
    return torch.randn(n, 3, 64, generator=gen) * scale + offset


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_equalised_keys_are_the_format_of_keys_centred_and_scaled_per_channel(name):
    """Encoding keys through an equaliser is the brute-force quantiser of (k - centre) / scale,
    undone after; fitted on the first rows, it makes later keys' error smaller than per token
    alone (per channel offsets and outliers, as keys have them)."""
    fmt = kv_format(name, 64)
    first, later = keys_with_channel_offsets(512, 1), keys_with_channel_offsets(2048, 1)[512:]
    eq = fit_equaliser(first)
    centre, spread = first.mean(0), (first - first.mean(0)).abs().amax(0)
    torch.testing.assert_close(eq[0], centre, atol=0, rtol=0)
    torch.testing.assert_close(eq[1], torch.maximum(spread, spread.amax(-1, keepdim=True) * 0.1), atol=0, rtol=0)
    got = decode_keys(fmt, encode_keys(fmt, later, eq), eq, torch.float32)
    brute = brute_quantise((later - eq[0]) / eq[1], fmt.bits, fmt.group) * eq[1] + eq[0]
    torch.testing.assert_close(got, brute, atol=0, rtol=0)
    plain = fmt.decode(fmt.encode(later), torch.float32)
    err = lambda y: float((y - later).norm() / later.norm())  # noqa: E731
    assert err(got) < 0.5 * err(plain), (err(got), err(plain))
    # no equaliser: the format alone
    assert torch.equal(decode_keys(fmt, encode_keys(fmt, later, None), None, torch.float32), plain)


def test_an_equaliser_of_too_few_or_constant_rows_is_the_identity():
    few = keys_with_channel_offsets(EQUALISER_MIN_ROWS - 1, 2)
    flat = torch.ones(40, 3, 64)
    flat[:, 1] = torch.randn(40, 64)  # one head moves: only it is equalised
    for eq, moving in ((fit_equaliser(few), []), (fit_equaliser(flat), [1])):
        for h in range(3):
            if h not in moving:
                assert torch.equal(eq[0, h], torch.zeros(64)) and torch.equal(eq[1, h], torch.ones(64))
    assert bool((fit_equaliser(flat)[1, 1] > 0).all())
    # a quiet channel's scale is at least a tenth of its head's widest: later keys stay bounded
    x = keys_with_channel_offsets(64, 3)
    x[:, :, 10] = 5.0
    eq = fit_equaliser(x)
    assert bool((eq[1, :, 10] >= 0.1 * eq[1].amax(-1)).all())


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_float_formats_are_casts(name):
    x = torch.randn(5, 2, 8)
    fmt = kv_format(name, 8)
    assert torch.equal(fmt.decode(fmt.encode(x), torch.float32), x.to(fmt.row_dtype).float())
    assert fmt.reprs == fmt


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="int3"):
        kv_format("int3", 64)


def test_cli_offers_the_formats_the_store_holds():
    from emllm_cli.options import KV_FORMATS

    assert KV_FORMATS[0] == "auto" and set(KV_FORMATS[1:]) <= set(FORMATS)


@pytest.mark.parametrize("name", ["bfloat16", "int8", "int4"])
def test_a_store_keeps_its_format_and_a_reader_decodes_as_the_writer_stored(tiny, tmp_path, name):
    """The files hold the format's rows; what a reader gathers from them equals the engine's keys
    and values through encode/decode; a reader's own events (closed in RAM while asking) are
    decoded as a writer would have stored them, and a writer continuing gives the same answer."""
    folder, prof, _, _ = tiny
    store = tmp_path / "s"
    ingest_store(store, folder, prof, [("doc", words(7, 700))], kv_format=name)
    model, tok = load_tiny(folder)
    m = json.loads((store / "manifest.json").read_text())
    assert m["kv_format"] == name and m["version"] == FORMAT_VERSION and m["key_equaliser"] == (name != "bfloat16")
    fmt = kv_format(name, m["geometry"]["head_dim"])
    g = m["geometry"]
    assert m["rows"]["kv_tokens"] == m["rows"]["tokens"]  # every token's, the window's too
    for x in "kv":
        size = os.path.getsize(store / "layers" / f"00.{x}")
        assert size == m["rows"]["kv_tokens"] * fmt.row_bytes(g["kv_heads"], g["head_dim"])
    assert fmt.reprs == (fmt if name == "bfloat16" else kv_format("int8", g["head_dim"]))
    assert m["repr_heads"] == g["kv_heads"] < g["q_heads"]
    assert os.path.getsize(store / "layers/00.r") == m["rows"]["events"] * fmt.reprs.row_bytes(g["kv_heads"], g["head_dim"])

    with Store.open(store) as st:
        assert st.kv_format == fmt
        ev = stream.open_engine(st, model).windows[0].events
        k, v = ev.gather(torch.arange(len(ev)))
        eq = None
        if name != "bfloat16":  # each layer's key equaliser, fitted on its first rows, in its own file
            eq = torch.from_numpy(np.fromfile(store / "layers/00.e", dtype="<f4")).reshape(2, g["kv_heads"], g["head_dim"])
            assert bool((eq[1] > 0).all()) and not torch.equal(eq[1], torch.ones_like(eq[1]))
        unequalise = (lambda t: t) if eq is None else (lambda t: t * eq[1] + eq[0])  # noqa: E731
        equalise = (lambda t: t) if eq is None else (lambda t: (t - eq[0]) / eq[1])  # noqa: E731
        raw_k = unequalise(fmt.decode(st.layer_files[0][0].read(), torch.float32))  # from the stream's first token
        n_init = m["profile"]["n_init"]
        assert torch.equal(k, raw_k[n_init : n_init + m["rows"]["event_tokens"]].transpose(0, 1))
        # a reader's tokens, kept in RAM: decode(encode(x)), as from a writer's files, and handed
        # back so to the engine's window
        keys, values = torch.randn(2, g["kv_heads"], 20, g["head_dim"])
        mark = ev.mark()
        k2, v2 = ev.add_tokens(keys, values)
        want = lambda t: fmt.decode(fmt.encode(t.transpose(0, 1)), torch.float32).transpose(0, 1)  # noqa: E731
        want_k = unequalise(fmt.decode(fmt.encode(equalise(keys.transpose(0, 1))), torch.float32)).transpose(0, 1)
        assert torch.equal(k2, want_k) and torch.equal(v2, want(values))
        k3, v3 = ev._read(torch.arange(ev.n_disk, ev.n_disk + 20))
        assert torch.equal(k3.transpose(0, 1), k2) and torch.equal(v3.transpose(0, 1), v2)
        ev.truncate(mark)
        assert ev.n_tokens == ev.n_disk

    from emllm.app.ask import Session
    with Store.open(store) as st:
        answer = list(Session(st, model, tok).answer(QUESTION, 12))
    with Store.open(store) as st:
        assert list(Session(st, model, tok).answer(QUESTION, 12)) == answer  # deterministic


@pytest.mark.slow
def test_format_through_the_executable(tiny, tmp_path):
    folder, prof, _, _ = tiny
    doc = tmp_path / "doc.txt"
    doc.write_text(words(8, 400))
    base = ["-m", str(folder), "--profile", str(prof)]
    # the executable once; then in this process (each executable run costs ~5 s of imports)
    for name, fmt, how in (("q", ["--format", "int8"], run), ("f", [], run_in_process)):
        r = how("ingest", str(doc), *base, "--store", name, *fmt, home=tmp_path)
        assert r.returncode == 0, r.stderr
    q, f = (json.loads(run("show", n, "--json", home=tmp_path).stdout) for n in "qf")
    assert (q["format"], q["dtype"], f["format"], f["dtype"]) == ("int8", "float32", "float32", "float32")
    # keys and values per event token: head size 16, one group of 16 channels, a byte each plus
    # four of scales, against four bytes a value
    # (the integer store's key equalisers, a fixed [2, H, D] float32 per layer, counted apart)
    eq_bytes = sum(p.stat().st_size for p in (tmp_path / "stores" / "q" / "layers").glob("*.e"))
    g = json.loads((tmp_path / "stores" / "q" / "manifest.json").read_text())["geometry"]
    assert eq_bytes == g["layers"] * 2 * g["kv_heads"] * g["head_dim"] * 4 and q["key_equaliser"] and not f["key_equaliser"]
    per_token = lambda s, extra=0: (s["bytes"]["keys+values"] - extra) / s["event_tokens"]  # noqa: E731
    assert per_token(q, eq_bytes) / per_token(f) == pytest.approx((16 + 4) / (16 * 4))
    r = run_in_process("ingest", str(doc), "--store", "q", "--append", "--format", "int4", home=tmp_path)
    assert r.returncode == 1 and "keeps keys and values in int8" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run("ingest", str(doc), "--store", "z", "--format", "int3", home=tmp_path)
    assert r.returncode == 2 and "int3" in r.stderr
    r = run_in_process("ask", QUESTION, "--store", "q", "-n", "4", home=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run("show", "q", home=tmp_path)
    assert r.returncode == 0 and "keys and values in int8 (keys equalised), computed in float32" in r.stdout


# -- the compute dtype -------------------------------------------------------------------------
def test_auto_dtype_follows_the_cpu_flags(monkeypatch, tmp_path):
    import builtins

    real_open = builtins.open

    def fake(flags):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx2 {flags}\n")
        monkeypatch.setattr(builtins, "open", lambda p, *a, **k: real_open(cpuinfo if p == "/proc/cpuinfo" else p, *a, **k))

    fake("avx512f avx512_bf16")
    assert models.compute_dtype("auto") == torch.bfloat16
    fake("amx_tile amx_bf16")
    assert models.compute_dtype("auto") == torch.bfloat16
    fake("avx512f avx512bw")  # AVX-512 without BF16: oneDNN would emulate it, slower than float32
    assert models.compute_dtype("auto") == torch.float32
    assert models.compute_dtype("bfloat16") == torch.bfloat16 and models.compute_dtype("float32") == torch.float32
    with pytest.raises(ValueError, match="float64"):
        models.compute_dtype("float64")


@pytest.mark.slow
def test_a_store_opens_in_its_dtype(tiny, tmp_path):
    """A store made in bfloat16 is continued in bfloat16 whatever the default; --dtype float32 on it
    is one clear line; EMLLM_DTYPE with a bad value too."""
    folder, prof, _, _ = tiny
    doc = tmp_path / "doc.txt"
    doc.write_text(words(9, 300))
    base = ["-m", str(folder), "--profile", str(prof)]
    r = run("ingest", str(doc), *base, "--store", "b", "--dtype", "bfloat16", home=tmp_path)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "stores" / "b" / "manifest.json").read_text())
    assert m["geometry"]["dtype"] == "bfloat16" and m["kv_format"] == "bfloat16"
    r = run("ask", QUESTION, "--store", "b", "-n", "3", home=tmp_path)  # EMLLM_DTYPE=float32 in the tests
    assert r.returncode == 0, r.stderr
    r = run("ingest", str(doc), "--store", "b", "--append", "--dtype", "float32", home=tmp_path)
    assert r.returncode == 1 and "computes in bfloat16" in r.stderr
    env_bad = run("ingest", str(doc), *base, "--store", "c", home=tmp_path, env={"EMLLM_DTYPE": "fp8"})
    assert env_bad.returncode == 1 and "EMLLM_DTYPE" in env_bad.stderr and "Traceback" not in env_bad.stderr
