"""Rules that step each matrix in a low-rank projection of its gradient (GaLore): the matrix
whole, its state the projector and the base rule's moments of the projected gradient."""

from __future__ import annotations

from dataclasses import dataclass

from zero.plans.costs.base import RuleCost
from zero.plans.meta import ParamMeta

__all__ = ["LowRank"]


@dataclass(frozen=True)
class LowRank(RuleCost):
    """Each 2-D param ``m x n`` (as `zero.functional.contrib.galore` finds them by default) keeps
    a projector of ``max(m, n) x r`` and ``slots`` base-rule tensors of ``r x min(m, n)``
    (``r = min(rank, m, n)``), stepped whole (an SVD every ``update_proj_gap`` steps); the other
    params ``slots`` element-wise tensors."""

    rank: int = 128
    update_proj_gap: int = 200

    keeps_whole = True

    def is_matrix(self, meta: ParamMeta) -> bool:
        return len(meta.shape) == 2

    def whole(self, meta: ParamMeta) -> bool:
        return meta.requires_grad and self.is_matrix(meta)

    def state_bytes(self, meta: ParamMeta, itemsize: int) -> int:
        if not self.is_matrix(meta):
            return super().state_bytes(meta, itemsize)
        m, n = max(meta.shape), min(meta.shape)
        r = min(self.rank, n)
        return (m * r + self.slots * r * n) * itemsize + self.scalar_bytes

    def step_flops(self, meta: ParamMeta) -> int:
        """For a matrix: the projections there and back (2 m n r each) and its SVD (about
        4 m n^2) once every ``update_proj_gap`` steps; element-wise params their elements."""
        if not meta.requires_grad or not self.is_matrix(meta):
            return super().step_flops(meta)
        m, n = max(meta.shape), min(meta.shape)
        r = min(self.rank, n)
        return 4 * m * n * r + 4 * m * n * n // self.update_proj_gap + meta.numel
