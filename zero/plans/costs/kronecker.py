"""Kronecker-factored rules (SOAP, Shampoo): which axes of a param keep a factor (the layout
the rules themselves read, here so that plans and rules share one answer), the factors' state
and the step's work, and whether a param must be stepped whole (it has a factor).

Pure arithmetic over shapes: no torch.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from zero.plans.costs.base import RuleCost, heads_by_name, heads_of
from zero.plans.meta import ParamMeta

__all__ = ["soap_axes", "merge_small_dims", "BlockLayout", "Soap", "Shampoo", "ROOT_FLOPS"]

ROOT_FLOPS = 22  # a d x d SVD, about 22 d^3 (Golub-Van Loan's count for U, S and V)


def soap_axes(shape: tuple[int, ...], max_precond_dim: int = 10000, precondition_1d: bool = False) -> tuple[bool, ...]:
    """Per axis of a tensor of ``shape``, whether SOAP keeps a factor for it: every axis up to
    ``max_precond_dim`` long; a vector's only with ``precondition_1d``."""
    if len(shape) == 1 and not precondition_1d:
        return (False,)
    return tuple(d <= max_precond_dim for d in shape)


def merge_small_dims(shape: tuple[int, ...], max_dim: int) -> tuple[int, ...]:
    """``shape`` with neighbouring axes merged while their product stays at most ``max_dim``
    (``(1, 2, 512, 3) -> (1024, 3)`` at 1024); one axis left becomes ``(1,)``, as Scalable
    Shampoo's (so a small tensor takes no factor at all)."""
    merged, product = [], 1
    for d in shape:
        product *= d
        if product > max_dim:
            merged.append(product // d)
            product = d
    merged.append(product)
    return tuple(merged) if len(merged) > 1 else (1,)


@dataclass(frozen=True)
class BlockLayout:
    """How Shampoo reads one tensor: in ``shape`` (its axes merged), cut into blocks of at most
    ``block_size`` along each axis, each block with a factor for each axis in ``axes`` (none at
    all when ``preconditioned`` is False: the graft alone steps it), roots of ``exponent``."""

    original: tuple[int, ...]
    shape: tuple[int, ...]
    axes: tuple[bool, ...]
    splits: tuple[tuple[int, ...], ...]  # per axis, the lengths of its blocks
    preconditioned: bool
    exponent: int

    @staticmethod
    def of(shape: tuple[int, ...], block_size: int = 512, shape_interpretation: bool = True,
           preconditioner_type: str = "all", skip_preconditioning_rank_lt: int = 1,
           no_preconditioning_for_layers_with_dim_gt: int = 8192, inverse_exponent_override: int = 0) -> BlockLayout:
        shape = tuple(shape)
        read = merge_small_dims(shape, block_size) if shape_interpretation else shape
        n = len(read)
        axes = (True,) * n if preconditioner_type == "all" or n <= 1 else (
            (True,) * (n - 1) + (False,) if preconditioner_type == "input" else (False,) * (n - 1) + (True,))
        skip = len(shape) < skip_preconditioning_rank_lt or any(
            d > no_preconditioning_for_layers_with_dim_gt for d in shape)
        splits = tuple((d,) if block_size <= 0 or block_size >= d else
                       (block_size,) * ((d - 1) // block_size) + (d - (d - 1) // block_size * block_size,)
                       for d in read)
        exponent = inverse_exponent_override if inverse_exponent_override > 0 else 2 * sum(axes)
        return BlockLayout(shape, read, axes, splits, n > 1 and not skip, exponent)

    def of_heads(self, shape: tuple[int, ...], heads: int, axis: int) -> BlockLayout:
        """This layout of one head's block as the layout of a tensor of ``shape`` holding ``heads``
        of them along ``axis`` (per-head Shampoo): its blocks repeated for each head."""
        splits = tuple(sizes * heads if a == axis else sizes for a, sizes in enumerate(self.splits))
        return dataclasses.replace(self, original=tuple(shape), shape=tuple(shape), splits=splits)

    def factor_sizes(self) -> list[int]:
        """The side of each factor, block by block (the first axis slowest), axis by axis."""
        if not self.preconditioned:
            return []
        return [d for block in itertools.product(*self.splits) for d, keep in zip(block, self.axes) if keep]


def _factor_itemsize(itemsize: int) -> int:
    return max(itemsize, 4)  # factors of bfloat16 params are float32 (Shampoo's; SOAP's are the param's)


@dataclass(frozen=True)
class Soap(RuleCost):
    """SOAP (`zero.functional.contrib.soap`): Adam's two moments (``slots``) for every param,
    and for each axis with a factor (`soap_axes`) its factor and eigenbasis, ``d x d`` each.
    A step rotates the gradient and the first moment into the bases and back (three products
    per axis) and gathers each factor (one); every ``precondition_frequency`` steps each basis
    is refreshed (a product and a QR, about ``(2 + 4/3) d^3``). Params with a factor are whole."""

    slots: int = 2
    max_precond_dim: int = 10000
    precondition_1d: bool = False
    precondition_frequency: int = 10
    # per-head SOAP: a param's name -> the heads its first axis is cut into, each with factors of its own
    heads: tuple[tuple[str, int], ...] = ()

    keeps_whole = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "heads", heads_by_name(self.heads))

    def heads_of(self, meta: ParamMeta) -> int:
        return heads_of(self.heads, meta)

    def sides(self, meta: ParamMeta) -> list[int]:
        """The factors' sides of one head's block (of the whole param without heads)."""
        h = self.heads_of(meta)
        block = (meta.shape[0] // h, *meta.shape[1:]) if meta.shape else ()
        return [d for d, keep in zip(block, soap_axes(block, self.max_precond_dim, self.precondition_1d)) if keep]

    def state_bytes(self, meta: ParamMeta, itemsize: int) -> int:
        factors = self.heads_of(meta) * sum(2 * d * d for d in self.sides(meta))
        return (self.slots * meta.numel + factors) * itemsize + self.scalar_bytes

    def whole(self, meta: ParamMeta) -> bool:
        return meta.requires_grad and bool(self.sides(meta))

    def step_flops(self, meta: ParamMeta) -> int:
        if not meta.requires_grad:
            return 0
        products = sum(4 * 2 * meta.numel * d for d in self.sides(meta))  # three rotations and a gather
        refresh = self.heads_of(meta) * sum(math.ceil(10 * d**3 / 3) for d in self.sides(meta)) \
            // self.precondition_frequency
        return products + refresh + meta.numel


@dataclass(frozen=True)
class Shampoo(RuleCost):
    """Shampoo (`zero.functional.contrib.shampoo`): its momentum and the graft's (``slots``,
    set from ``graft_type``: 3 with a diagonal graft, ``adagrad`` or ``rmsprop``), and for each factor of each block
    (`BlockLayout`) the factor and its inverse root, ``d x d`` each, at least float32. A step
    gathers each factor and multiplies by each root (``2 B d`` each, a block of ``B``
    elements); every ``preconditioning_compute_steps`` steps each root is an SVD (``22 d^3``)."""

    slots: int = 2
    block_size: int = 512
    shape_interpretation: bool = True
    preconditioner_type: str = "all"
    skip_preconditioning_rank_lt: int = 1
    no_preconditioning_for_layers_with_dim_gt: int = 8192
    preconditioning_compute_steps: int = 1000
    graft_type: str = "sgd"
    # per-head Shampoo: a param's name -> the heads its first axis is cut into, each blocked alone
    heads: tuple[tuple[str, int], ...] = ()

    keeps_whole = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "slots", 3 if self.graft_type in ("adagrad", "rmsprop") else 2)
        object.__setattr__(self, "heads", heads_by_name(self.heads))

    def heads_of(self, meta: ParamMeta) -> int:
        return heads_of(self.heads, meta)

    def layout(self, meta: ParamMeta) -> BlockLayout:
        """The rule's layout of ``meta``; with heads, each head's block laid out alone (its axes not
        merged) and repeated along the first axis, as the rule lays it out."""
        h, shape = self.heads_of(meta), tuple(meta.shape)
        head = h > 1 and shape and shape[0] % h == 0
        one = BlockLayout.of((shape[0] // h, *shape[1:]) if head else shape, self.block_size,
                             self.shape_interpretation and not head, self.preconditioner_type,
                             self.skip_preconditioning_rank_lt, self.no_preconditioning_for_layers_with_dim_gt)
        return one.of_heads(shape, h, 0) if head else one

    def state_bytes(self, meta: ParamMeta, itemsize: int) -> int:
        factors = sum(2 * d * d for d in self.layout(meta).factor_sizes())
        return self.slots * meta.numel * itemsize + factors * _factor_itemsize(itemsize) + self.scalar_bytes

    def whole(self, meta: ParamMeta) -> bool:
        return meta.requires_grad and self.layout(meta).preconditioned

    def step_flops(self, meta: ParamMeta) -> int:
        if not meta.requires_grad:
            return 0
        lay = self.layout(meta)
        blocks = [math.prod(b) for b in itertools.product(*lay.splits)] if lay.preconditioned else []
        per_block = sum(lay.axes)
        sides = lay.factor_sizes()
        products = sum(2 * 2 * blocks[i // per_block] * d for i, d in enumerate(sides))
        roots = sum(ROOT_FLOPS * d**3 for d in sides) // self.preconditioning_compute_steps
        return products + roots + meta.numel
