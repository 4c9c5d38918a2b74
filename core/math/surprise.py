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
    c = ids.shape[0]
    # Row t-1 predicts token t. No concatenation of the [c, V] logits: the row carried over from
    # the last chunk is done alone.
    out = torch.empty(c, dtype=torch.float32, device=logits.device)
    # prev_logits may come from a saved state, read on the CPU: the chunk's device decides
    out[0] = float("nan") if prev_logits is None else _nll(prev_logits.to(logits.device)[None], ids[:1])[0]
    if c > 1:
        out[1:] = _nll(logits[:-1], ids[1:])
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
