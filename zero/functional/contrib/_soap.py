"""SOAP: Adam in the eigenbasis of Shampoo's Kronecker factors (named and shaped as Optax's
SOAP pull request, google-deepmind/optax#1617: ``soap``, ``scale_by_soap``, ``SoapState``).

Each preconditioned axis of a tensor keeps a factor ``GG`` (an exponential average of the
gradient's Gram matrix along that axis) and its eigenbasis ``Q``; the gradient is rotated into
the bases, Adam runs there, and the update is rotated back. The bases are found by ``eigh`` at
the first step and refreshed every ``precondition_frequency`` steps by one power iteration and
QR (`zero.functional.contrib.kronecker`). Both need each preconditioned tensor whole: under a
sharded optimizer it belongs to one rank (a whole-param or hybrid plan, FSDP2's owner path),
and ``optimizer="soap"`` plans balance that work (`zero.plans.costs.Soap`).
"""

from __future__ import annotations

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
)
from zero.functional.combine import chain
from zero.functional.contrib import kronecker
from zero.functional.contrib.newton_schulz import block_shape, first_axis_heads, heads_of, join_heads, split_heads
from zero.functional.elementwise import plus_scaled, times
from zero.functional.foreach import PACK_NUMEL, foreach_map, traced
from zero.plans.costs.kronecker import soap_axes

__all__ = ["SoapState", "scale_by_soap", "soap", "decay_after_update"]


def _matrices(leaves: list, gg: list, dims: list) -> list[list[int]]:
    """The leaves `scale_by_soap` steps as batches: small matrices (up to `PACK_NUMEL` elements,
    where a step's time is its per-matrix calls; larger ones step as fast alone) with both factors
    and no heads, by shape, dtype and device (each list in the leaves' order)."""
    out: dict = {}
    for i, (p, f, d) in enumerate(zip(leaves, gg, dims)):
        if p.ndim == 2 and p.numel() <= PACK_NUMEL and heads_of(d) == 1 and f[0].numel() and f[1].numel():
            out.setdefault((tuple(p.shape), p.dtype, p.device), []).append(i)
    return list(out.values())


def _stacked(ts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(ts)``: a view when they lie back to back in one storage (the batch a step
    returned: the state stays packed from step to step, as `zero.functional.foreach` packs small
    leaves), else a copy."""
    head = ts[0]
    step, at = head.numel() * head.element_size(), head.data_ptr()
    if head.is_contiguous() and all(t.data_ptr() == at + k * step and t.is_contiguous() and t.shape == head.shape
                                    and t.dtype == head.dtype for k, t in enumerate(ts)):
        try:  # (beyond head's storage: not one batch after all)
            return head.as_strided((len(ts), *head.shape), (head.numel(), *head.stride()))
        except RuntimeError:
            pass
    return torch.stack(ts)


class SoapState(NamedTuple):
    """State of ``scale_by_soap`` (the fields of Optax's PR).

    Fields:
        count: steps taken, 0-d int32.
        exp_avg: the first moment, in the params' own coordinates, a tree like the params.
        exp_avg_sq: the second moment, in the eigenbasis, a tree like the params.
        gg: per param, one factor per axis (a square matrix; an empty tensor for an axis left as
            it is), a tree like the params with a tuple at each leaf.
        q: per param, each factor's eigenbasis, laid out as ``gg``.
    """

    count: torch.Tensor
    exp_avg: Any
    exp_avg_sq: Any
    gg: Any
    q: Any


def _empty(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(0, dtype=like.dtype, device=like.device)


def _gathered(g: torch.Tensor, gg: tuple, shampoo_beta: float) -> tuple:
    """Each factor moved towards the gradient's Gram matrix along its axis (a ``lerp``, as
    pytorch_optimizer's: a factor of one rank, a vector's first, has an arbitrary eigenbasis
    beyond its first vector, which rounding of another sum order would pick differently)."""
    return tuple(_lerp(f, kronecker.factor_of(g, a).to(f.dtype), 1 - shampoo_beta) if f.numel() else f
                 for a, f in enumerate(gg))


def _lerp(start: torch.Tensor, fresh: torch.Tensor, weight: float) -> torch.Tensor:
    """``torch.lerp(start, fresh, weight)``, written into ``fresh`` (a temporary the caller made,
    never a tensor it was given) when eager without autograd: the same numbers, one tensor fewer
    to allocate and write through fresh memory (three of SOAP's four moving averages a matrix)."""
    if traced() or torch.is_grad_enabled():
        return torch.lerp(start, fresh, weight)
    return torch.lerp(start, fresh, weight, out=fresh)


def _squared(fresh: torch.Tensor) -> torch.Tensor:
    """``fresh.square()``, in place when eager without autograd (``fresh`` a temporary, as `_lerp`'s)."""
    return fresh.square() if traced() or torch.is_grad_enabled() else fresh.square_()


def _first_moment(mu: torch.Tensor, g: torch.Tensor, b1: float, own: bool) -> torch.Tensor:
    """Adam's first moment after ``g``; written into ``mu`` when the step owns it (the same bits)."""
    return mu.lerp_(g, 1 - b1) if own else torch.lerp(mu, g, 1 - b1)


def _adam_in_basis(g, mu, nu, q, b1, b2, eps, scale, own):
    """Adam's moments (the first in the params' coordinates, the second in the basis) and its
    direction rotated back, times ``scale`` (the bias corrections)."""
    mu = _first_moment(mu, g, b1, own)
    if traced() or torch.is_grad_enabled() or not any(b.numel() for b in q):
        nu = torch.lerp(nu, kronecker.rotate(g, q).square(), 1 - b2)
        direction = kronecker.rotate(kronecker.rotate(mu, q) / (nu.sqrt() + eps), q, back=True)
        return direction * scale, mu, nu
    # eager and without autograd, and each rotation a product of its own (some basis is not
    # empty): the square, the average, the quotient and the scaling made in the temporaries
    # that hold them (with no basis a rotation is a view of the gradient)
    nu = _lerp(nu, _squared(kronecker.rotate(g, q)), 1 - b2)
    direction = kronecker.rotate(kronecker.rotate(mu, q).div_(nu.sqrt().add_(eps)), q, back=True)
    return direction.mul_(scale), mu, nu


def _refreshed(gg: tuple, q: tuple, nu: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """Each basis refreshed towards its factor, the second moment permuted with its columns."""
    bases = []
    for axis, (f, b) in enumerate(zip(gg, q)):
        if f.numel():
            b, order = kronecker.refreshed_basis(f, b)
            nu = nu.index_select(axis, order)
        bases.append(b)
    return tuple(bases), nu


def scale_by_soap(b1: float = 0.95, b2: float = 0.95, shampoo_beta: float = -1, eps: float = 1e-8,
                  precondition_frequency: int = 10, max_precond_dim: int = 10000, precondition_1d: bool = False,
                  weight_dimension_numbers: Any = None) -> GradientTransformation:
    r"""SOAP's rescaling: Adam in the eigenbasis of each tensor's Kronecker factors.

    .. math::
        L_a \leftarrow \beta_s L_a + (1 - \beta_s) G_{(a)} G_{(a)}^T, \quad
        \tilde g = g \times_a Q_a^T, \quad
        u = \Big(\frac{\widetilde{m}}{\sqrt{v} + \epsilon}\Big) \times_a Q_a
        \cdot \frac{\sqrt{1 - b_2^{t}}}{1 - b_1^{t}}

    with ``m`` Adam's first moment of ``g`` (rotated each step: ``\widetilde m = m \times_a Q_a^T``)
    and ``v`` its second of ``\tilde g``. As the authors' algorithm (and ``pytorch_optimizer.SOAP``,
    which this equals in float64):

    - the first step only gathers the factors and finds their bases: its update is zero and the
      moments stay zero; the bias corrections then count from the second step (``t = count - 1``);
    - the factors take the step's gradient after the update, and every ``precondition_frequency``
      steps the bases are refreshed by one power iteration and a QR in float32, their columns
      sorted by the estimated eigenvalues and the second moment permuted with them.

    Args:
        b1, b2: Adam's decays, in [0, 1).
        shampoo_beta: the factors' decay; negative: ``b2``.
        eps: added to the square root of the second moment.
        precondition_frequency: steps between refreshes of the bases.
        max_precond_dim: longer axes keep no factor (rotated by nothing).
        precondition_1d: give vectors a factor too (else they step as Adam).
        weight_dimension_numbers: which leaves get factors, and on which axes, by name as Muon's
            (`zero.functional.contrib.MuonDimensionNumbers`, a tree of them with None for the
            leaves without factors, or a function of the params returning one): a labelled
            leaf keeps a factor for its reduction and output axes (each up to
            ``max_precond_dim``), the others step as Adam (embeddings and heads, as the user
            says); with ``heads`` each head's block of the output axis keeps factors of its own
            (per-head SOAP: SOAP on each head as a param of its own, the factors stacked by head).
            ``None``: every leaf by ``max_precond_dim`` and ``precondition_1d``. The plans'
            cost model (``optimizer="soap"``) counts the default.

    Returns:
        A transformation with state `SoapState`. Every tensor with a factor must be whole: under
        a flat plan, which steps pieces of tensors, keep them whole (a hybrid plan).
    """
    check_unit("b1", b1)
    check_unit("b2", b2)
    check_non_negative("eps", eps)
    check_positive("precondition_frequency", precondition_frequency)
    check_positive("max_precond_dim", max_precond_dim)
    beta = b2 if shampoo_beta < 0 else shampoo_beta
    check_unit("shampoo_beta", beta)

    def named(tree, leaves) -> list:
        """Per leaf, its dimension numbers (None everywhere without ``weight_dimension_numbers``)."""
        found = kronecker.labels(weight_dimension_numbers, tree, leaves, "weight_dimension_numbers")
        return [None] * len(leaves) if found is None else found

    def axes(tree, leaves) -> list[tuple[bool, ...]]:
        """Per leaf, whether each axis (of a head's block, with heads) keeps a factor."""
        if weight_dimension_numbers is None:
            return [soap_axes(tuple(p.shape), max_precond_dim, precondition_1d) for p in leaves]
        return [tuple(a in kronecker.named_axes(p.shape, d) and n <= max_precond_dim
                      for a, n in enumerate(block_shape(p.shape, d))) for p, d in zip(leaves, named(tree, leaves))]

    def factors(p, keep, d):
        """Per axis a factor (one per head, stacked, with heads), or an empty tensor."""
        lead = (heads_of(d),) if heads_of(d) > 1 else ()
        return tuple(torch.zeros(*lead, n, n, dtype=p.dtype, device=p.device) if k else _empty(p)
                     for n, k in zip(block_shape(p.shape, d), keep))

    def init(params):
        leaves, treedef = optree.tree_flatten(params)
        kept, dims = axes(params, leaves), named(params, leaves)

        def like(make):
            return treedef.unflatten([make(p, k, d) for p, k, d in zip(leaves, kept, dims)])

        zeros = lambda p, k, d: torch.zeros_like(p)  # noqa: E731
        return SoapState(count_zero(), like(zeros), like(zeros), like(factors), like(factors))

    def scaled(factor: float = 1.0, own: bool = False):
        """The update, its directions times ``factor`` (a learning rate folded in by `chain`:
        one scalar for the bias corrections and the rate, no pass of its own); ``own``: the first
        moments written into their old tensors (`GradientTransformation.owned`)."""
        def update(updates, state, params=None):
            return step(updates, state, factor, own and not traced())
        return update

    def step(updates, state, factor, own):
        leaves, treedef = optree.tree_flatten(updates)
        # by default asked of each whole tensor's shape (a flat piece of a matrix is 1-D); by name, per leaf
        needs = (lambda shape: any(soap_axes(tuple(shape), max_precond_dim, precondition_1d))) \
            if weight_dimension_numbers is None else [any(keep) for keep in axes(updates, leaves)]
        sharding.whole_tensors(leaves, "scale_by_soap (Kronecker factors of whole tensors)", needs=needs)
        c = step_count(state.count)  # steps before this one
        first, refresh = (c == 0, c > 0 and c % precondition_frequency == 0) if not traced() else (
            c == 0, (c > 0) & (torch.remainder(c, precondition_frequency) == 0))
        t = c if not traced() else torch.clamp(c, min=1)  # the discarded first-step branch stays finite
        scale = 0.0 if first is True else (1 - b2**t) ** 0.5 / (1 - b1**t) * factor
        dims = named(updates, leaves)
        sharding.reads_heads(leaves, list(map(first_axis_heads, leaves, dims)))  # for a plan's costs
        states = [treedef.flatten_up_to(x) for x in (state.exp_avg, state.exp_avg_sq, state.gg, state.q)]
        out: list = [None] * len(leaves)
        for idx in () if traced() else _matrices(leaves, states[2], dims):  # eager: each shape's matrices at once
            for i, got in zip(idx, _batched(*([col[i] for i in idx] for col in (leaves, *states)), first, refresh,
                                            scale, own)):
                out[i] = got
        out = [got if got is not None else _heads(g, *st, d, first, refresh, scale, own)
               for got, g, *st, d in zip(out, leaves, *states, dims)]
        if not out:  # no tensors here (a rank that steps none of this group's params)
            return updates, state._replace(count=count_inc(state.count))
        u, mu, nu, gg, q = (treedef.unflatten(list(col)) for col in zip(*out))
        return u, SoapState(count_inc(state.count), mu, nu, gg, q)

    def _heads(g, mu, nu, gg, q, d, first, refresh, scale, own):
        """`_leaf`, or with heads `_leaf` on each head's block and its own factors."""
        if heads_of(d) == 1:
            return _leaf(g, mu, nu, gg, q, first, refresh, scale, own)
        per = [_leaf(gh, mh, nh, tuple(f[i] if f.numel() else f for f in gg),
                     tuple(b[i] if b.numel() else b for b in q), first, refresh, scale, own)
               for i, (gh, mh, nh) in enumerate(zip(*(split_heads(x, d) for x in (g, mu, nu))))]
        u, mu, nu, gg, q = zip(*per)
        stacked = lambda fs: tuple(torch.stack(col) if col[0].numel() else col[0] for col in zip(*fs))  # noqa: E731
        return (*(join_heads(torch.stack(x), d) for x in (u, mu, nu)), stacked(gg), stacked(q))

    def _batched(gs, mus, nus, ggs, qs, first, refresh, scale, own) -> list[tuple]:
        """`_leaf` on matrices of one shape with both factors, as one batch ``(B, m, n)``: the same
        maths (``Q_L^T G Q_R`` is what `kronecker.rotate` computes), one kernel call per product
        for all of them. Every such matrix steps here, alone or not, so that a matrix's numbers do
        not depend on which others a rank holds."""
        g, mu, nu = torch.stack(gs), _stacked(mus), _stacked(nus)
        left, right = _stacked([f[0] for f in ggs]), _stacked([f[1] for f in ggs])
        left = _lerp(left, (g @ g.mT).to(left.dtype), 1 - beta)
        right = _lerp(right, (g.mT @ g).to(right.dtype), 1 - beta)
        if first:
            u, ql, qr = torch.zeros_like(g), kronecker.eigenbasis(left), kronecker.eigenbasis(right)
        else:
            ql, qr = _stacked([b[0] for b in qs]), _stacked([b[1] for b in qs])
            mu = _first_moment(mu, g, b1, own)
            nu = _lerp(nu, _squared(ql.mT @ g @ qr), 1 - b2)
            u = (ql @ ((ql.mT @ mu @ qr) / (nu.sqrt() + eps)) @ qr.mT) * scale
            if refresh:
                ql, order = kronecker.refreshed_basis(left, ql)
                nu = nu.gather(1, order.unsqueeze(-1).expand_as(nu))
                qr, order = kronecker.refreshed_basis(right, qr)
                nu = nu.gather(2, order.unsqueeze(-2).expand_as(nu))
        # views of the batch, back to back: the next step stacks them without a copy (`_stacked`)
        u, mu, nu, left, right, ql, qr = (t.unbind() for t in (u, mu, nu, left, right, ql, qr))
        return [(u[k], mu[k], nu[k], (left[k], right[k]), (ql[k], qr[k])) for k in range(len(gs))]

    def _leaf(g, mu, nu, gg, q, first, refresh, scale, own):
        gg = _gathered(g, gg, beta)
        if isinstance(first, bool) and first:
            return torch.zeros_like(g), mu, nu, gg, tuple(kronecker.eigenbasis(f) if f.numel() else f for f in gg)
        u, mu2, nu2 = _adam_in_basis(g, mu, nu, q, b1, b2, eps, scale, own)
        if isinstance(refresh, bool) and not refresh:
            return u, mu2, nu2, gg, q
        q2, nu3 = _refreshed(gg, q, nu2)
        if isinstance(first, bool):
            return u, mu2, nu3, gg, q2
        q1 = tuple(kronecker.eigenbasis(f) if f.numel() else f for f in gg)  # traced: every outcome, then chosen
        pick = kronecker.pick
        return (pick(first, torch.zeros_like(u), u), pick(first, mu, mu2), pick(first, nu, pick(refresh, nu3, nu2)),
                gg, pick(first, q1, pick(refresh, q2, q)))

    spec = Spec("scale_by_soap", {"b1": b1, "b2": b2, "shampoo_beta": shampoo_beta, "eps": eps,
                                  "precondition_frequency": precondition_frequency,
                                  "max_precond_dim": max_precond_dim, "precondition_1d": precondition_1d,
                                  "weight_dimension_numbers": weight_dimension_numbers})
    return GradientTransformation(init, scaled(), spec=spec, scaled=scaled,
                                  owned=lambda factor=1.0: scaled(factor, own=True))


class DecayAfterUpdateState(NamedTuple):
    """State of `decay_after_update`: its steps taken (the schedule's argument)."""

    count: torch.Tensor


def decay_after_update(learning_rate: ScalarOrSchedule, weight_decay: float) -> GradientTransformation:
    """Decoupled weight decay of the param after its update, ``p <- (p + u)(1 - lr wd)``, as the
    SOAP authors' code applies it (``add_decayed_weights`` before the learning rate decays the
    param before it: they differ by ``lr wd u``). Nothing at the first step, which SOAP skips."""
    check_non_negative("weight_decay", weight_decay)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("decay_after_update needs the params (update(updates, state, params))")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        k = lr * weight_decay
        count = count_inc(state.count)
        if traced():
            k = torch.where(state.count == 0, torch.zeros_like(torch.as_tensor(k)), k)
        elif int(state.count) == 0 or (isinstance(k, (int, float)) and k == 0):
            return updates, DecayAfterUpdateState(count)  # nothing decays (SOAP's first step gathers)
        if isinstance(k, (int, float)):  # two passes over the leaves (one foreach op each)
            return foreach_map(lambda us, ps: plus_scaled(times(us, 1 - k, own=False), ps, -k, own=True), updates,
                               params), DecayAfterUpdateState(count)
        out = optree.tree_map(lambda u, p: u * (1 - k) - k * p, updates, params)
        return out, DecayAfterUpdateState(count)

    return GradientTransformation(lambda params: DecayAfterUpdateState(count_zero()), update,
                                  spec=Spec("decay_after_update", {"learning_rate": learning_rate,
                                                                   "weight_decay": weight_decay}))


@alias
def soap(learning_rate: ScalarOrSchedule = 3e-3, b1: float = 0.95, b2: float = 0.95, shampoo_beta: float = -1,
         eps: float = 1e-8, weight_decay: float = 0.0, precondition_frequency: int = 10,
         max_precond_dim: int = 10000, precondition_1d: bool = False,
         weight_dimension_numbers: Any = None) -> GradientTransformation:
    """SOAP (Vyas et al., SOAP: Improving and Stabilizing Shampoo using Adam, 2024): `scale_by_soap`,
    the learning rate, then the authors' decoupled decay of the updated param
    (`decay_after_update`).

    Equals ``pytorch_optimizer.SOAP(params, lr, betas=(b1, b2), shampoo_beta, weight_decay,
    precondition_frequency, max_precondition_dim=max_precond_dim, precondition_1d)`` (its
    defaults ``merge_dims=False``, ``correct_bias=True``, ``normalize_gradient=False``). Where
    Optax's PR decays the param before its update (``add_decayed_weights``), this follows the
    authors: the two differ by ``lr * weight_decay * update`` a step.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.soap(0.1)
        >>> params = {"w": torch.ones(2, 3)}
        >>> state = tx.init(params)
        >>> u, state = tx.update({"w": torch.ones(2, 3)}, state, params)  # the first step gathers
        >>> float(u["w"].abs().sum())
        0.0
        >>> [tuple(f.shape) for f in state[0].gg["w"]]  # a factor per axis
        [(2, 2), (3, 3)]
    """
    return chain(scale_by_soap(b1, b2, shampoo_beta, eps, precondition_frequency, max_precond_dim, precondition_1d,
                               weight_dimension_numbers),
                 T.scale_by_learning_rate(learning_rate), decay_after_update(learning_rate, weight_decay))

