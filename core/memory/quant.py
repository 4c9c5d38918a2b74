"""How a store keeps the keys and values of its events: a float dtype, or integer codes in groups
with their scales. Pure math: rows in, rows out; the store writes and reads them.

    fmt = kv_format("int4", head_dim=64)
    rows = fmt.encode(k)                  # k [n, H, D] -> uint8 [n, *fmt.row(H, D)]
    k2 = fmt.decode(rows, torch.bfloat16)  # [n, H, D]

Integer formats quantise each token's keys (before RoPE, as the store keeps them) and values in
groups of `group` channels of one head (32, or the largest power of two dividing the head size),
asymmetrically: a group keeps its minimum and step in float16, and each value the nearest of
2^bits levels between. Each row is one token, whole, so a row is encoded as it is appended and
decoded as it is read, by whichever event it belongs to: nothing waits for a group of tokens to
fill (KIVI and KVQuant quantise keys per channel across tokens, which needs such a group, kept in
full precision until it fills; per token with groups this small, an outlier channel spoils only
the 31 channels of its own group, which is what llama.cpp's q8_0/q4_1 caches do).

Keys carry offsets and ranges that differ by channel (a few channels large in every token), which
is why KIVI and KVQuant quantise them per channel; per token, a group's step is set by its largest
channel and the others lose their resolution. An integer store (version 6) takes those differences
out first with a fixed per-channel equaliser per layer: each channel's mean and range over the
layer's first rows (`fit_equaliser`), kept in the store, subtracted and divided before the rows are
quantised per token, restored after they are decoded. The rows stay one token each (nothing waits),
and int4 keys err less than half as much, near quantising per channel over groups of tokens
(docs/benchmark-log.md, store formats). Values are quantised per token as they are (equalising
them gained little).

Representative keys (one per event and query head) are kept as the float formats keep keys, and
in int8 by both integer formats: with SmolLM2's short events (13 tokens on average) they are a
quarter of an int4 store in bfloat16 (measured: docs/benchmarks.md › Compute dtype and store
formats). Search scores them as stored, so it stays exact for what the store holds: the scan, the
sketch's bounds and a reader's own events all read the same decoded values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INTS = {"int8": 8, "int4": 4}
FORMATS = (*FLOATS, *INTS)
_SCALE_BYTES = 4  # a group's minimum and step, float16 each


def group_size(head_dim: int) -> int:
    """Channels per quantisation group: 32, or the largest power of two dividing the head size."""
    g = 32
    while head_dim % g:
        g //= 2
    return g


@dataclass(frozen=True)
class KVFormat:
    name: str
    group: int  # channels per group (integer formats)

    @property
    def bits(self) -> int | None:
        return INTS.get(self.name)

    @property
    def reprs(self) -> "KVFormat":
        """How a store of this format keeps representative keys: the same float format, or int8."""
        return self if self.bits is None else KVFormat("int8", self.group)

    @property
    def row_dtype(self) -> torch.dtype:
        return FLOATS.get(self.name, torch.uint8)

    def row(self, heads: int, dim: int) -> tuple[int, ...]:
        """The shape of one token's row in the file."""
        if self.bits is None:
            return (heads, dim)
        return (heads, dim // self.group, self.group * self.bits // 8 + _SCALE_BYTES)

    def row_bytes(self, heads: int, dim: int) -> int:
        n = 1
        for s in self.row(heads, dim):
            n *= s
        return n * torch.empty(0, dtype=self.row_dtype).element_size()

    def encode(self, x: Tensor) -> Tensor:
        """x [n, H, D] (any float dtype) -> rows [n, *row(H, D)] in `row_dtype`."""
        if self.bits is None:
            return x.to(self.row_dtype)
        n, h, d = x.shape
        levels = (1 << self.bits) - 1
        g = x.float().reshape(n, h, d // self.group, self.group)
        lo = g.amin(-1, keepdim=True).to(torch.float16)
        step = ((g.amax(-1, keepdim=True) - lo.float()) / levels).to(torch.float16)
        # quantise against the float16 minimum and step actually stored, so decoding inverts it
        lo32, step32 = lo.float(), step.float()
        inv = torch.where(step32 > 0, 1.0 / step32, torch.zeros_like(step32))
        codes = ((g - lo32) * inv).round_().clamp_(0, levels).to(torch.uint8)  # [n, h, groups, group]
        if self.bits == 4:
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        scales = torch.cat((lo, step), -1).view(torch.uint8)  # [n, h, groups, 4]
        return torch.cat((codes, scales), -1)

    def decode(self, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """rows [n, *row(H, D)] -> [n, H, D] in `dtype`."""
        if self.bits is None:
            return rows.to(dtype)
        n, h, groups, width = rows.shape
        body = width - _SCALE_BYTES
        codes = rows[..., :body]
        lo_step = rows[..., body:].contiguous().view(torch.float16).float()  # [n, h, groups, 2]
        if self.bits == 4:
            codes = torch.stack((codes & 15, codes >> 4), -1).reshape(n, h, groups, 2 * body)
        x = codes.float() * lo_step[..., 1:] + lo_step[..., :1]
        return x.reshape(n, h, groups * self.group).to(dtype)


EQUALISER_MIN_ROWS = 16  # fewer first rows fit nothing: the identity (per token as before)
_EQUALISER_FLOOR = 0.1  # a channel's scale is at least this share of its head's widest channel's


def fit_equaliser(k: Tensor) -> Tensor:
    """The per-channel equaliser of keys k [n, H, D]: [2, H, D] float32, each channel's centre (its
    mean) and scale (its largest distance from it, at least a tenth of the head's widest channel's,
    so a channel quiet in the first rows cannot blow up later ones). Fewer than
    `EQUALISER_MIN_ROWS` rows, or a head whose channels never moved: centre 0 and scale 1."""
    x = k.float()
    eq = torch.zeros(2, *x.shape[1:])
    eq[1] = 1.0
    if x.shape[0] < EQUALISER_MIN_ROWS:
        return eq
    centre = x.mean(0)  # [H, D]
    spread = (x - centre).abs().amax(0)  # [H, D]
    widest = spread.amax(-1, keepdim=True)  # [H, 1]
    ok = (widest > 0) & widest.isfinite() & centre.isfinite().all(-1, keepdim=True)  # [H, 1]
    eq[0] = torch.where(ok, centre, 0.0)
    eq[1] = torch.where(ok, torch.maximum(spread, widest * _EQUALISER_FLOOR), 1.0)
    return eq


def equaliser_ok(eq: Tensor, heads: int, dim: int) -> bool:
    """Whether eq (read from a store: untrusted) is an equaliser: [2, H, D] float32, finite, scales > 0."""
    return (eq.dtype == torch.float32 and tuple(eq.shape) == (2, heads, dim) and bool(eq.isfinite().all())
            and bool((eq[1] > 0).all()))


def encode_keys(fmt: KVFormat, k: Tensor, eq: Tensor | None) -> Tensor:
    """Keys [n, H, D] -> rows, equalised first where the store has an equaliser eq [2, H, D]."""
    return fmt.encode(k if eq is None else (k.float() - eq[0]) / eq[1])


def decode_keys(fmt: KVFormat, rows: Tensor, eq: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Rows -> keys [n, H, D] in `dtype`, the equaliser eq [2, H, D] undone where there is one."""
    if eq is None:
        return fmt.decode(rows, dtype)
    return (fmt.decode(rows, torch.float32) * eq[1] + eq[0]).to(dtype)


def kv_format(name: str, head_dim: int) -> KVFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown store format {name!r}: use one of {', '.join(FORMATS)}")
    return KVFormat(name, group_size(head_dim))


__all__ = ["KVFormat", "kv_format", "FORMATS", "FLOATS", "INTS", "group_size", "fit_equaliser", "equaliser_ok",
           "encode_keys", "decode_keys", "EQUALISER_MIN_ROWS"]
