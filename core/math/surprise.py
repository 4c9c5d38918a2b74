"""Surprise per token and the moving boundary threshold (paper eq. 1, spec §2)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def token_surprise(logits: Tensor, ids: Tensor, prev_logits: Tensor | None) -> Tensor:
    """-log P(x_t | x_<t) for each token of a chunk, float32.

    logits: [c, V] of the chunk's forward pass; ids: [c]; prev_logits: [V], the last logit row of
    the previous chunk (it predicts this chunk's first token), or None at the start of the
    stream, where the first token gets NaN (no prediction exists).
    """
    # Row t-1 predicts token t. No concatenation of the [c, V] logits: the row carried over from
    # the last chunk is done alone.
    out = _first(ids, prev_logits, logits.device)
    if ids.shape[0] > 1:
        out[1:] = _nll(logits[:-1], ids[1:])
    return out


def shortlist_surprise(hidden: Tensor, ids: Tensor, prev_logits: Tensor | None, head: "Head", seed: int,
                       probe_at: Tensor, probe_logits: Tensor) -> Tensor:
    """`token_surprise` from the chunk's final hidden states [c, d] through `shortlist_nll`, with
    the model's logits at `probe_at` ([P] of `probe_positions(c)`; [P, V]); the first token from
    prev_logits, exactly. No [c, V] logits are computed."""
    out = _first(ids, prev_logits, hidden.device)
    if ids.shape[0] > 1:
        out[1:] = shortlist_nll(hidden[:-1], ids[1:], head, seed, probe_at, probe_logits)
    return out


def _first(ids: Tensor, prev_logits: Tensor | None, device: torch.device) -> Tensor:
    """[c] float32 whose first entry is the first token's surprise (NaN without prev_logits)."""
    out = torch.empty(ids.shape[0], dtype=torch.float32, device=device)
    # prev_logits may come from a saved state, read on the CPU: the chunk's device decides
    out[0] = float("nan") if prev_logits is None else _nll(prev_logits.to(device)[None], ids[:1])[0]
    return out


_BLOCK_BYTES = 4 << 20  # log-probabilities written per cross_entropy call (a few MB: in cache)


def _nll(logits: Tensor, ids: Tensor) -> Tensor:
    """-log softmax(logits)[ids] per row: [n, V], [n] -> [n] float32.

    cross_entropy writes the whole [n, V] log-softmax before picking one entry per row; a few rows
    at a time, that scratch stays in the CPU's cache (faster: docs/benchmark-log.md, ingest speed).
    Rows are independent, so the values are those of one call, bit for bit.
    """
    n, v = logits.shape
    if logits.device.type != "cpu":
        return torch.nn.functional.cross_entropy(logits.float(), ids, reduction="none")
    out = torch.empty(n, dtype=torch.float32)
    step = max(1, _BLOCK_BYTES // (4 * v))
    for a in range(0, n, step):
        rows = slice(a, a + step)
        out[rows] = torch.nn.functional.cross_entropy(logits[rows].float(), ids[rows], reduction="none")
    return out


# A shortlist head (`shortlist_nll`): the rows of a chunk whose whole vocabulary is scored, the top
# tokens of each kept, and the size of the uniform sample that stands for the rest of the
# vocabulary. docs/benchmarks.md measures the estimate against the exact surprise.
SHORTLIST_PROBES = 8
SHORTLIST_TOP = 2048
SHORTLIST_SAMPLE = 2048


def probe_positions(c: int, probes: int | None = None) -> Tensor:
    """[P] rows of a chunk of c tokens spread from its first to its last (which the model's logits
    need anyway): where `shortlist_nll` scores the whole vocabulary."""
    return torch.linspace(0, c - 1, min(SHORTLIST_PROBES if probes is None else probes, c)).round().long().unique()


@dataclass(frozen=True)
class Head:
    """A model's output layer as surprise needs it: logits = softcap(hidden @ weight.T + bias)."""

    weight: Tensor  # [V, d]
    bias: Tensor | None = None  # [V]
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap) (Gemma 2)

    def logits(self, hidden: Tensor, rows: Tensor | None = None) -> Tensor:
        """[n, d] -> [n, V] (rows: only these vocabulary entries, [k] -> [n, k])."""
        hidden = hidden.to(self.weight.device)  # (a model split over devices: the head's)
        w = self.weight if rows is None else self.weight[rows]
        b = self.bias if rows is None or self.bias is None else self.bias[rows]
        z = torch.nn.functional.linear(hidden, w, b)
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


def shortlist_rows(probe_logits: Tensor, targets: Tensor, top: int) -> Tensor:
    """The vocabulary entries scored exactly for every row: each probe row's `top` most likely
    tokens and the targets. probe_logits [P, V], targets [n] -> sorted unique ids [k]."""
    v = probe_logits.shape[-1]
    keep = torch.zeros(v, dtype=torch.bool, device=probe_logits.device)
    keep[probe_logits.topk(min(top, v), dim=-1).indices.flatten()] = True
    keep[targets] = True
    return keep.nonzero()[:, 0]


def tail_sample(shortlist: Tensor, vocab: int, k: int, seed: int) -> tuple[Tensor, float]:
    """k ids drawn uniformly, with replacement, from the vocabulary outside `shortlist` (sorted),
    and the factor that scales their summed probability mass to the whole rest (0 if none is
    left). Deterministic in `seed`."""
    rest = vocab - shortlist.numel()
    if rest <= 0 or k <= 0:
        return shortlist.new_zeros(0), 0.0
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = torch.randint(0, rest, (k,), generator=g).to(shortlist.device)  # ranks among the rest
    # the r-th id not in the shortlist: r plus the shortlisted ids at or below it
    ids = r + torch.searchsorted(shortlist - torch.arange(shortlist.numel(), device=shortlist.device), r, right=True)
    return ids, rest / k


def shortlist_nll(hidden: Tensor, targets: Tensor, head: Head, seed: int, probe_at: Tensor, probe_logits: Tensor,
                  top: int | None = None, sample: int | None = None) -> Tensor:
    """-log P(target) per row, with the softmax's normaliser estimated: [n, d], [n] -> [n] float32.

    The normaliser is summed exactly over a shortlist (the `top` tokens of every probe row, whose
    whole vocabulary the model scored: probe_logits [P, V] at rows probe_at [P], which may reach
    row n, the chunk's last; and every target) and estimated for the rest of the vocabulary from
    a uniform sample scaled to its size. Probe rows below n are exact. Rows of one text share most
    of their likely tokens, so the shortlist holds most of each row's probability mass.
    """
    n = hidden.shape[0]
    top = SHORTLIST_TOP if top is None else top
    sample = SHORTLIST_SAMPLE if sample is None else sample
    zp = probe_logits.float()
    rows = shortlist_rows(zp, targets, top)  # [k]
    zs = head.logits(hidden, rows).float()  # [n, k]
    lse = torch.logsumexp(zs, dim=-1)
    tail, scale = tail_sample(rows, head.weight.shape[0], sample, seed)
    if tail.numel():
        zt = head.logits(hidden, tail).float()  # [n, sample]
        lse = torch.logaddexp(lse, torch.logsumexp(zt, dim=-1) + math.log(scale))
    inside = probe_at < n
    lse[probe_at[inside]] = torch.logsumexp(zp[inside], dim=-1)
    picked = zs.gather(1, torch.searchsorted(rows, targets)[:, None])[:, 0]
    return lse - picked


def boundary_flags(surprise: Tensor, start: int, tau: int, gamma: float) -> Tensor:
    """Which tokens of surprise[start:] exceed mean + gamma * std of the tau tokens before them.

    surprise: [n] float, NaN where a token has no surprise (stream start, generated tokens); those
    are never boundaries and do not enter the statistics. std is the population std (ddof 0).
    A token needs at least 2 valid predecessors in its window to be a boundary.
    Returns bool [n - start]. Vectorised with prefix sums in float64.
    """
    n = surprise.shape[0]
    lo = max(0, start - tau)
    s = surprise[lo:].double()
    valid = ~torch.isnan(s)
    x = torch.where(valid, s, torch.zeros_like(s))
    zero = x.new_zeros(1)
    c1 = torch.cat((zero, torch.cumsum(x, 0)))
    c2 = torch.cat((zero, torch.cumsum(x * x, 0)))
    cn = torch.cat((zero, torch.cumsum(valid.double(), 0)))
    t = torch.arange(start - lo, n - lo, device=s.device)  # positions (relative to lo) to decide
    a = (t - tau).clamp_min(0)
    cnt = cn[t] - cn[a]
    mean = (c1[t] - c1[a]) / cnt.clamp_min(1)
    var = ((c2[t] - c2[a]) / cnt.clamp_min(1) - mean * mean).clamp_min(0)
    threshold = mean + gamma * var.sqrt()
    return valid[t] & (cnt >= 2) & (s[t] > threshold)
