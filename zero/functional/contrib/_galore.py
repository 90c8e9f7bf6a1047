"""GaLore: the base rule stepped in a low-rank projection of each matrix's gradient (mirrors
``optax.contrib.galore``, ``scale_by_galore``, ``GaLoreState`` and ``GaLoreDimensionNumbers``). The
projection comes from an SVD of the whole matrix, so those params must be whole on the rank that
steps them: under a sharded optimizer they are kept whole (FSDP2 asks the rule, a hybrid plan
keeps them whole, ``needs_whole`` finds them), and a flat plan that cuts one is a ``ValueError``
naming it. Singular vectors are found up to sign; the base rules here are sign-equivariant (Adam,
SGD), so the steps are the same whichever sign the SVD returns."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import sharding
from zero.functional import transforms as T
from zero.functional.aliases import Mask, ScalarOrSchedule, alias
from zero.functional.base import GradientTransformation, count_inc, count_zero
from zero.functional.combine import chain

__all__ = ["GaLoreDimensionNumbers", "GaLoreState", "scale_by_galore", "galore"]


class GaLoreDimensionNumbers(NamedTuple):
    """Which axes of a param are the rows (``reduction_axis``) and columns (``output_axis``) of the
    matrix GaLore projects (``optax.contrib.GaLoreDimensionNumbers``)."""

    reduction_axis: Sequence[int] | int = 0
    output_axis: Sequence[int] | int = 1


class GaLoreState(NamedTuple):
    """State of ``scale_by_galore`` (``optax.contrib.GaLoreState``).

    Fields:
        count: steps taken (0-d int32); base_optimizer_state: the base rule's, over the low-rank
        gradients; projector: each matrix's projection (shape (0, 0) for params stepped as they are).
    """

    count: torch.Tensor
    base_optimizer_state: Any
    projector: Any


def _is_dims(x: Any) -> bool:
    """Dimension numbers: zero's, or any object with their two fields (Optax's own class)."""
    return x is None or (hasattr(x, "reduction_axis") and hasattr(x, "output_axis"))


def _reshapes(x: torch.Tensor, dims: GaLoreDimensionNumbers) -> tuple[Callable, Callable]:
    if x.dim() < 2:
        raise ValueError(f"GaLore requires tensors with rank >= 2, got shape {tuple(x.shape)}")
    red = (dims.reduction_axis,) if isinstance(dims.reduction_axis, int) else tuple(dims.reduction_axis)
    out = (dims.output_axis,) if isinstance(dims.output_axis, int) else tuple(dims.output_axis)
    red, out = tuple(a % x.dim() for a in red), tuple(a % x.dim() for a in out)
    if set(red) & set(out):
        raise ValueError(f"Reduction axes {red} and output axes {out} must be disjoint. Got dim_nums={dims} for shape "
                         f"{tuple(x.shape)}")
    if len(set(red) | set(out)) != x.dim():
        raise ValueError(f"All axes must be specified. Got reduction={red}, output={out} for tensor with {x.dim()} "
                         "dimensions")
    order = red + out
    inverse = tuple(sorted(range(x.dim()), key=lambda i: order[i]))
    rows, cols = math.prod(x.shape[a] for a in red), math.prod(x.shape[a] for a in out)
    shape = tuple(x.shape[a] for a in order)
    return (lambda y: y.permute(order).reshape(rows, cols)), (lambda y: y.reshape(shape).permute(inverse))


def scale_by_galore(rank: int = 128, update_proj_gap: int = 200, scale: float = 1.0,
                    base_optimizer: GradientTransformation | None = None,
                    weight_dimension_numbers: Any = None) -> GradientTransformation:
    """GaLore's projection around ``base_optimizer`` (``scale_by_adam`` by default;
    ``optax.contrib.scale_by_galore``): each matrix's gradient projected on its top ``rank``
    singular vectors (refreshed every ``update_proj_gap`` steps), the base rule stepped there, its
    update projected back and multiplied by ``scale``; other params go to the base rule as they are."""
    base = T.scale_by_adam() if base_optimizer is None else base_optimizer
    if not isinstance(rank, int):
        raise TypeError(f"`rank` must be an int, got {type(rank)}")
    if rank <= 0:
        raise ValueError(f"`rank` must be positive, got {rank}")

    def dims_of(tree: Any) -> Any:
        if weight_dimension_numbers is None:
            return optree.tree_map(lambda p: GaLoreDimensionNumbers() if p.dim() == 2 else None, tree)
        if callable(weight_dimension_numbers) and not _is_dims(weight_dimension_numbers):
            return weight_dimension_numbers(tree)
        if _is_dims(weight_dimension_numbers):
            return optree.tree_map(lambda p: weight_dimension_numbers if p.dim() >= 2 else None, tree)
        return weight_dimension_numbers

    def flat_dims(tree: Any) -> tuple[list, list, Any]:
        """The leaves, their dimension numbers, and the check that each projected matrix is whole
        here: by the whole tensors' shapes (a flat shard's 1-D pieces would read as vectors, and
        step element-wise: silently another rule), or, for dimension numbers chosen by a function
        or a tree, by refusing any cut tensor."""
        leaves, treedef = optree.tree_flatten(tree)
        what = "scale_by_galore (an SVD of each whole matrix)"
        if _is_dims(weight_dimension_numbers):
            exactly_2d = weight_dimension_numbers is None  # the default projects matrices; given numbers, rank >= 2
            sharding.whole_tensors(leaves, what, needs=lambda shape: len(shape) == 2 if exactly_2d else len(shape) >= 2)
        elif any(sharding.cut_tensors(leaves, what) or ()):
            cut = next(t for ts in sharding.cut_tensors(leaves, what) for t in ts)
            raise ValueError(f"{what} with weight_dimension_numbers chosen by a function or a tree reads each param's "
                             f"shape, but this sharded step holds pieces of param {sharding.name_of(cut)}: "
                             f"{sharding.whole_hint()}")
        dims = treedef.flatten_up_to(dims_of(tree)) if leaves else []
        return leaves, dims, treedef

    def init(params):
        leaves, dims, treedef = flat_dims(params)
        projectors, proxies = [], []
        for p, d in zip(leaves, dims):
            if d is None:
                projectors.append(torch.zeros((0, 0), dtype=p.dtype, device=p.device))
                proxies.append(torch.zeros_like(p))
                continue
            m, n = _reshapes(p, d)[0](p).shape
            r = min(rank, m, n)
            projectors.append(torch.zeros((m, r) if m >= n else (n, r), dtype=p.dtype, device=p.device))
            proxies.append(torch.zeros((r, n) if m >= n else (m, r), dtype=p.dtype, device=p.device))
        return GaLoreState(count_zero(), base.init(treedef.unflatten(proxies)), treedef.unflatten(projectors))

    def update(updates, state, params=None):
        refresh = int(state.count) % update_proj_gap == 0
        leaves, dims, treedef = flat_dims(updates)
        low, projectors = [], []
        for g, q, d in zip(leaves, treedef.flatten_up_to(state.projector), dims):
            if d is None:
                low.append(g)
                projectors.append(q)
                continue
            g2 = _reshapes(g, d)[0](g)
            m, n = g2.shape
            r = min(rank, m, n)
            if refresh:
                u, _, vh = torch.linalg.svd(g2.float(), full_matrices=False)
                q = (u[:, :r] if m >= n else vh[:r, :].T).to(g.dtype)
            projectors.append(q)
            low.append(q.T @ g2 if m >= n else g2 @ q)
        low_updates, base_state = base.update(treedef.unflatten(low), state.base_optimizer_state, None)
        out = []
        for u, q, g, d in zip(treedef.flatten_up_to(low_updates), projectors, leaves, dims):
            if d is None:
                out.append(u)
                continue
            m, n = _reshapes(g, d)[0](g).shape
            u = u.to(q.dtype)  # (a base rule may keep its moments, and so its updates, in another dtype)
            full = q @ u if m >= n else u @ q.T
            out.append((scale * _reshapes(g, d)[1](full)).to(g.dtype))
        return treedef.unflatten(out), GaLoreState(count_inc(state.count), base_state, treedef.unflatten(projectors))

    return GradientTransformation(init, update)


@alias
def galore(learning_rate: ScalarOrSchedule, rank: int = 128, update_proj_gap: int = 200, scale: float = 1.0,
           base_optimizer: GradientTransformation | None = None, weight_decay: float = 0.0, mask: Mask | None = None,
           weight_dimension_numbers: Any = None) -> GradientTransformation:
    """GaLore (``optax.contrib.galore``): ``chain(scale_by_galore, add_decayed_weights,
    scale_by_learning_rate)``.

    Reference: Zhao et al., GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
    Projection, 2024 (arXiv:2403.03507).
    """
    return chain(scale_by_galore(rank, update_proj_gap, scale, base_optimizer, weight_dimension_numbers),
                 T.add_decayed_weights(weight_decay, mask), T.scale_by_learning_rate(learning_rate))
