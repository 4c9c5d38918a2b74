"""Surprise per token and the moving boundary threshold (paper eq. 1, spec §2)."""

from __future__ import annotations

import torch
from torch import Tensor


def token_surprise(logits: Tensor, ids: Tensor, prev_logits: Tensor | None) -> Tensor:
    """-log P(x_t | x_<t) for each token of a chunk, float32.

    logits: [c, V] of the chunk's forward pass; ids: [c]; prev_logits: [V], the last logit row of
    the previous chunk (it predicts this chunk's first token), or None at the start of the
    stream, where the first token gets NaN (no prediction exists).
    """
    first = prev_logits[None] if prev_logits is not None else logits.new_full((1, logits.shape[1]), float("nan"))
    pred = torch.cat((first, logits[:-1]), 0).float()  # [c, V]: row t predicts token t
    logp = torch.log_softmax(pred, dim=-1)
    return -logp.gather(1, ids[:, None]).squeeze(1)


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
