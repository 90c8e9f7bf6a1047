"""Elementwise maths the rules share: single-tensor formulas (Optax's numerics helpers) and
their fused forms over lists of tensors, for rules that run through `zero.functional.foreach`.

The list forms write fresh results (a rule is pure) in as few passes as torch's foreach ops
allow, modifying only their own temporaries in place, and only where autograd kept nothing
of them, so an update can still be differentiated through.
"""

from __future__ import annotations

import torch

from zero.functional.foreach import as_scalar_for, ops, traced

__all__ = ["abs_sq", "debias", "inv_root", "max_real", "moment", "moments", "nonzero", "plus_scaled", "same_dtypes",
           "sqrt", "times", "times_inv_root"]


def moment(g, m, decay, order):
    """``(1 - decay) * g**order + decay * m``; ``|g|**2`` for order 2, so complex updates give a
    real (zero imaginary part) second moment, as Optax's ``abs_sq``."""
    return (1 - decay) * (g if order == 1 else g * g.conj()) + decay * m


def abs_sq(x: torch.Tensor) -> torch.Tensor:
    """``|x|^2`` elementwise, real for complex ``x`` (Optax's ``numerics.abs_sq``)."""
    return (x * x.conj()).real if x.is_complex() else x * x


def max_real(a, b):
    """Elementwise maximum of moments that are real, or complex with zero imaginary parts."""
    return torch.maximum(a.real, b.real).to(torch.promote_types(a.dtype, b.dtype))


def debias(t, decay, count):
    """``t / (1 - decay^count)``; ``count`` a Python int, or a tensor (see `step_count`), whose
    correction is cast to ``t``'s dtype (as Optax casts it) rather than widening ``t``."""
    return t / as_scalar_for(1 - decay ** count, t)


def nonzero(x) -> bool:
    """Whether a term ``x`` must be computed: a number unless it is 0, a tensor always (its value
    may be traced, and a zero still has a gradient: Optax's ``eps_root`` for differentiating
    through ``sqrt``)."""
    return isinstance(x, torch.Tensor) or x != 0


def same_dtypes(*lists) -> bool:
    return all(len({t.dtype for t in ts}) == 1 for ts in zip(*lists))


def moments(gs, ms, decay, order):
    """`moment` over lists as fresh tensors, in fused passes when each pair shares a dtype:
    ``m + (1 - decay)(g - m)`` for order 1, ``decay m + (1 - decay) g conj(g)`` for order 2."""
    if not same_dtypes(gs, ms) or isinstance(decay, torch.Tensor):  # foreach ops take no tensor weight
        return [moment(g, m, decay, order) for g, m in zip(gs, ms)]
    if order == 1:
        return ops.lerp(ms, gs, 1 - decay)
    out = ops.mul(ms, decay)
    ops.addcmul_(out, gs, [g.conj() for g in gs], 1 - decay)
    return out


def plus_scaled(xs, ys, alpha, own=False):
    """``x + alpha y`` over lists, fresh: one pass when ``alpha`` is a number and each pair shares
    a dtype, else the formula tensor by tensor (Optax's promotion). ``own``: ``xs`` are the rule's
    temporaries, written in place when eager (under a transform ``ys`` may carry batch axes they lack)."""
    if isinstance(alpha, (int, float)) and same_dtypes(xs, ys):
        if own and not traced():
            ops.add_(xs, ys, alpha=alpha)
            return xs
        return ops.add(xs, ys, alpha=alpha)
    return [x + alpha * y for x, y in zip(xs, ys)]


def times(xs, factor, own):
    """``factor * x`` over a list: in place when ``own`` (a temporary of the rule), else fresh."""
    if not isinstance(factor, torch.Tensor) and factor == 1.0:
        return xs
    if own:
        ops.mul_(xs, factor)
        return xs
    return ops.mul(xs, factor)


def times_inv_root(gs, vs, eps, eps_in_sqrt):
    """``g / sqrt(v + eps)`` (``eps_in_sqrt``) or ``g / (sqrt(v) + eps)`` over lists, fresh."""
    if not same_dtypes(gs, vs):
        return [inv_root(v, eps, eps_in_sqrt) * g for g, v in zip(gs, vs)]
    if eps_in_sqrt:
        out = ops.add(vs, eps)
        ops.rsqrt_(out)
        return ops.mul(out, gs)  # fresh: rsqrt's backward keeps its result
    out = sqrt(vs)
    ops.add_(out, eps)
    return ops.div(gs, out)


def sqrt(xs):
    """``sqrt`` over a list, fresh. Real tensors take ``pow(x, 0.5)`` (the same numbers), whose
    backward keeps the input rather than the result, so a rule may scale the result in place and
    still be differentiated through (Optax's ``eps_root``)."""
    return ops.sqrt(xs) if any(x.is_complex() for x in xs) else ops.pow(xs, 0.5)


def inv_root(v, eps, eps_in_sqrt):
    return torch.rsqrt(v + eps) if eps_in_sqrt else 1 / (torch.sqrt(v) + eps)
