"""Mechanic: a learned scale for any base rule's steps (mirrors ``optax.contrib.mechanize`` and
``MechanicState``). Its scale reads norms and an inner product over the whole model: asked of
`zero.functional.sharding` (`total_sums`, the four sums in one all-reduce a step)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zero.functional.base import (
    NO_PARAMS_MSG,
    GradientTransformation,
    count_inc,
    count_zero,
    lowest_dtype,
    select,
    takes_extra_args,
    tree_leaves,
    tree_map,
    update_with,
)
from zero.functional.sharding import total_sums

__all__ = ["MechanicState", "mechanize"]


class MechanicState(NamedTuple):
    """State of ``mechanize`` (``optax.contrib.MechanicState``).

    Fields:
        base_optimizer_state: the base rule's; count: steps taken (0-d int32); r, m, v, s: the
        tuner's per-beta wealth, maxima, second moments and scales, shape ``(num_betas,)``;
        x0: the params at the first step.
    """

    base_optimizer_state: Any
    count: torch.Tensor
    r: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    s: torch.Tensor
    x0: Any


def mechanize(base_optimizer: GradientTransformation, weight_decay: float = 1e-2, eps: float = 1e-8,
              s_init: float = 1e-6, num_betas: int = 6) -> GradientTransformation:
    r"""Mechanic (``optax.contrib.mechanize``): the params move to :math:`x_0 + (\sum s)\,\Delta`,
    :math:`\Delta` the base rule's steps summed, with the scales :math:`s` tuned online by
    ``num_betas`` coin-betting learners.

    Reference: Cutkosky et al., Mechanic: A Learning Rate Tuner, 2023 (arXiv:2306.00144).
    """
    extra = takes_extra_args(base_optimizer)

    def init(params):
        dtype = lowest_dtype(params)
        zeros = torch.zeros(num_betas, dtype=dtype)
        start = tree_map(lambda p: p.detach().clone(), params)
        return MechanicState(base_optimizer.init(params), count_zero(), zeros, zeros.clone(), zeros.clone(),
                             torch.full((num_betas,), s_init, dtype=dtype), start)

    def update(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        steps, base_state = (update_with(base_optimizer, updates, state.base_optimizer_state, params, extra_args)
                             if extra else base_optimizer.update(updates, state.base_optimizer_state, params))
        x0 = select(state.count == 0, tree_map(lambda p: p.detach().clone(), params), state.x0)
        s_sum = state.s.sum()
        gs, ps = tree_leaves(updates), tree_leaves(params)
        delta_prev = [(x - p) / (s_sum + eps) for x, p in zip(tree_leaves(x0), ps)]
        g2, p2, g_d, p_d = total_sums([g * g for g in gs], [p * p for p in ps],
                                      [g * d for g, d in zip(gs, delta_prev)], [p * d for p, d in zip(ps, delta_prev)])
        dtype = state.s.dtype
        decay = weight_decay * s_sum * torch.sqrt(g2).to(dtype) / (torch.sqrt(p2).to(dtype) + eps)
        h = g_d.to(dtype) + decay * p_d.to(dtype)  # <g + decay p, delta_prev>, from the four sums
        clipped = torch.clamp(h, -state.m, state.m)
        betas = torch.tensor([1.0 - 0.1 ** b for b in range(1, num_betas + 1)], dtype=dtype)
        m = torch.maximum(betas * state.m, h.abs() + eps)
        v = betas ** 2 * state.v + h ** 2
        r = betas * state.r + clipped * state.s
        wealth = (s_init / num_betas) * m + torch.clamp(r, min=0.0)
        s = wealth / (torch.sqrt(v) + eps)
        total = s.sum()
        out = [x - total * (d - u) - p for x, d, u, p in zip(tree_leaves(x0), delta_prev, tree_leaves(steps), ps)]
        return (optree_like(updates, out),
                MechanicState(base_state, count_inc(state.count), r, m, v, s, x0))

    return GradientTransformation(init, update)


def optree_like(tree: Any, leaves: list) -> Any:
    import optree

    return optree.tree_unflatten(optree.tree_structure(tree), leaves)
