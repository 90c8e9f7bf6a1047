"""Optax's other rescalings on torch tensors: sign, Yogi, NovoGrad, Adan, optimistic gradients
and the Polyak step (the aliases built on them are in `more_aliases`).

Each mirrors the Optax function of the same name formula for formula (same arguments, defaults
and state fields) and is proven equal to it by ``tests/test_functional_optax_parity.py``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import adam_family as A
from zero.functional import sharding
from zero.functional.base import (
    NO_PARAMS_MSG,
    EmptyState,
    GradientTransformation,
    Spec,
    as_dtype,
    count_inc,
    count_zero,
    full_like,
    tree_leaves,
    tree_map,
    zeros_like,
)
from zero.functional.elementwise import abs_sq, debias, moment
from zero.functional.packing import elementwise_map

__all__ = ["ScaleByOptimisticGradientState", "ScaleByNovogradState", "ScaleByAdanState",
           "scale_by_sign", "scale_by_optimistic_gradient", "scale_by_yogi", "scale_by_novograd",
           "scale_by_polyak", "scale_by_adan", "ScaleBySM3State", "scale_by_sm3"]


class ScaleByOptimisticGradientState(NamedTuple):
    """State of ``scale_by_optimistic_gradient`` (``optax.ScaleByOptimisticGradientState``).

    Fields:
        is_initial_step: 0-d bool, True until the first update.
        previous_gradient: the last updates seen, a pytree like the params.
    """

    is_initial_step: torch.Tensor
    previous_gradient: Any


class ScaleByNovogradState(NamedTuple):
    """State of ``scale_by_novograd`` (``optax.ScaleByNovogradState``).

    Fields:
        count: steps taken, 0-d int32.
        mu: first moment, a pytree like the params.
        nu: per-tensor second moment of the gradient norm, a 0-d tensor per param.
    """

    count: torch.Tensor
    mu: Any
    nu: Any


class ScaleByAdanState(NamedTuple):
    """State of ``scale_by_adan`` (``optax.ScaleByAdanState``).

    Fields:
        m: moment of the gradients; v: moment of their differences; n: moment of the squared
        Nesterov term; g: the last gradients (pytrees like the params); t: steps taken, 0-d int32.
    """

    m: Any
    v: Any
    n: Any
    g: Any
    t: torch.Tensor


def scale_by_sign() -> GradientTransformation:
    """The sign of each update (``optax.scale_by_sign``)."""
    return GradientTransformation(lambda params: EmptyState(), lambda u, s, p=None: (elementwise_map(torch.sign, u), s),
                                  spec=Spec("scale_by_sign", {}))


def scale_by_optimistic_gradient(alpha: float = 1.0, beta: float = 1.0) -> GradientTransformation:
    """``(alpha + beta) g_t - beta g_{t-1}`` (``g_0`` for ``g_{-1}``); ``optax.scale_by_optimistic_gradient``."""

    def init(params):
        return ScaleByOptimisticGradientState(torch.tensor(True), zeros_like(params))

    def update(updates, state, params=None):
        first = bool(state.is_initial_step)
        out = elementwise_map(lambda g, prev: (alpha + beta) * g - beta * (g if first else prev),
                       updates, state.previous_gradient)
        return out, ScaleByOptimisticGradientState(torch.tensor(False), updates)

    return GradientTransformation(init, update)


def scale_by_yogi(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-3, eps_root: float = 0.0,
                  initial_accumulator_value: float = 1e-6) -> GradientTransformation:
    """Yogi: Adam whose second moment moves by ``sign(v - g^2) g^2`` (``optax.scale_by_yogi``)."""
    A._check_betas(b1, b2, eps)

    def init(params):
        return A.ScaleByAdamState(count_zero(), full_like(params, initial_accumulator_value),
                                  full_like(params, initial_accumulator_value))

    def update(updates, state, params=None):
        mu = elementwise_map(lambda g, m: moment(g, m, b1, 1), updates, state.mu)
        nu = elementwise_map(lambda g, v: v - (1 - b2) * torch.sgn(v - abs_sq(g)) * abs_sq(g), updates, state.nu)
        count = count_inc(state.count)
        out = elementwise_map(lambda m, v: debias(m, b1, count) / (torch.sqrt(debias(v, b2, count) + eps_root) + eps),
                       mu, nu)
        return out, A.ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)


def scale_by_novograd(b1: float = 0.9, b2: float = 0.25, eps: float = 1e-8, eps_root: float = 0.0,
                      weight_decay: float = 0.0, mu_dtype: torch.dtype | str | None = None) -> GradientTransformation:
    """NovoGrad: a per-tensor second moment of the gradient's norm (``optax.scale_by_novograd``).

    ``nu = |g|^2`` at the first step, then ``b2 nu + (1 - b2) |g|^2``; ``mu = g / (sqrt(nu +
    eps_root) + eps) + weight_decay p`` at the first step, then ``b1 mu + `` that.
    """
    mu_dtype = as_dtype(mu_dtype, "mu_dtype")

    def init(params):
        return ScaleByNovogradState(count_zero(), zeros_like(params, mu_dtype),
                                    tree_map(lambda p: torch.zeros((), dtype=p.dtype, device=p.device), params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        sharding.whole_tensors(tree_leaves(updates), "scale_by_novograd")
        count = count_inc(state.count)
        first = int(count) == 1
        norms = tree_map(lambda g, n: (torch.linalg.vector_norm(g) ** 2).to(n.dtype), updates, state.nu)
        nu = norms if first else tree_map(lambda s, n: moment(s, n, b2, 1), norms, state.nu)
        step = tree_map(lambda g, p, n: g / (torch.sqrt(n + eps_root) + eps) + weight_decay * p, updates, params, nu)
        mu = step if first else tree_map(lambda m, s: b1 * m + s, state.mu, step)
        if mu_dtype is not None:
            mu = tree_map(lambda m: m.to(mu_dtype), mu)
        return mu, ScaleByNovogradState(count, mu, nu)

    return GradientTransformation(init, update)


def scale_by_polyak(f_min: float = 0.0, max_learning_rate: float = 1.0, eps: float = 0.0,
                    variant: str = "sps") -> GradientTransformation:
    """The Polyak step ``min((f - f_min) / (|g|^2 + eps), max_learning_rate)`` times the updates
    (``optax.scale_by_polyak``); ``update`` needs the objective's value as ``value=``.

    ``variant="sps+"`` uses the positive part of ``f - f_min``. An unknown variant is a
    ``ValueError`` here (Optax raises it at the first update).
    """
    if variant not in ("sps", "sps+"):
        raise ValueError(f"scale_by_polyak variant must be 'sps' or 'sps+', got {variant!r}")

    def update(updates, state, params=None, *, value, **extra_args):
        sq_norm = sharding.global_norm(tree_leaves(updates)) ** 2
        gap = torch.as_tensor(value - f_min).to(sq_norm.dtype)
        if variant == "sps+":
            gap = torch.relu(gap)
        denom = sq_norm + eps
        tiny = denom <= torch.finfo(sq_norm.dtype).eps
        step = torch.where(tiny, 0.0, torch.clamp(gap / denom, max=max_learning_rate))
        return elementwise_map(lambda g: step.to(g.dtype) * g, updates), state

    return GradientTransformation(lambda params: EmptyState(), update)


def scale_by_adan(b1: float = 0.98, b2: float = 0.92, b3: float = 0.99, eps: float = 1e-8,
                  eps_root: float = 0.0) -> GradientTransformation:
    """Adan: Adam-like moments of the gradients, of their differences and of the squared
    Nesterov term ``g + (1 - b2) (g - g_prev)`` (``optax.scale_by_adan``)."""

    def init(params):
        return ScaleByAdanState(zeros_like(params), zeros_like(params), zeros_like(params), zeros_like(params),
                                count_zero())

    def update(updates, state, params=None):
        first = int(state.t) == 0
        diff = elementwise_map(lambda g, prev: torch.zeros_like(g) if first else g - prev, updates, state.g)
        m = elementwise_map(lambda g, m: moment(g, m, b1, 1), updates, state.m)
        v = elementwise_map(lambda d, v: moment(d, v, b2, 1), diff, state.v)
        n = elementwise_map(lambda g, d, n: moment(g + (1 - b2) * d, n, b3, 2), updates, diff, state.n)
        t = count_inc(state.t)
        out = elementwise_map(lambda m, v, n: (debias(m, b1, t) + (1 - b2) * debias(v, b2, t))
                       / (torch.sqrt(debias(n, b3, t) + eps_root) + eps), m, v, n)
        return out, ScaleByAdanState(m, v, n, updates, t)

    return GradientTransformation(init, update)


class ScaleBySM3State(NamedTuple):
    """State of ``scale_by_sm3`` (``optax.ScaleBySM3State``).

    Fields:
        mu: per param, a list with one 1-D accumulator per axis (the maxima of the second moment
            over the other axes).
        nu: the momentum of the scaled updates, a pytree like the params.
    """

    mu: Any
    nu: Any


def _sm3_accumulate(g: torch.Tensor, covers: list[torch.Tensor], b2: float) -> torch.Tensor:
    """The second moment: ``g^2`` plus the smallest of the axes' covers (the cover itself for a vector)."""
    old_weight, new_weight = b2, (1.0 - b2) if b2 != 1.0 else 1.0
    shaped = [c.reshape([1] * i + [g.shape[i]] + [1] * (g.dim() - i - 1)) for i, c in enumerate(covers)]
    cover = shaped[0] if g.dim() < 2 else functools.reduce(torch.minimum, shaped)
    return new_weight * g * g + old_weight * cover


def _sm3_covers(accum: torch.Tensor) -> list[torch.Tensor]:
    """Per axis, the maxima of ``accum`` over the other axes (a vector's own values)."""
    if accum.dim() < 2:
        return [accum]
    return [accum.amax(dim=[d for d in range(accum.dim()) if d != i]) for i in range(accum.dim())]


def scale_by_sm3(b1: float = 0.9, b2: float = 1.0, eps: float = 1e-8) -> GradientTransformation:
    """SM3: a second moment kept as one accumulator per axis (memory ``sum`` of the dims, not
    their product), then momentum ``b1`` (``optax.scale_by_sm3``). Real params of at least one
    dimension, whole (not a flat plan's pieces)."""

    def init(params):
        for p in tree_leaves(params):
            if p.is_complex() or p.dim() == 0:
                raise ValueError(f"scale_by_sm3 needs real params of at least one dimension, got a {p.dtype} "
                                 f"param of shape {tuple(p.shape)}")
        mu = tree_map(lambda p: [torch.zeros(n, dtype=p.dtype, device=p.device) for n in p.shape], params)
        return ScaleBySM3State(mu, zeros_like(params))

    def update(updates, state, params=None):
        g_leaves, treedef = optree.tree_flatten(updates)
        sharding.whole_tensors(g_leaves, "scale_by_sm3")
        covers, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        accums = [_sm3_accumulate(g, c, b2) for g, c in zip(g_leaves, covers)]
        scaled = [g * torch.where(a > 0, torch.rsqrt(a + eps), 0.0) for g, a in zip(g_leaves, accums)]
        nu = [moment(u, n, b1, 1) for u, n in zip(scaled, nus)]
        unflat = lambda xs: optree.tree_unflatten(treedef, xs)
        return unflat(nu), ScaleBySM3State(unflat([_sm3_covers(a) for a in accums]), unflat(nu))

    return GradientTransformation(init, update)
