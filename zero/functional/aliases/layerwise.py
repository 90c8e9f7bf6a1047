"""Rules scaled per layer (each whole tensor): ``lamb``, ``lars``, ``fromage``, ``novograd``.

Each alias is one `chain` whose docstring carries the maths, and mirrors the Optax function of
the same name (same arguments, defaults and state layout); ``tests/functional/test_functional_optax_parity.py``
proves them equal. Where Optax's rule and the ``torch.optim`` class of the same name differ, the
docstring says how; `zero.functional.from_torch` gives torch's rule exactly.
"""

from __future__ import annotations

from zero.functional import transforms as T
from zero.functional.aliases import Mask, ScalarOrSchedule, alias
from zero.functional.base import NO_PARAMS_MSG, EmptyState, GradientTransformation, tree_map
from zero.functional.combine import chain
from zero.functional.transforms.layerwise import scale_by_novograd

__all__ = ['lamb', 'lars', 'fromage', 'novograd']


@alias
def lamb(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         eps_root: float = 0.0, weight_decay: ScalarOrSchedule = 0.0,
         mask: Mask | None = None) -> GradientTransformation:
    r"""LAMB: Adam's step plus decay, rescaled per tensor by a trust ratio.

    .. math::
        r_k = \frac{\hat m_k}{\sqrt{\hat v_k + \epsilon_{root}} + \epsilon} + \lambda p_k, \qquad
        u_k = -\eta\, \frac{\lVert p_k \rVert}{\lVert r_k \rVert}\, r_k

    per tensor (the ratio is 1 where either norm is 0). Mirrors ``optax.lamb`` (``torch.optim``
    has no LAMB). The norms are per tensor, so under a whole-parameter ZeRO plan each rank has
    all it needs.

    Args:
        learning_rate: a float or a schedule ``count -> float``.
        b1, b2, eps, eps_root: as in `adam`.
        weight_decay: decoupled decay ``lambda``, before the trust ratio.
        mask: which params decay (a pytree of bools or a function returning one).

    Returns:
        ``chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio, scale_by_learning_rate)``.

    References:
        You et al., Large Batch Optimization for Deep Learning: Training BERT in 76 minutes, 2020
        (arXiv:1904.00962).

    Example:
        >>> import torch
        >>> import zero.functional as F
        >>> params = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> tx = F.lamb(learning_rate=0.1)
        >>> state = tx.init(params)
        >>> for _ in range(3):  # minimise sum(w ** 2), whose gradient is 2 w
        ...     updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        ...     params = F.apply_updates(params, updates)
        >>> params["w"]
        tensor([ 0.4142, -1.4075,  2.4062])
    """
    return chain(T.scale_by_adam(b1, b2, eps, eps_root), T.add_decayed_weights(weight_decay, mask),
                 T.scale_by_trust_ratio(), T.scale_by_learning_rate(learning_rate))


@alias
def lars(learning_rate: ScalarOrSchedule, weight_decay: ScalarOrSchedule = 0.0, weight_decay_mask: Mask = True,
         trust_coefficient: float = 0.001, eps: float = 0.0, trust_ratio_mask: Mask = True, momentum: float = 0.9,
         nesterov: bool = False) -> GradientTransformation:
    r"""LARS: layer-wise trust ratios on SGD with momentum.

    .. math:: u_t = -\alpha\,\mathrm{trace}\big(\eta \frac{|p|}{|g + \lambda p| + \epsilon} (g + \lambda p)\big)

    Args:
        learning_rate: a float or a schedule.
        weight_decay, weight_decay_mask: L2 decay added to the gradient, and where.
        trust_coefficient, eps, trust_ratio_mask: the trust ratio ``eta`` and where it applies.
        momentum, nesterov: the trace after the learning rate.

    Returns:
        The chain of ``optax.lars``.

    Reference: You et al., Large Batch Training of Convolutional Networks, 2017.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.lars(1.0, trust_coefficient=1.0)
        >>> p = torch.tensor([3.0, 4.0])
        >>> u, _ = tx.update(torch.tensor([0.0, 1.0]), tx.init(p), p)
        >>> u
        tensor([ 0., -5.])
    """
    from zero.functional.transforms.masking import masked

    return chain(T.add_decayed_weights(weight_decay, weight_decay_mask),
                 masked(T.scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps), trust_ratio_mask),
                 T.scale_by_learning_rate(learning_rate), T.trace(momentum, nesterov))


def _decay_by(factor: float) -> GradientTransformation:
    """``updates + factor * params`` for any sign of ``factor`` (``add_decayed_weights`` checks it
    is a decay, >= 0; Fromage shrinks the weights with a negative one)."""
    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        return tree_map(lambda g, p: g + factor * p, updates, params), state

    return GradientTransformation(lambda params: EmptyState(), update)


@alias
def fromage(learning_rate: ScalarOrSchedule, min_norm: float = 1e-6) -> GradientTransformation:
    r"""Fromage: trust-ratio steps that keep the weights' norms in check.

    .. math:: p_{t+1} = (p_t - \alpha \frac{|p_t|}{|g_t|} g_t) / \sqrt{1 + \alpha^2}

    Args:
        learning_rate: a float or a schedule.
        min_norm: the smallest norm used in the trust ratio.

    Returns:
        ``chain(scale_by_trust_ratio, scale_by_learning_rate, add_decayed_weights)`` (``optax.fromage``).

    Reference: Bernstein et al., On the distance between two neural networks and the stability
    of learning, 2020.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.fromage(1.0)
        >>> p = torch.tensor([3.0, 4.0])
        >>> u, _ = tx.update(torch.tensor([0.0, 1.0]), tx.init(p), p)
        >>> u
        tensor([-0.8787, -4.7071])
    """
    if callable(learning_rate):
        mult = lambda count: 1 / (1 + learning_rate(count) ** 2) ** 0.5
        return chain(T.scale_by_trust_ratio(min_norm),
                     T.scale_by_learning_rate(lambda c: mult(c) * learning_rate(c)),
                     T.add_decayed_weights(lambda c: mult(c) - 1))
    mult = 1 / (1 + learning_rate**2) ** 0.5
    return chain(T.scale_by_trust_ratio(min_norm), T.scale_by_learning_rate(learning_rate * mult),
                 _decay_by(mult - 1))


@alias
def novograd(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.25, eps: float = 1e-6,
             eps_root: float = 0.0, weight_decay: float = 0.0) -> GradientTransformation:
    r"""NovoGrad: layer-wise normalised gradients with momentum.

    .. math::
        n_t = \beta_2 n_{t-1} + (1-\beta_2)|g_t|^2,\quad
        m_t = \beta_1 m_{t-1} + g_t / (\sqrt{n_t + \bar\epsilon} + \epsilon) + \lambda p_t,\quad
        u_t = -\alpha_t m_t

    Args:
        learning_rate: a float or a schedule.
        b1, b2: decay rates; eps, eps_root: outside and inside the root; weight_decay: ``lambda``.

    Returns:
        ``chain(scale_by_novograd(...), scale_by_learning_rate(...))`` (``optax.novograd``).

    Reference: Ginsburg et al., Stochastic Gradient Methods with Layer-wise Adaptive Moments, 2019.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.novograd(0.1)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u
        tensor([-0.1000])
    """
    return chain(scale_by_novograd(b1, b2, eps, eps_root, weight_decay), T.scale_by_learning_rate(learning_rate))
