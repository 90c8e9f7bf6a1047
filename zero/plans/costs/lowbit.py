"""Rules that keep their moments block-wise quantized (torchao's low-bit Adam, `zero.functional.contrib.adamw_8bit`)."""

from __future__ import annotations

from dataclasses import dataclass

from zero.plans.costs.base import RuleCost
from zero.plans.meta import ParamMeta

__all__ = ["LowBit", "LOW_BIT_MIN_NUMEL"]

LOW_BIT_MIN_NUMEL = 4096  # torchao's (after bitsandbytes'): smaller params keep full-precision moments


@dataclass(frozen=True)
class LowBit(RuleCost):
    """``slots`` moments at ``bits`` per element plus one float32 scale per ``block_size``
    elements, for params of at least ``min_numel`` elements that divide into blocks (decided by the
    whole param's size, so no plan changes it); smaller ones keep full-precision moments."""

    bits: int = 8
    block_size: int = 256
    min_numel: int = LOW_BIT_MIN_NUMEL

    def quantizes(self, numel: int) -> bool:
        """Whether a param of ``numel`` elements gets quantized moments (torchao's rule)."""
        return numel >= self.min_numel and numel % self.block_size == 0

    def block_for(self, meta: ParamMeta) -> int:
        return self.block_size if self.quantizes(meta.numel) and meta.requires_grad else 0

    def moments_bytes(self, numel: int, itemsize: int, block: int = 0) -> int:
        """Bytes of the moments of ``numel`` elements: quantized in blocks of ``block`` (codes and
        float32 scales), or full precision at ``itemsize`` bytes (``block`` 0)."""
        if not block:
            return self.slots * numel * itemsize
        return self.slots * (numel * self.bits // 8 + numel // block * 4)

    def state_bytes(self, meta: ParamMeta, itemsize: int) -> int:
        return self.moments_bytes(meta.numel, itemsize, self.block_for(meta)) + self.scalar_bytes

    def shard_state_bytes(self, numel: int, itemsize: int, block: int = 0) -> int:
        return self.moments_bytes(numel, itemsize, block) + self.scalar_bytes

    def moved_bytes(self, meta: ParamMeta, count: int, itemsize: int) -> int:
        block = self.block_for(meta)
        return self.moments_bytes(count, 0, block) if block else count * self.slots * itemsize
