"""Rules that orthogonalise each matrix by Newton-Schulz iterations (Muon): the matrix whole, or
each of its heads (per-head Muon), by the standard or the Gram iteration, its momentum at full
precision or in 8-bit codes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from zero.plans.costs.base import RuleCost, heads_by_name, heads_of
from zero.plans.meta import ParamMeta

__all__ = ["NewtonSchulz", "ns_flops", "NS_METHODS"]

NS_METHODS = ("standard", "gram")


def ns_flops(m: int, n: int, steps: int, method: str = "standard", restarts: tuple[int, ...] = ()) -> int:
    """Flops of orthogonalising one ``m x n`` matrix (``m <= n``, the orientation whose Gram matrix
    is the smaller) in ``steps`` quintic steps, as `zero.functional.contrib.newton_schulz` runs them.

    Standard: each step ``X X^T`` (2 m^2 n), its square (2 m^3) and the product with ``X``
    (2 m^2 n). Gram (a square matrix iterates as standard): ``R = X X^T`` once (2 m^2 n); each step
    ``R^2`` and, after the first step of a run, ``Q Z`` (2 m^3 each), and ``R``'s update (4 m^3)
    unless the next step restarts or ends; a restart ``X <- Q X`` and a new ``R`` (4 m^2 n); at the
    end ``X <- Q X`` (2 m^2 n)."""
    if method == "standard" or m == n:
        return steps * (4 * m * m * n + 2 * m**3)
    flops = 2 * m * m * n
    for i in range(steps):
        if i in restarts:
            flops += 4 * m * m * n
        flops += 2 * m**3 + (2 * m**3 if i > 0 and i not in restarts else 0)
        if i + 1 < steps and i + 1 not in restarts:
            flops += 4 * m**3
    return flops + 2 * m * m * n


@dataclass(frozen=True)
class NewtonSchulz(RuleCost):
    """Each 2-D param (a matrix, as `zero.functional.contrib.muon` routes them) holds
    ``matrix_slots`` state tensors (``int8_block`` > 0: 8-bit Muon's momentum, a byte an element
    and a float32 scale a block) and costs ``ns_steps`` quintic Newton-Schulz steps by
    ``ns_method``, stepped whole, or per head: ``heads`` maps a param's name to the heads its first
    axis (torch's output rows) is cut into, each a matrix of its own (a 3-D param: the size of its
    head axis, `matrices`). The other params take the element-wise rule of ``slots`` (Muon's AdamW)."""

    matrix_slots: int = 1
    ns_steps: int = 5
    ns_method: str = "standard"
    ns_restarts: tuple[int, ...] | None = None
    heads: tuple[tuple[str, int], ...] = ()
    int8_block: int = 0

    keeps_whole = True

    def __post_init__(self) -> None:
        if self.ns_method not in NS_METHODS:
            raise ValueError(f"unknown ns_method {self.ns_method!r}; choose one of {NS_METHODS}")
        object.__setattr__(self, "heads", heads_by_name(self.heads))
        if self.ns_restarts is not None:
            object.__setattr__(self, "ns_restarts", tuple(self.ns_restarts))

    @staticmethod
    def from_rule(settings: dict) -> dict:
        """The model's settings from a Muon rule's own arguments (``mu_dtype="int8"``: 8-bit)."""
        out = dict(settings)
        if str(out.pop("mu_dtype", None)) in ("int8", "torch.int8"):
            out["int8_block"] = out.get("mu_block_size", 2048)
        return out

    @property
    def restarts(self) -> tuple[int, ...]:
        if self.ns_method == "standard":
            return ()
        return ((2,) if self.ns_steps > 2 else ()) if self.ns_restarts is None else self.ns_restarts

    def is_matrix(self, meta: ParamMeta) -> bool:
        return self.matrices(meta) is not None

    def matrices(self, meta: ParamMeta) -> tuple[int, int, int] | None:
        """``(heads, m, n)``: the ``m x n`` matrices ``meta`` is stepped as, or None (element-wise).
        A 2-D param's rows are cut into its heads; a 3-D param named in ``heads`` (a JAX attention
        kernel such as Flax's ``(in, heads, head_dim)``, Optax's Muon reading its head axis as a
        batch axis) is one matrix of its other two axes per index of the axis its heads are."""
        shape, h = meta.shape, self.heads_of(meta)
        if len(shape) == 2:
            return h, shape[0] // h, shape[1]
        if len(shape) == 3 and h > 1 and h in shape:
            rest = list(shape)
            rest.remove(h)
            return h, rest[0], rest[1]
        return None

    def heads_of(self, meta: ParamMeta) -> int:
        return heads_of(self.heads, meta)

    def slots_for(self, meta: ParamMeta) -> int:
        return self.matrix_slots if self.is_matrix(meta) else self.slots

    def state_bytes(self, meta: ParamMeta, itemsize: int) -> int:
        if self.int8_block and self.is_matrix(meta) and meta.requires_grad:
            return meta.numel + 4 * math.ceil(meta.numel / self.int8_block) + self.scalar_bytes
        return super().state_bytes(meta, itemsize)

    def shard_state_bytes(self, numel: int, itemsize: int, block: int = 0) -> int:
        """A piece cut at ``block`` > 0 is whole heads of a matrix (this family quantizes nothing a
        plan cuts): its momentum; else a flat shard of the element-wise params."""
        if block:
            return self.matrix_slots * numel * itemsize + self.scalar_bytes
        return super().shard_state_bytes(numel, itemsize, block)

    def whole(self, meta: ParamMeta) -> bool:
        return meta.requires_grad and self.is_matrix(meta)

    def head_block(self, meta: ParamMeta) -> int:
        """A head's elements of a matrix cut into heads along its rows (8-bit Muon's codes lie in
        blocks of the whole matrix: none)."""
        h = self.heads_of(meta)
        if h < 2 or self.int8_block or len(meta.shape) != 2 or meta.shape[0] % h:
            return 0
        return meta.numel // h

    def step_flops(self, meta: ParamMeta) -> int:
        """For a matrix, `ns_flops` of each head's block (the whole matrix without heads), plus its
        elements; element-wise params their elements."""
        if not meta.requires_grad or not self.is_matrix(meta):
            return super().step_flops(meta)
        h, m, n = self.matrices(meta)
        m, n = sorted((m, n))
        return h * ns_flops(m, n, self.ns_steps, self.ns_method, self.restarts) + meta.numel
