"""Surprise from a shortlist head (profile surprise_head: shortlist): the estimate against a
brute-force sum over the whole vocabulary's logits, and the engine's use of it."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from emllm.engine.stream import Engine
from emllm.math import surprise as S
from tests.conftest import tiny_profile
from tests.test_hybrid import hybrid_model


def brute_nll(z: torch.Tensor, targets: torch.Tensor, rows: list[int], tail: list[int], scale: float,
              exact_rows: set[int]) -> list[float]:
    """The estimate summed term by term in float64: the shortlist's mass plus the sample's scaled,
    the exact normaliser on the probe rows."""
    z = z.double()
    out = []
    for i in range(z.shape[0]):
        if i in exact_rows:
            lse = math.log(sum(math.exp(v) for v in z[i].tolist()))
        else:
            lse = math.log(sum(math.exp(z[i, r].item()) for r in rows) + scale * sum(math.exp(z[i, t].item()) for t in tail))
        out.append(lse - z[i, targets[i]].item())
    return out


def random_head(v: int, d: int, softcap: float | None, bias: bool, seed: int = 0) -> S.Head:
    g = torch.Generator().manual_seed(seed)
    return S.Head(torch.randn(v, d, generator=g), torch.randn(v, generator=g) if bias else None, softcap)


def test_the_tail_sample_is_the_r_th_id_outside_the_shortlist():
    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        v = 60
        short = torch.randperm(v, generator=g)[: 5 + trial].sort().values
        ids, scale = S.tail_sample(short, v, 25, seed=trial)
        rest = [i for i in range(v) if i not in set(short.tolist())]
        r = torch.randint(0, len(rest), (25,), generator=torch.Generator().manual_seed(trial))
        assert ids.tolist() == [rest[i] for i in r.tolist()]
        assert scale == len(rest) / 25
    ids, scale = S.tail_sample(torch.arange(60), 60, 25, seed=0)  # nothing left outside
    assert ids.numel() == 0 and scale == 0.0


@pytest.mark.parametrize("softcap,bias", [(None, False), (3.0, True)])
def test_the_estimate_equals_its_brute_force_sum(softcap, bias):
    v, d, n = 400, 16, 40
    head = random_head(v, d, softcap, bias)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(n + 1, d, generator=g) * 0.7  # the chunk's rows; the last predicts the next chunk
    targets = torch.randint(0, v, (n,), generator=g)
    at = S.probe_positions(n + 1, 4)
    zp = head.logits(hidden[at])
    got = S.shortlist_nll(hidden[:n], targets, head, 7, at, zp, top=5, sample=30)
    rows = S.shortlist_rows(zp, targets, 5)
    tail, scale = S.tail_sample(rows, v, 30, 7)
    assert 5 < rows.numel() < v and tail.numel() == 30
    want = brute_nll(head.logits(hidden[:n]), targets, rows.tolist(), tail.tolist(), scale,
                     {int(p) for p in at if p < n})
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-4)
    exact = S._nll(head.logits(hidden[:n]), targets)
    assert (got - exact).abs().max() > 1e-3  # (an estimate: the brute force above is what it equals)


def test_a_shortlist_of_the_whole_vocabulary_is_exact():
    head = random_head(200, 8, None, False)
    hidden = torch.randn(30, 8, generator=torch.Generator().manual_seed(3))
    targets = torch.randint(0, 200, (29,), generator=torch.Generator().manual_seed(4))
    at = S.probe_positions(30, 3)
    got = S.shortlist_nll(hidden[:29], targets, head, 0, at, head.logits(hidden[at]), top=200, sample=64)
    assert torch.allclose(got, S._nll(head.logits(hidden[:29]), targets), atol=1e-5)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_the_engine_takes_its_surprise_from_the_shortlist(arch, monkeypatch):
    """A stream that fits the window: the engine's surprise is the estimate on the plain model's
    hidden states, chunk by chunk (probes, seeds, the first token from the previous chunk's last
    logits), and its last logits are the full engine's. Gemma 2's final logits are soft-capped."""
    monkeypatch.setattr(S, "SHORTLIST_TOP", 6)
    monkeypatch.setattr(S, "SHORTLIST_SAMPLE", 40)
    model = hybrid_model(arch)
    prof = tiny_profile(n_local=128, chunk_size=40, n_init=4)
    ids = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(5))
    short, full = Engine(model, prof.replace(surprise_head="shortlist")), Engine(model, prof)
    for off in range(0, 120, 40):
        a, b = short.step(ids[off : off + 40]), full.step(ids[off : off + 40])
        assert a.shape == (1, 300) and torch.allclose(a[0], b[-1], atol=1e-5)
    assert isinstance(short._head, S.Head)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        hidden = model.model(input_ids=ids[None]).last_hidden_state[0]
        z = model(input_ids=ids[None]).logits[0]
    head = short._head
    want = [float("nan")]
    for off in range(0, 120, 40):
        if off:  # the first token of a chunk: the last logits of the one before, exactly
            want.append(S._nll(z[off - 1 : off], ids[off : off + 1]).item())
        at = S.probe_positions(40)
        rows = S.shortlist_rows(head.logits(hidden[off + at]), ids[off + 1 : off + 40], 6)
        tail, scale = S.tail_sample(rows, 300, 40, off)
        want += brute_nll(head.logits(hidden[off : off + 39]), ids[off + 1 : off + 40], rows.tolist(), tail.tolist(),
                          scale, {int(p) for p in at if p < 39})
    got = short.surprise.view()
    assert torch.isnan(got[0]) and torch.allclose(got[1:].double(), torch.tensor(want[1:], dtype=torch.float64), atol=1e-4)
    assert not torch.allclose(got[1:], full.surprise.view()[1:], atol=1e-3)  # (the estimate, not the exact)


def test_a_head_that_is_not_the_models_computes_every_logit():
    """A model whose logits are the head's transformed (here doubled after it): the check before
    the first chunk finds it, and surprise stays exact."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.lm_head.register_forward_hook(lambda m, i, o: o * 2)
    prof = tiny_profile(n_local=64, chunk_size=40)
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(6))
    short, full = Engine(model, prof.replace(surprise_head="shortlist")), Engine(model, prof)
    short.feed(ids)
    full.feed(ids)
    assert short._head is False
    torch.testing.assert_close(short.surprise.view(), full.surprise.view(), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(short.flags.view(), full.flags.view()) and short.n_events == full.n_events > 3


def test_a_store_appended_later_is_the_store_read_at_once(tmp_path, monkeypatch):
    """The shortlist's sample is seeded by the chunk's place in the stream and the head is checked
    the same way by every engine: a store that reads a second document later, with a new engine,
    is the store that read both at once, byte for byte."""
    from emllm import models
    from emllm.store import Store
    from tests.helpers import TINY_PROFILE, assert_same_state, ingest_now_and_later, store_arrays, words

    monkeypatch.setattr(S, "SHORTLIST_TOP", 64)
    monkeypatch.setattr(S, "SHORTLIST_SAMPLE", 256)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(models.resolve("smollm2").path)
    folder = tmp_path / "model"
    hybrid_model("gemma3", len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    prof = tmp_path / "p.yaml"
    prof.write_text(TINY_PROFILE.replace("chunk_size: 16", "chunk_size: 40").replace("n_local: 32", "n_local: 80")
                    + "surprise_head: shortlist\n")
    one, two = ingest_now_and_later(tmp_path, folder, prof, [("a", words(2, 300))], [("b", words(3, 250))])
    assert store_arrays(one) == store_arrays(two)
    assert_same_state(one, two)
    with Store.open(one) as st:
        assert st.info.profile.surprise_head == "shortlist" and st.info.rows.events > 10
