"""L-BFGS's preconditioning (mirrors ``optax.scale_by_lbfgs`` and ``ScaleByLBFGSState``): the
two-loop recursion over the last ``memory_size`` differences of params and gradients. Its inner
products are over the whole model, asked of `zero.functional.sharding` (`inner_products`: one small
all-reduce per product when sharded; the differences themselves are element-wise, so each rank
keeps its pieces' history)."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from zero.functional.base import GradientTransformation, highest_dtype, tree_leaves, tree_map, zeros_like
from zero.functional.foreach import traced
from zero.functional.sharding import inner_products

__all__ = ["ScaleByLBFGSState", "scale_by_lbfgs"]


class ScaleByLBFGSState(NamedTuple):
    """State of ``scale_by_lbfgs`` (``optax.ScaleByLBFGSState``).

    Fields:
        count: steps taken (0-d int32); params, updates: the last step's (like the params);
        diff_params_memory, diff_updates_memory: the last differences, each leaf stacked
        ``(memory_size, *shape)``; weights_memory: their ``1 / <dg, dx>``, shape ``(memory_size,)``.
    """

    count: torch.Tensor
    params: Any
    updates: Any
    diff_params_memory: Any
    diff_updates_memory: Any
    weights_memory: torch.Tensor


def scale_by_lbfgs(memory_size: int = 10, scale_init_precond: bool = True) -> GradientTransformation:
    r"""L-BFGS's direction (``optax.scale_by_lbfgs``): the updates preconditioned by the inverse
    Hessian estimate of the last ``memory_size`` steps' :math:`(\Delta x, \Delta g)`, scaled at
    first by :math:`\langle \Delta g, \Delta x\rangle / |\Delta g|^2` (``scale_init_precond``;
    the first step by :math:`\min(1, 1/|g|)`)."""
    if memory_size < 1:
        raise ValueError("memory_size must be >= 1")

    def init(params):
        stacked = tree_map(lambda p: torch.zeros((memory_size,) + tuple(p.shape), dtype=p.dtype), params)
        high = highest_dtype(params)
        return ScaleByLBFGSState(torch.zeros((), dtype=torch.int32), zeros_like(params), zeros_like(params), stacked,
                                 tree_map(torch.clone, stacked), torch.zeros(memory_size, dtype=high))

    def update(updates, state, params=None):
        if traced():
            raise RuntimeError("scale_by_lbfgs steps eagerly: its memory slot and inner products steer Python, which "
                               "torch.func and torch.compile cannot trace; step it outside them")
        count = int(state.count)
        idx, prev = count % memory_size, (count - 1) % memory_size
        gs, ps = tree_leaves(updates), tree_leaves(params)
        dx = [p - q for p, q in zip(ps, tree_leaves(state.params))]
        dg = [g - q for g, q in zip(gs, tree_leaves(state.updates))]
        if count == 0:
            dx, dg = [torch.zeros_like(x) for x in dx], [torch.zeros_like(x) for x in dg]
        dg_dx, dg_dg, g_g = inner_products((dg, dx), (dg, dg), (gs, gs))
        weight = 0.0 if count == 0 or float(dg_dx) == 0.0 else 1.0 / dg_dx
        mem_x, mem_g = _stored(state.diff_params_memory, dx, prev), _stored(state.diff_updates_memory, dg, prev)
        rhos = state.weights_memory.clone()
        rhos[prev] = weight
        if not scale_init_precond:
            gamma = 1.0
        elif count > 0:
            gamma = dg_dx / dg_dg if float(dg_dg) > 0.0 else 1.0
        else:
            gamma = torch.clamp(1.0 / torch.sqrt(g_g), max=1.0)
        out = _two_loops(gs, tree_leaves(mem_x), tree_leaves(mem_g), rhos, gamma, idx)
        new = ScaleByLBFGSState(torch.tensor(count + 1, dtype=torch.int32), tree_map(torch.clone, params),
                                tree_map(torch.clone, updates), mem_x, mem_g, rhos)
        return optree.tree_unflatten(optree.tree_structure(updates), out), new

    return GradientTransformation(init, update)


def _stored(memory: Any, diffs: list[torch.Tensor], at: int) -> Any:
    leaves, treedef = optree.tree_flatten(memory)
    out = [m.clone() for m in leaves]
    for m, d in zip(out, diffs):
        m[at] = d
    return treedef.unflatten(out)


def _two_loops(gs, mem_x, mem_g, rhos, gamma, idx) -> list[torch.Tensor]:
    """The two-loop recursion, newest difference first (Optax's order, from ``idx``)."""
    m = rhos.shape[0]
    order = [(idx + k) % m for k in range(m)]
    vec, alphas = list(gs), {}
    for i in reversed(order):
        (dot,) = inner_products(([x[i] for x in mem_x], vec))
        alphas[i] = rhos[i] * dot
        vec = [(v - alphas[i] * g[i]).to(v.dtype) for v, g in zip(vec, mem_g)]
    vec = [gamma * v for v in vec]
    for i in order:
        (dot,) = inner_products(([g[i] for g in mem_g], vec))
        beta = rhos[i] * dot
        vec = [(v + (alphas[i] - beta) * x[i]).to(v.dtype) for v, x in zip(vec, mem_x)]
    return vec
