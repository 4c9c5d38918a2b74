"""Choosing the next token: greedy, or sampled through transformers' logits processors.

    opts = Sampling.from_model(model, temperature=0.7, top_p=0.9, seed=1)   # unset: the model's generation config
    engine.generate_iter(128, stop_ids, choose=opts.chooser())

Greedy (temperature 0, or `Sampling()`) is deterministic and is what the passkey and the
benchmarks use. Sampling is deterministic too for a given seed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor

Chooser = Callable[[list[int], Tensor], int]  # (ids chosen so far in this answer, logits [V]) -> id


SEED_LIMIT = 2**64  # what torch's generators take


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    repetition_penalty: float = 1.0  # over the answer's tokens and the question's (`context`)
    seed: int | None = None  # None: a fresh one per answer
    # OpenAI's, over the answer's tokens: subtracted from the logit of each token it holds, once
    # (presence) and once per time it holds it (frequency)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's: (token id, bias) pairs added to those tokens' logits before anything else (a
    # dict is taken); -100 or 100 bans a token or all but forces it
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        for t, b in self.logit_bias:
            if not (isinstance(t, int) and t >= 0):
                raise ValueError(f"logit_bias: a token id must be an integer >= 0, got {t!r}")
            if not -100 <= b <= 100:  # (OpenAI's bounds)
                raise ValueError(f"logit_bias: a bias must lie in [-100, 100], got {b} for token {t}")
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (self.repetition_penalty > 0 and self.repetition_penalty < float("inf")):
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:  # (OpenAI's bounds)
                raise ValueError(f"{name} must lie in [-2, 2], got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_model(cls, model: Any, **given: Any) -> "Sampling":
        """The model's generation config (do_sample, temperature, top_p, top_k, repetition_penalty),
        with the values given (not None) on top. A config that does not sample is greedy."""
        gen = getattr(model, "generation_config", None)
        base = cls()
        if gen is not None and getattr(gen, "do_sample", False):
            base = cls(temperature=float(gen.temperature or 1.0), top_p=float(gen.top_p or 1.0),
                       top_k=int(gen.top_k or 0))
        if gen is not None and getattr(gen, "repetition_penalty", None):
            base = replace(base, repetition_penalty=float(gen.repetition_penalty))
        opts = replace(base, **{k: v for k, v in given.items() if v is not None})
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        outside = [t for t, _ in opts.logit_bias if vocab is not None and t >= vocab]
        if outside:
            raise ValueError(f"logit_bias: token id {outside[0]} is outside the model's vocabulary (0..{vocab - 1})")
        return opts

    def chooser(self, context: list[int] | None = None) -> Chooser:
        """A function choosing each next token. context: token ids that the repetition penalty
        also counts (the question), besides the answer's own."""
        from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                  TopKLogitsWarper, TopPLogitsWarper)

        procs = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if not self.greedy:
            if self.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                procs.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                procs.append(TopPLogitsWarper(self.top_p))
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,))))
        prefix = list(context or [])
        penalised = self.presence_penalty != 0 or self.frequency_penalty != 0
        bias_ids = torch.tensor([t for t, _ in self.logit_bias], dtype=torch.long)  # [b]
        bias = torch.tensor([b for _, b in self.logit_bias], dtype=torch.float32)  # [b]

        def choose(answer: list[int], logits: Tensor) -> int:
            # on the CPU, whatever device computed the logits: the generator and the ids are the
            # CPU's, and a seed then picks the same tokens on every device (a GPU's logits: one
            # row of V floats copied per token)
            scores = logits.float().reshape(1, -1).cpu()  # [1, V]
            if bias.numel():
                scores = scores.index_add(1, bias_ids, bias[None])
            if penalised and answer:
                counts = torch.bincount(torch.tensor(answer), minlength=scores.shape[1])[: scores.shape[1]]  # [V]
                scores = scores - (self.frequency_penalty * counts + self.presence_penalty * (counts > 0))
            if len(procs):
                ids = torch.tensor([prefix + answer], dtype=torch.long)  # [1, n]
                scores = procs(ids, scores.clone())
            if self.greedy:
                return int(scores.argmax())
            probs = torch.softmax(scores, dim=-1)[0]  # [V]
            return int(torch.multinomial(probs, 1, generator=gen))

        return choose


def greedy(_answer: list[int], logits: Tensor) -> int:
    return int(logits.argmax())


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log probability under the model's own distribution (its logits' log
    softmax: before temperature, top-p or penalties, as vLLM and llama.cpp report it), and the
    `top` likeliest tokens there, the likeliest first. (None for a prompt's first token where
    nothing precedes it.)"""
    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def recording(choose: Chooser, top: int, out: list[TokenLogprob]) -> Chooser:
    """`choose`, appending each chosen token's TokenLogprob (with `top` alternatives) to `out`."""
    def chosen(answer: list[int], logits: Tensor) -> int:
        t = choose(answer, logits)
        out.extend(token_logprobs(logits.reshape(1, -1), torch.tensor([t]), top))
        return t

    return chosen


def token_logprobs(logits: Tensor, ids: Tensor, top: int) -> list[TokenLogprob]:
    """Each of `ids` [n] under the logits that predict it [n, V] (row i predicts ids[i]), with
    its `top` likeliest alternatives: a prompt's tokens, scored as `recording` scores an answer's."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    own = lp.gather(1, ids.reshape(-1, 1).to(lp.device))[:, 0].tolist()  # [n]
    if not top:
        return [TokenLogprob(int(t), v) for t, v in zip(ids.tolist(), own)]
    best = lp.topk(top, dim=-1)  # [n, top]
    return [TokenLogprob(int(t), v, tuple(zip(i, b)))
            for t, v, i, b in zip(ids.tolist(), own, best.indices.tolist(), best.values.tolist())]


__all__ = ["Sampling", "Chooser", "greedy", "TokenLogprob", "recording", "token_logprobs"]
