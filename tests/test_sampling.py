"""Choosing tokens: greedy by default and deterministic; sampling through transformers' logits
processors, reproducible by seed; stop strings end the text before them."""

from __future__ import annotations

import pytest
import torch

from emllm.app.ask import Session
from emllm.engine.sampling import Sampling
from emllm.store import Store

from .helpers import QUESTION, ingest_store, load_tiny, run, run_in_process, words


def test_the_processors_apply_as_transformers_defines_them():
    logits = torch.tensor([0.0, 5.0, 4.9, 1.0, -2.0])
    assert Sampling().chooser()([], logits) == 1  # greedy
    # the repetition penalty divides a positive score of a token already seen: 5.0 / 2 < 4.9
    assert Sampling(repetition_penalty=2.0).chooser(context=[1])([], logits) == 2
    assert Sampling(repetition_penalty=2.0).chooser()([1], logits) == 2  # the answer's own tokens count too
    # top-k 1 leaves one token: sampling is then certain whatever the seed
    assert {Sampling(temperature=1.5, top_k=1, seed=s).chooser()([], logits) for s in range(20)} == {1}
    # top-p: 1 and 2 hold ~95% of the mass at temperature 1: nothing else is ever drawn
    drawn = {Sampling(temperature=1.0, top_p=0.9, seed=s).chooser()([], logits) for s in range(200)}
    assert drawn == {1, 2}
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)


def test_openai_penalties_subtract_from_the_logits_of_the_answers_tokens():
    logits = torch.tensor([0.0, 5.0, 4.5, 3.2, -2.0])
    # presence: 0.6 off token 1 once it is in the answer, however often: 4.4 < 4.5
    assert Sampling(presence_penalty=0.6).chooser()([1, 1, 1], logits) == 2
    assert Sampling(presence_penalty=0.6).chooser()([], logits) == 1
    # frequency: 0.3 per time: once 4.7 (still first), twice 4.4 (token 2 first)
    assert Sampling(frequency_penalty=0.3).chooser()([1], logits) == 1
    assert Sampling(frequency_penalty=0.3).chooser()([1, 1], logits) == 2
    # the question's tokens are not the answer's: no penalty for them (unlike repetition_penalty)
    assert Sampling(frequency_penalty=2.0).chooser(context=[1, 1])([], logits) == 1
    # negative: encourages; both add up: 3.2 + 2 * 0.5 + 0.4 = 4.6 < 5.0, 3.2 + 3 * 0.5 + 0.4 = 5.1
    assert Sampling(presence_penalty=-0.4, frequency_penalty=-0.5).chooser()([3, 3], logits) == 1
    assert Sampling(presence_penalty=-0.4, frequency_penalty=-0.5).chooser()([3, 3, 3], logits) == 3
    with pytest.raises(ValueError, match=r"frequency_penalty must lie in \[-2, 2\], got 2.5"):
        Sampling(frequency_penalty=2.5)


def test_logit_bias_adds_to_the_logits_before_anything_else():
    logits = torch.tensor([0.0, 5.0, 4.5, 3.2, -2.0])
    assert Sampling(logit_bias={1: -0.6}).chooser()([], logits) == 2  # 4.4 < 4.5
    assert Sampling(logit_bias={4: 100}).chooser()([], logits) == 4
    assert Sampling(logit_bias={1: -100, 2: -100}).chooser()([], logits) == 3
    # before the penalties: 5.0 - 0.3 (bias) - 0.3 (frequency, once) = 4.4 < 4.5
    assert Sampling(logit_bias={1: -0.3}, frequency_penalty=0.3).chooser()([1], logits) == 2
    assert Sampling(logit_bias={1: -0.3}).chooser()([1], logits) == 1
    # sampled: a banned token is never drawn
    assert 1 not in {Sampling(temperature=1.0, seed=s, logit_bias={1: -100}).chooser()([], logits) for s in range(100)}
    assert Sampling(logit_bias={3: 1.5}) == Sampling(logit_bias=((3, 1.5),))  # (a dict is taken, kept as pairs)
    with pytest.raises(ValueError, match=r"logit_bias: a bias must lie in \[-100, 100\], got 101 for token 2"):
        Sampling(logit_bias={2: 101})
    with pytest.raises(ValueError, match="logit_bias: a token id must be an integer >= 0"):
        Sampling(logit_bias={-1: 1})

    class M:
        class config:
            vocab_size = 5

    with pytest.raises(ValueError, match=r"token id 5 is outside the model's vocabulary \(0..4\)"):
        Sampling.from_model(M(), logit_bias={5: 1.0})


def test_the_model_generation_config_gives_the_defaults():
    class Gen:
        do_sample, temperature, top_p, top_k, repetition_penalty = True, 0.6, 0.95, 40, 1.1

    class M:
        generation_config = Gen()

    s = Sampling.from_model(M(), top_k=None, seed=3)
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.seed) == (0.6, 0.95, 40, 1.1, 3)
    Gen.do_sample = False
    assert Sampling.from_model(M(), temperature=None).greedy


def test_answers_are_reproducible_and_stop_strings_end_them(tiny, tmp_path):
    folder, prof, _, _ = tiny
    ingest_store(tmp_path / "s", folder, prof, [("doc", words(4, 300))])
    model, tok = load_tiny(folder)

    def answer(**kw) -> str:
        with Store.open(tmp_path / "s") as st:
            stop = kw.pop("stop", None)
            return "".join(Session(st, model, tok).answer_text(QUESTION, 24, Sampling(**kw) if kw else None, stop))

    greedy = answer()
    assert answer() == greedy and answer(temperature=0.0) == greedy
    with Store.open(tmp_path / "s") as st:  # greedy is what the engine's argmax gives
        ids = list(Session(st, model, tok).answer(QUESTION, 24))
    assert greedy == tok.decode(ids, skip_special_tokens=True)
    a, b = answer(temperature=1.0, seed=7), answer(temperature=1.0, seed=7)
    assert a == b and any(answer(temperature=1.0, seed=s) != a for s in range(8, 12))
    cut = greedy[len(greedy) // 2 : len(greedy) // 2 + 3]
    assert cut and answer(stop=[cut]) == greedy[: greedy.index(cut)]


def test_ask_takes_the_sampling_options(tiny, tmp_path):
    folder, prof, _, _ = tiny
    ingest_store(tmp_path / "stores" / "s", folder, prof, [("doc", words(4, 300))])
    args = ("ask", QUESTION, "-n", "8", "--json", "--temperature", "1.0", "--top-k", "50", "--seed", "3")
    one, two = run_in_process(*args, home=tmp_path), run_in_process(*args, home=tmp_path)  # (in this process: ~5 s of imports each saved)
    assert one.returncode == 0, one.stderr
    import json

    assert json.loads(one.stdout)["answer"] == json.loads(two.stdout)["answer"]
    r = run("ask", QUESTION, "--top-p", "2", home=tmp_path)
    assert r.returncode == 2 and "--top-p" in r.stderr
    r = run_in_process("ask", QUESTION, "--store", "s", "--temperature", "1", "--seed", str(2**70), home=tmp_path)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["emllm: error: seed must be an integer in [0, 2**64), got " + str(2**70)], r.stderr


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64, 2**70, 10**40])
def test_seeds_the_sampler_cannot_take_are_refused(seed):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
        Sampling(temperature=1.0, seed=seed)
    assert Sampling(temperature=1.0, seed=2**64 - 1).chooser()([], torch.tensor([0.0, 1.0])) in (0, 1)
