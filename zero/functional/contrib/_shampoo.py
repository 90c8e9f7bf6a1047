"""Shampoo: each tensor's gradient multiplied along every axis by the inverse root of that
axis' Kronecker factor, in blocks of large axes, its size grafted from a diagonal rule
(Gupta et al., 2018; Anil et al., Scalable Second Order Optimization for Deep Learning, 2020).

Mirrors ``pytorch_optimizer.ScalableShampoo`` (the port of Google's Scalable Shampoo) with its
roots by SVD (``use_svd=True``): its names with Optax's ``b1``/``b2``. The inverse roots are the
whole-matrix work (`zero.functional.contrib.kronecker.inverse_root`): a tensor with factors
belongs to one rank under a sharded optimizer, and ``optimizer="shampoo"`` plans balance it. How a
tensor is read (merged axes, blocks, factors) is `zero.plans.costs.kronecker.BlockLayout`, the
plans' own answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import sharding
from zero.functional import transforms as T
from zero.functional.aliases import ScalarOrSchedule, alias
from zero.functional.base import (
    GradientTransformation,
    Spec,
    check_non_negative,
    check_positive,
    check_unit,
    count_inc,
    count_zero,
    step_count,
    unscaled,
)
from zero.functional.combine import chain
from zero.functional.contrib import kronecker
from zero.functional.contrib.newton_schulz import (
    block_shape,
    first_axis_heads,
    head_axis,
    heads_of,
    join_heads,
    split_heads,
)
from zero.functional.foreach import foreach_map, traced
from zero.plans.costs.kronecker import BlockLayout

__all__ = ["ShampooState", "scale_by_shampoo", "shampoo", "GRAFTS", "PRECONDITIONER_TYPES"]

GRAFTS = ("none", "sgd", "adagrad", "rmsprop", "sqrtn")  # the size each update takes (its norm)
PRECONDITIONER_TYPES = ("all", "input", "output")  # the axes that get factors


class ShampooState(NamedTuple):
    """State of ``scale_by_shampoo``.

    Fields:
        count: steps taken, 0-d int32.
        momentum: the momentum of the preconditioned gradients, a tree like the params.
        graft_statistics: the graft's second moment (``adagrad``, ``rmsprop``), a tree like the
            params (empty tensors for the other grafts).
        graft_momentum: the graft's momentum, a tree like the params.
        statistics: per param, the factors of its blocks (block by block, axis by axis), a tuple
            at each leaf (empty for a param with none).
        preconditioners: each factor's inverse root, laid out as ``statistics``.
    """

    count: torch.Tensor
    momentum: Any
    graft_statistics: Any
    graft_momentum: Any
    statistics: Any
    preconditioners: Any


def _blocks(layout: BlockLayout, x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` (in the original shape) read in the layout's shape and cut into its blocks, in order."""
    parts = [x.reshape(layout.shape)]
    for axis, sizes in enumerate(layout.splits):
        if len(sizes) > 1:
            parts = [piece for part in parts for piece in torch.split(part, list(sizes), dim=axis)]
    return parts


def _joined(layout: BlockLayout, parts: list[torch.Tensor]) -> torch.Tensor:
    """The blocks back as one tensor in the original shape."""
    for axis in reversed(range(len(layout.splits))):
        n = len(layout.splits[axis])
        if n > 1:
            parts = [torch.cat(parts[i:i + n], dim=axis) for i in range(0, len(parts), n)]
    return parts[0].reshape(layout.original)


def _preconditioned(layout: BlockLayout, g: torch.Tensor, roots: tuple) -> torch.Tensor:
    """``g`` block by block, each axis with a factor multiplied by its root (axes taken first
    and moved last, so the block keeps its shape)."""
    rank, out = sum(layout.axes), []
    for i, block in enumerate(_blocks(layout, g.to(roots[0].dtype))):
        mine = iter(roots[i * rank:(i + 1) * rank])
        if layout.axes == (True, True):  # a matrix with both factors: L^T B R, two products
            out.append(torch.mm(torch.mm(next(mine).T, block), next(mine)))
            continue
        for keep in layout.axes:
            block = torch.tensordot(block, next(mine), dims=[[0], [0]]) if keep else block.permute(
                [*range(1, block.ndim), 0])
        out.append(block)
    return _joined(layout, out).to(g.dtype)


def _gathered(layout: BlockLayout, g: torch.Tensor, stats: tuple, b2: float, own: bool) -> tuple:
    w2 = 1.0 if b2 == 1.0 else 1 - b2
    blocks = _blocks(layout, g.to(stats[0].dtype))
    axes = [(block, a) for block in blocks for a, keep in enumerate(layout.axes) if keep]
    return tuple(kronecker.factor_updated(s, block, a, b2, w2, into=own) for s, (block, a) in zip(stats, axes))


def _scaled(x: torch.Tensor, scale: torch.Tensor, d: Any, own: bool) -> torch.Tensor:
    """``x`` times its graft scale: one for the tensor, or one per head's block. ``x`` is a
    fresh direction of this step: written in place in an owned step (no autograd there)."""
    if heads_of(d) == 1:
        return x.mul_(scale) if own else x * scale
    return join_heads(split_heads(x, d) * scale, d)


def _plus(t: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``t + other``, into ``t`` (a temporary of the caller's: no fresh buffer for each sum of
    packed leaves); out of place under a transform, where ``t`` may have fewer batch axes."""
    return t + other if traced() else t.add_(other)


def _times(t: torch.Tensor, c: float, own: bool) -> torch.Tensor:
    """``t * c``: into ``t`` when the step owns it (a state given up: the same bits, no fresh memory),
    else always fresh, even for ``c = 1`` (``b2`` may be 1), where `elementwise.times` returns its
    input: its callers then write into the result."""
    return t.mul_(c) if own else t * c


def _plus_squares(t: torch.Tensor, g: torch.Tensor, c: float, into: bool) -> torch.Tensor:
    """``t + c g^2`` (one ``addcmul``), into ``t`` when ``into``."""
    return t.addcmul_(g, g, value=c) if into else torch.addcmul(t, g, g, value=c)


def _over_root(g: torch.Tensor, s: torch.Tensor, eps: float) -> torch.Tensor:
    """``g / (sqrt(s) + eps)``, the root, the sum and the quotient in one temporary when eager
    without autograd (the same numbers, one fresh tensor instead of three)."""
    if traced() or torch.is_grad_enabled():
        return g / (s.sqrt() + eps)
    den = s.sqrt().add_(eps)
    return torch.div(g, den, out=den)


def _grafts(kind: str, gs: list[torch.Tensor], seconds: list[torch.Tensor], b2: float, eps: float,
            own: bool) -> tuple:
    """The graft's second moments after ``gs``, and its directions: every leaf at once, small
    leaves packed once (`foreach_map`: a few kernels for hundreds of small matrices, the same
    elementwise operations as one leaf at a time). ``own``: the moments written into their
    old tensors."""
    if kind not in ("adagrad", "rmsprop"):
        return seconds, [g.sign() for g in gs] if kind == "sqrtn" else list(gs)

    def second(g, s):
        if kind == "adagrad":
            return _plus_squares(s, g, 1.0, into=own)
        return _plus_squares(_times(s, b2, own), g, 1 - b2, into=not traced())  # s * b2 is fresh when not own

    def both(gs, seconds):
        seconds = [second(g, s) for g, s in zip(gs, seconds)]
        return seconds, [_over_root(g, s, eps) for g, s in zip(gs, seconds)]
    return foreach_map(both, gs, seconds, outputs=2)


def scale_by_shampoo(b1: float = 0.9, b2: float = 0.999, *, moving_average_for_momentum: bool = False,
                     weight_decay: float = 0.0, start_preconditioning_step: int = 25,
                     preconditioning_compute_steps: int = 1000, statistics_compute_steps: int = 1,
                     block_size: int = 512, inverse_exponent_override: int = 0,
                     skip_preconditioning_rank_lt: int = 1, no_preconditioning_for_layers_with_dim_gt: int = 8192,
                     shape_interpretation: bool = True, graft_type: str = "sgd", preconditioner_type: str = "all",
                     nesterov: bool = True, diagonal_eps: float = 1e-10, matrix_eps: float = 1e-6,
                     weight_dimension_numbers: Any = None) -> GradientTransformation:
    r"""Shampoo's direction, grafted (``pytorch_optimizer.ScalableShampoo``'s step, the learning
    rate taken out: see `shampoo`).

    Per tensor, read in a shape whose small axes are merged (``shape_interpretation``) and cut
    into blocks of ``block_size`` along each axis, each block ``B`` keeps for each axis ``a`` a
    factor ``L_a <- b2 L_a + (1 - b2) B_(a) B_(a)^T`` (from ``matrix_eps I``, every
    ``statistics_compute_steps`` steps) and its inverse root ``L_a^{-1/e}`` (``e``: twice the
    axes with factors, or ``inverse_exponent_override``; every ``preconditioning_compute_steps``
    steps, by SVD; the identity before). The preconditioned gradient is rescaled to the norm of
    the graft's direction (``graft_type``: ``"sgd"``, ``"adagrad"``, ``"rmsprop"``,
    ``"sqrtn"`` its sign, ``"none"``), a (nesterov) momentum of it is taken, and before
    ``start_preconditioning_step`` the graft's own momentum steps instead.

    Args:
        b1: the momentum's decay; b2: the factors' and the RMSProp graft's.
        moving_average_for_momentum: an average (``lerp``) rather than a sum of past directions.
        weight_decay: coupled decay, added to both directions (``shampoo`` adds a decoupled one).
        start_preconditioning_step, preconditioning_compute_steps, statistics_compute_steps: when.
        block_size: the largest block side (and the merged axes' largest product).
        inverse_exponent_override: the root's exponent (0: twice the factored axes).
        skip_preconditioning_rank_lt, no_preconditioning_for_layers_with_dim_gt: tensors of fewer
            axes, or with a longer one, step by the graft alone.
        shape_interpretation: merge small neighbouring axes first.
        graft_type, preconditioner_type (``"all"``, ``"input"``: all axes but the last,
            ``"output"``: the last), nesterov, diagonal_eps (the graft's), matrix_eps (the factors'
            start).
        weight_dimension_numbers: which leaves are preconditioned, by name as Muon's (a tree
            of `zero.functional.contrib.MuonDimensionNumbers` with None for the leaves the graft
            alone steps, or a function of the params returning one): embeddings and heads as the
            user says. Shampoo reads only whether a leaf is labelled; its axes are merged and
            blocked by its own layout; with ``heads`` each head's block of the output axis is a
            param of its own (Distributed Shampoo's ``head_split_size``: its blocks, factors and
            graft norm per head, its axes not merged). ``None``: every leaf by its layout.

    Returns:
        A transformation with state `ShampooState`. A tensor with factors must be whole; the
        others step element by element (their graft norms over every rank's pieces).
    """
    check_unit("b1", b1)
    check_unit("b2", b2, closed=True)
    for name, value in (("weight_decay", weight_decay), ("diagonal_eps", diagonal_eps), ("matrix_eps", matrix_eps)):
        check_non_negative(name, value)
    for name, value in (("start_preconditioning_step", start_preconditioning_step),
                        ("preconditioning_compute_steps", preconditioning_compute_steps),
                        ("statistics_compute_steps", statistics_compute_steps)):
        check_positive(name, value)
    if graft_type not in GRAFTS:
        raise ValueError(f"unknown graft_type {graft_type!r}; choose one of {GRAFTS}")
    if preconditioner_type not in PRECONDITIONER_TYPES:
        raise ValueError(f"unknown preconditioner_type {preconditioner_type!r}; choose one of {PRECONDITIONER_TYPES}")
    w = 1 - b1 if moving_average_for_momentum else 1.0

    def layout(shape) -> BlockLayout:
        return BlockLayout.of(tuple(shape), block_size, shape_interpretation, preconditioner_type,
                                skip_preconditioning_rank_lt, no_preconditioning_for_layers_with_dim_gt,
                                inverse_exponent_override)

    def head_layout(shape, d) -> BlockLayout:
        """A layout of whole heads: a head's block laid out as a tensor of its own (its axes not
        merged), its blocks repeated for each head along the output axis."""
        one = BlockLayout.of(block_shape(shape, d), block_size, False, preconditioner_type,
                             skip_preconditioning_rank_lt, no_preconditioning_for_layers_with_dim_gt,
                             inverse_exponent_override)
        return one.of_heads(shape, heads_of(d), head_axis(len(shape), d))

    def layouts(tree, leaves) -> list[BlockLayout]:
        """Per leaf, its layout; without factors where ``weight_dimension_numbers`` labels it None,
        by heads where it gives heads."""
        named = kronecker.labels(weight_dimension_numbers, tree, leaves, "weight_dimension_numbers")
        if named is None:
            return [layout(p.shape) for p in leaves]
        return [dataclasses.replace(layout(p.shape), preconditioned=False) if d is None else
                head_layout(p.shape, d) if heads_of(d) > 1 else layout(p.shape) for p, d in zip(leaves, named)]

    def graft_scales(graft_dirs, shampoo_dirs, dims):
        """Each direction's size set to its graft's: per tensor, or per head where there are heads
        (a head is a param of its own, and the tensor is whole: it has factors)."""
        norms = zip(sharding.tensor_norms(graft_dirs), sharding.tensor_norms(shampoo_dirs))
        scales = [a / (b + 1e-16) for a, b in norms]
        for j, d in enumerate(dims):
            if heads_of(d) > 1:
                graft, own = (split_heads(x, d).reshape(heads_of(d), -1).norm(dim=1)
                              for x in (graft_dirs[j], shampoo_dirs[j]))
                per = graft / (own + 1e-16)
                scales[j] = per.view(-1, *[1] * graft_dirs[j].ndim)
        return scales

    def init(params):
        leaves, treedef = optree.tree_flatten(params)

        lays = layouts(params, leaves)

        def eyes(p, scale, lay):
            dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            return tuple(scale * torch.eye(d, dtype=dtype, device=p.device) for d in lay.factor_sizes())

        diag = graft_type in ("adagrad", "rmsprop")
        return ShampooState(
            count_zero(), treedef.unflatten([torch.zeros_like(p) for p in leaves]),
            treedef.unflatten([torch.zeros_like(p) if diag else p.new_zeros(0) for p in leaves]),
            treedef.unflatten([torch.zeros_like(p) for p in leaves]),
            treedef.unflatten([eyes(p, matrix_eps, lay) for p, lay in zip(leaves, lays)]),
            treedef.unflatten([eyes(p, 1.0, lay) for p, lay in zip(leaves, lays)]))

    def update(updates, state, params=None):
        return step(updates, state, params, own=False)

    def given_up(updates, state, params=None):
        return step(updates, state, params, own=not traced())

    def step(updates, state, params, own):
        """``update``; ``own``: the new state written into ``state``'s tensors (`GradientTransformation.owned`)."""
        leaves, treedef = optree.tree_flatten(updates)
        lays = layouts(updates, leaves)
        # by default asked of each whole tensor's shape (a flat piece of a matrix is 1-D); by name, per leaf
        needs = (lambda shape: layout(shape).preconditioned) if weight_dimension_numbers is None else \
            [lay.preconditioned for lay in lays]
        sharding.whole_tensors(leaves, "scale_by_shampoo (Kronecker factors of whole tensors)", needs=needs)
        sharding.reads_heads(leaves, list(map(first_axis_heads, leaves, _dims(updates, leaves))))  # for a plan's costs
        if weight_decay and params is None:
            raise ValueError("scale_by_shampoo with weight_decay needs the params (update(updates, state, params))")
        t = step_count(state.count) + 1  # this step, from 1
        when = _when(t)
        cols = [treedef.flatten_up_to(x) for x in (state.graft_statistics, state.statistics, state.preconditioners)]
        ps = treedef.flatten_up_to(params) if weight_decay else [None] * len(leaves)
        seconds, graft_dirs = _grafts(graft_type, leaves, cols[0], b2, diagonal_eps, own)
        firsts = [_directions(g, graft_dir, stats, roots, when, lay, own) for g, graft_dir, stats, roots, lay in zip(
            leaves, graft_dirs, *cols[1:], lays)]
        shampoo_dirs = [f[0] for f in firsts]
        if graft_type != "none":
            dims = _dims(updates, leaves)
            scales = graft_scales(graft_dirs, shampoo_dirs, dims)
            shampoo_dirs = [_scaled(x, sc, d, own) for x, sc, d in zip(shampoo_dirs, scales, dims)]
        if weight_decay:
            shampoo_dirs = [d + weight_decay * p for d, p in zip(shampoo_dirs, ps)]
            graft_dirs = [d + weight_decay * p for d, p in zip(graft_dirs, ps)]
        # the element-wise rest for every leaf at once, small leaves packed once (as the graft's)
        out, moms, graft_moms = foreach_map(lambda *lists: _momenta(*lists, when[2], own), treedef.flatten_up_to(
            state.momentum), treedef.flatten_up_to(state.graft_momentum), shampoo_dirs, graft_dirs, outputs=3)
        return treedef.unflatten(out), ShampooState(
            count_inc(state.count), treedef.unflatten(moms), treedef.unflatten(seconds),
            treedef.unflatten(graft_moms), treedef.unflatten([f[1] for f in firsts]),
            treedef.unflatten([f[2] for f in firsts]))

    def _dims(tree, leaves) -> list:
        found = kronecker.labels(weight_dimension_numbers, tree, leaves, "weight_dimension_numbers")
        return [None] * len(leaves) if found is None else found

    def _when(t):
        """(gather the factors, compute their roots, precondition): bools eager, tensors traced."""
        if isinstance(t, int):
            return t % statistics_compute_steps == 0, t % preconditioning_compute_steps == 0, \
                t >= start_preconditioning_step
        return (torch.remainder(t, statistics_compute_steps) == 0,
                torch.remainder(t, preconditioning_compute_steps) == 0, t >= start_preconditioning_step)

    def _directions(g, graft_dir, stats, roots, when, lay, own):
        """The (ungrafted) preconditioned direction and the factors' new state."""
        gather, compute, _ = when
        if not lay.preconditioned:
            return graft_dir.clone(), stats, roots
        if gather is not False:
            stats = kronecker.pick(gather, _gathered(lay, g, stats, b2, own), stats)
        if compute is not False:
            roots = kronecker.pick(compute, tuple(kronecker.inverse_root(s, lay.exponent) for s in stats), roots)
        return _preconditioned(lay, g, roots), stats, roots

    def _momenta(ms, gms, shampoo_dirs, graft_dirs, preconditioning, own):
        """The updates, the momentum and the graft's momentum, leaf by leaf (packed)."""
        moms = [_momentum(m, d, own) for m, d in zip(ms, shampoo_dirs)]
        graft_moms = [_plus(_times(gm, b1, own), d if w == 1.0 else d * w) for gm, d in zip(gms, graft_dirs)]
        return [_step(*x, preconditioning) for x in zip(moms, graft_moms, shampoo_dirs, graft_dirs)], moms, graft_moms

    def _momentum(m, d, own):
        if moving_average_for_momentum:
            return m.lerp_(d, w) if own else torch.lerp(m, d, w)
        return _plus(_times(m, b1, own), d)

    def _step(mom, graft_mom, shampoo_dir, graft_dir, preconditioning):
        update = kronecker.pick(preconditioning, mom, graft_mom)
        if nesterov:
            last = kronecker.pick(preconditioning, shampoo_dir, graft_dir)
            update = torch.lerp(update, last, w) if moving_average_for_momentum else _plus(update * b1, last)
        return update

    spec = Spec("scale_by_shampoo", {
        "b1": b1, "b2": b2, "moving_average_for_momentum": moving_average_for_momentum, "weight_decay": weight_decay,
        "start_preconditioning_step": start_preconditioning_step,
        "preconditioning_compute_steps": preconditioning_compute_steps,
        "statistics_compute_steps": statistics_compute_steps, "block_size": block_size,
        "inverse_exponent_override": inverse_exponent_override,
        "skip_preconditioning_rank_lt": skip_preconditioning_rank_lt,
        "no_preconditioning_for_layers_with_dim_gt": no_preconditioning_for_layers_with_dim_gt,
        "shape_interpretation": shape_interpretation, "graft_type": graft_type,
        "preconditioner_type": preconditioner_type, "nesterov": nesterov, "diagonal_eps": diagonal_eps,
        "matrix_eps": matrix_eps, "weight_dimension_numbers": weight_dimension_numbers})
    return GradientTransformation(init, update, spec=spec, owned=unscaled(given_up))


@alias
def shampoo(learning_rate: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999, weight_decay: float = 0.0,
            decoupled_weight_decay: bool = False, *, moving_average_for_momentum: bool = False,
            start_preconditioning_step: int = 25, preconditioning_compute_steps: int = 1000,
            statistics_compute_steps: int = 1, block_size: int = 512, inverse_exponent_override: int = 0,
            skip_preconditioning_rank_lt: int = 1, no_preconditioning_for_layers_with_dim_gt: int = 8192,
            shape_interpretation: bool = True, graft_type: str = "sgd", preconditioner_type: str = "all",
            nesterov: bool = True, diagonal_eps: float = 1e-10, matrix_eps: float = 1e-6,
            weight_dimension_numbers: Any = None) -> GradientTransformation:
    """Shampoo (`scale_by_shampoo`), its weight decay coupled or decoupled, times the learning rate.

    Equals ``pytorch_optimizer.ScalableShampoo(params, lr, betas=(b1, b2), ..., use_svd=True)``
    with its other settings of the same names (``graft_type`` and ``pre_conditioner_type`` by
    name here: ``LayerWiseGrafting.RMSPROP`` is ``"rmsprop"``). The reference's other root, a
    coupled Schur-Newton iteration started from a random power iteration, is not offered; nor is
    ``decoupled_learning_rate=False`` (the learning rate inside the directions).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.shampoo(0.1, block_size=4, shape_interpretation=False)
        >>> state = tx.init({"w": torch.zeros(6, 8)})
        >>> [f.shape[0] for f in state[0].statistics["w"]]  # blocks of rows 4 and 2 by columns 4 and 4, 2 factors each
        [4, 4, 4, 4, 2, 4, 2, 4]
    """
    direction = scale_by_shampoo(
        b1, b2, moving_average_for_momentum=moving_average_for_momentum,
        weight_decay=0.0 if decoupled_weight_decay else weight_decay,
        start_preconditioning_step=start_preconditioning_step,
        preconditioning_compute_steps=preconditioning_compute_steps, statistics_compute_steps=statistics_compute_steps,
        block_size=block_size, inverse_exponent_override=inverse_exponent_override,
        skip_preconditioning_rank_lt=skip_preconditioning_rank_lt,
        no_preconditioning_for_layers_with_dim_gt=no_preconditioning_for_layers_with_dim_gt,
        shape_interpretation=shape_interpretation, graft_type=graft_type, preconditioner_type=preconditioner_type,
        nesterov=nesterov, diagonal_eps=diagonal_eps, matrix_eps=matrix_eps,
        weight_dimension_numbers=weight_dimension_numbers)
    return chain(direction, T.add_decayed_weights(weight_decay if decoupled_weight_decay else 0.0),
                 T.scale_by_learning_rate(learning_rate))

