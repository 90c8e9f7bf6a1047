"""Block-wise quantization of optimizer moments, as torchao's low-bit optimizers keep them, and
the Adam step on them (`advance`, `direction`) that `zero.functional.contrib.adamw_8bit`'s pure
update and its in-place kernel (`zero.functional.kernels.lowbit`) share.

A moment of ``n`` elements (``n`` a multiple of the block size) is cut into blocks in its own
flattened element order; each block is divided by its largest magnitude (its ``scale``, float32,
at least 1e-12) and each element stored as the index of the nearest value of a fixed map
(``qmap``): 256 values for 8 bits, 16 for 4 bits (two codes a byte, the even element in the high
nibble). The maps are Dettmers' dynamic maps (arXiv:1511.04561, bitsandbytes) and, for the 4-bit
second moment, the linear map without zero of Li et al. (arXiv:2309.01507), value for value
torchao's (``torchao.optim.quant_utils``; ``tests/functional/test_lowbit.py`` compares them).

Every operation here is exact per element (comparisons, one IEEE operation at a time, no fused
multiply-add), so an element's code depends only on its value and its block's scale: never on
where the block sits in a tensor, how many threads ran, or which rank holds it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch

__all__ = ["Quantized", "qmap", "quantize", "codes_of", "dequantize", "zeros", "advance", "direction", "SCALE_FLOOR",
           "CHUNK_NUMEL", "linear_zeros", "quantize_linear", "dequantize_linear"]

CHUNK_NUMEL = 1 << 16  # elements the in-place step takes at a time (a whole number of blocks of it)
SCALE_FLOOR = 1e-12  # a block of zeros keeps a positive scale, so dividing by it stays finite


class Quantized(NamedTuple):
    """A block-wise quantized tensor (one moment of one param or shard).

    Fields:
        codes: uint8; 8-bit: one code per element, shaped like the tensor; 4-bit: two per byte,
            flat (``numel // 2``).
        scale: float32, one per block (``numel // block_size``), the block's largest magnitude.
    """

    codes: torch.Tensor
    scale: torch.Tensor


def _dynamic_map(signed: bool, exponent_bits: int, total_bits: int) -> list[float]:
    """Dettmers' dynamic map: for each exponent ``10^(e - exponent_bits + 1)``, the midpoints of
    an even split of [0.1, 1] (finer as the exponent grows), both signs when ``signed``; then 0
    and 1. Computed in float32, as torchao does, so the values are the same floats."""
    mantissa_bits = total_bits - 1  # torchao keeps one bit aside for unsigned maps too
    values: list[float] = []
    for e in range(exponent_bits):
        n = 2 ** (e + mantissa_bits - exponent_bits + (0 if signed else 1)) + 1
        edges = torch.linspace(0.1, 1, n)
        mids = (10 ** (e - exponent_bits + 1)) * ((edges[:-1] + edges[1:]) / 2.0)
        values += mids.tolist() + ((-mids).tolist() if signed else [])
    extra = 2 ** (mantissa_bits - exponent_bits) - 1
    if extra > 0:  # the values the exponent bits leave over, at the last exponent
        edges = torch.linspace(0.1, 1, extra + 1)
        mids = (edges[:-1] + edges[1:]) / 2.0  # at 10^0
        values += mids.tolist() + ((-mids).tolist() if signed else [])
    values += [0.0, 1.0]
    if len(values) != 2**total_bits:
        raise ValueError(f"a dynamic map of {total_bits} bits has {2 ** total_bits} values, got {len(values)}")
    return sorted(values)


@functools.cache
def _map_values(bits: int, signed: bool) -> tuple[float, ...]:
    if bits == 8:
        return tuple(_dynamic_map(signed, 7, 8))
    if bits == 4:
        return tuple(_dynamic_map(True, 3, 4)) if signed else tuple(torch.linspace(0, 1, 17)[1:].tolist())
    raise ValueError(f"bits must be 8 or 4, got {bits!r}")


def qmap(bits: int, signed: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """The sorted float32 values codes index: signed for a first moment, unsigned for a second."""
    return torch.tensor(_map_values(bits, signed), dtype=torch.float32, device=device)


def zeros(numel: int, shape: tuple[int, ...], bits: int, block_size: int,
          device: torch.device | str | None = None) -> Quantized:
    """A moment of zeros (code 0 and scale 0 dequantize to 0, as torchao starts)."""
    codes = torch.zeros(shape if bits == 8 else (numel // 2,), dtype=torch.uint8, device=device)
    return Quantized(codes, torch.zeros(numel // block_size, dtype=torch.float32, device=device))


def dequantize(q: Quantized, table: torch.Tensor, bits: int) -> torch.Tensor:
    """The float32 values ``q`` holds, flat."""
    codes = q.codes.reshape(-1)
    if bits == 4:
        codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1).reshape(-1)
    blocks = table[codes.int()].view(q.scale.numel(), -1)
    return (blocks * q.scale.view(-1, 1)).reshape(-1)


_KEY_SHIFT = 15  # buckets of 2^15 consecutive float32s (8 mantissa bits): finer than any map's spacing


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns (as int32) mapped to int32s in the floats' order, and back."""
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _float_of(ordered: torch.Tensor) -> torch.Tensor:
    return _ordered(ordered.to(torch.int32)).view(torch.float32)


@functools.cache
def _thresholds(values: tuple[float, ...]) -> torch.Tensor:
    """Where the nearest code steps up: ``t[c-1]`` is the smallest float32 ``x`` at or above map
    value ``c-1`` with ``x - v[c-1] >= (v[c] - v[c-1]) * 0.5`` in float32 (torchao's rounding,
    half-way up), found by bisection over the floats between the two values. The code of ``x``
    is then the number of thresholds at or below it."""
    v = torch.tensor(values, dtype=torch.float32)
    low, high = v[:-1], v[1:]
    half = (high - low) * 0.5
    lo = _ordered(low.view(torch.int32)).long()  # the answer is in (lo, hi]: at hi the condition holds
    hi = _ordered(high.view(torch.int32)).long()
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        up = _float_of(mid) - low >= half
        hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid)
    at_low = low - low >= half  # a zero gap (never in these maps) steps up at the value itself
    return torch.where(at_low, low, _float_of(hi))


@functools.cache
def _buckets(values: tuple[float, ...], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """For each bucket of floats (by their top ``32 - _KEY_SHIFT`` bits), how many of the sorted
    ``values`` lie at or below its smallest float; and ``values`` followed by +inf. A bucket with two
    values inside would make `_count_at_or_below`'s one comparison wrong: checked here, once."""
    table = torch.tensor(values, dtype=torch.float32)
    n = 1 << (32 - _KEY_SHIFT)
    raw = (torch.arange(n, dtype=torch.int64) - n // 2) << _KEY_SHIFT  # bucket k holds bit patterns raw[k] ...
    ends = torch.stack([raw, raw + (1 << _KEY_SHIFT) - 1]).to(torch.int32).view(torch.float32)
    lowest, highest = ends.min(0).values, ends.max(0).values  # negative floats run backwards in bits
    counts = torch.searchsorted(table, lowest, right=True)
    inside = torch.searchsorted(table, highest, right=True) - counts
    if int(inside[torch.isfinite(lowest) & torch.isfinite(highest)].max()) > 1:
        raise ValueError("a quantization map has two values in one float bucket: lower _KEY_SHIFT")
    return counts.to(device), torch.cat([table, torch.tensor([float("inf")])]).to(device)


def _count_at_or_below(x: torch.Tensor, values: tuple[float, ...]) -> torch.Tensor:
    """``searchsorted(values, x, right=True)`` for float32 ``x``, in a fraction of its time: the
    count of ``x``'s float bucket, plus one where the bucket's next value is at or below ``x``."""
    counts, padded = _buckets(values, str(x.device))
    key = x.reshape(-1).view(torch.int32).long()
    key.bitwise_right_shift_(_KEY_SHIFT).add_(counts.numel() // 2)
    found = torch.gather(counts, 0, key)
    return found.add_(x.reshape(-1) >= torch.gather(padded, 0, found))


def codes_of(scaled: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The nearest map value's index (uint8, flat) of each element of ``scaled`` (float32, in
    [-1, 1]): torchao's binary search and rounding (half-way up), as a count of thresholds."""
    return _count_at_or_below(scaled, _threshold_values(tuple(table.tolist()))).to(torch.uint8)


@functools.cache
def _threshold_values(values: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(_thresholds(values).tolist())


def quantize(x: torch.Tensor, table: torch.Tensor, bits: int, block_size: int, shape: tuple[int, ...]) -> Quantized:
    """``x`` (any shape, ``numel`` a multiple of ``block_size``; float64 is rounded to float32
    first, as torchao computes) quantized: per block, its scale, and per element the nearest map
    value's index (half-way rounds up, as torchao's)."""
    blocks = x.reshape(-1, block_size).to(torch.float32)
    scale = blocks.abs().amax(-1).clamp(min=SCALE_FLOOR)
    scaled = (blocks / scale.view(-1, 1)).reshape(-1)
    codes = codes_of(scaled, table)
    if bits == 4:
        codes = (codes[0::2] << 4) | codes[1::2]
    return Quantized(codes.view(shape) if bits == 8 else codes, scale)


@functools.cache
def _table(bits: int, signed: bool, device: str) -> torch.Tensor:
    return qmap(bits, signed, device)


def advance(g: torch.Tensor, mu: Any, nu: Any, b1: float, b2: float, bits: int, block_size: int):
    """One param's moments moved toward ``g``: ``(m, v)`` in float32 (at least), for this step's
    update, and the moments to keep (quantized again, or in their own dtype)."""
    wide = torch.promote_types(g.dtype, torch.float32)
    g = g.to(wide)
    if isinstance(mu, Quantized):
        signed, unsigned = _table(bits, True, str(g.device)), _table(bits, False, str(g.device))
        m = _toward(dequantize(mu, signed, bits).view(g.shape), g, b1)
        v = _toward(dequantize(nu, unsigned, bits).view(g.shape), g * g, b2)
        shape = tuple(mu.codes.shape)
        return m, v, quantize(m, signed, bits, block_size, shape), quantize(v, unsigned, bits, block_size, shape)
    m, v = _toward(mu.to(wide), g, b1), _toward(nu.to(wide), g * g, b2)
    return m, v, m.to(mu.dtype), v.to(nu.dtype)


def _toward(x: torch.Tensor, target: torch.Tensor, beta: float) -> torch.Tensor:
    """``x + (1 - beta)(target - x)`` (torchao's ``lerp``), one rounding per operation."""
    return x + (target - x) * (1 - beta)


def direction(m: torch.Tensor, v: torch.Tensor, count: int, b1: float, b2: float, eps: float) -> torch.Tensor:
    """Adam's step direction from this step's moments, in torchao's order of operations."""
    return (m / (1 - b1**count)) / (v.sqrt() / math.sqrt(1 - b2**count) + eps)


# Blockwise *linear* int8 codes (8-bit Muon, arXiv:2509.23106): a block's largest magnitude is
# its scale, and each element the nearest of 255 even steps of it, code * scale / 127. A partial
# last block is its own block. Each element's code depends only on its value and its block's
# scale (one IEEE operation at a time), so a whole tensor quantizes the same on any rank.

def linear_zeros(like: torch.Tensor, block_size: int) -> Quantized:
    """A moment of zeros in linear int8 codes, shaped like ``like``."""
    blocks = -(-like.numel() // block_size)
    return Quantized(torch.zeros(like.shape, dtype=torch.int8, device=like.device),
                     torch.zeros(blocks, dtype=torch.float32, device=like.device))


def _padded(x: torch.Tensor, block_size: int) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = -flat.numel() % block_size
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block_size) if pad else flat.view(-1, block_size)


def quantize_linear(x: torch.Tensor, block_size: int) -> Quantized:
    """``x`` in linear int8 codes, blocks of ``block_size`` in its own flattened order (float64
    rounded to float32 first)."""
    blocks = _padded(x.to(torch.float32), block_size)
    scale = blocks.abs().amax(-1).clamp(min=SCALE_FLOOR)
    codes = torch.round(blocks / scale.view(-1, 1) * 127.0).clamp_(-127, 127).to(torch.int8)
    return Quantized(codes.reshape(-1)[:x.numel()].view(x.shape), scale)


def dequantize_linear(q: Quantized, block_size: int) -> torch.Tensor:
    """The float32 values linear codes ``q`` (blocks of ``block_size``) hold, in the codes' shape."""
    blocks = _padded(q.codes.to(torch.float32), block_size)
    if blocks.shape[0] != q.scale.numel():
        raise ValueError(f"linear codes of {q.codes.numel()} elements in blocks of {block_size} need "
                         f"{blocks.shape[0]} scales, got {q.scale.numel()}: the state was made with another block size")
    values = blocks * q.scale.view(-1, 1) / 127.0
    return values.reshape(-1)[:q.codes.numel()].view(q.codes.shape)
