"""Rules that orthogonalise each matrix by Newton-Schulz iterations (Muon): the matrix whole."""

from __future__ import annotations

from dataclasses import dataclass

from zero.plans.costs.base import RuleCost
from zero.plans.meta import ParamMeta

__all__ = ["NewtonSchulz"]


@dataclass(frozen=True)
class NewtonSchulz(RuleCost):
    """Each 2-D param (a matrix, as `zero.functional.contrib.muon` routes them) holds
    ``matrix_slots`` state tensors and costs ``ns_steps`` quintic Newton-Schulz steps, stepped
    whole; the other params take the element-wise rule of ``slots`` (Muon's AdamW)."""

    matrix_slots: int = 1
    ns_steps: int = 5

    keeps_whole = True

    def is_matrix(self, meta: ParamMeta) -> bool:
        return len(meta.shape) == 2

    def slots_for(self, meta: ParamMeta) -> int:
        return self.matrix_slots if self.is_matrix(meta) else self.slots

    def whole(self, meta: ParamMeta) -> bool:
        return meta.requires_grad and self.is_matrix(meta)

    def step_flops(self, meta: ParamMeta) -> int:
        """For a matrix, ``ns_steps`` quintic steps in the orientation whose Gram matrix is the
        smaller (``m <= n``): ``X X^T`` (2 m^2 n), its square (2 m^3) and the product with ``X``
        (2 m^2 n), plus its elements; element-wise params their elements."""
        if not meta.requires_grad or not self.is_matrix(meta):
            return super().step_flops(meta)
        m, n = sorted(meta.shape)
        return self.ns_steps * (4 * m * m * n + 2 * m**3) + meta.numel
