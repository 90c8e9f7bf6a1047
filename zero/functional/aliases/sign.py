"""Rules that step by signs: ``lion``, ``rprop``, ``sign_sgd``, ``signum``.

Each alias is one `chain` whose docstring carries the maths, and mirrors the Optax function of
the same name (same arguments, defaults and state layout); ``tests/functional/test_functional_optax_parity.py``
proves them equal. Where Optax's rule and the ``torch.optim`` class of the same name differ, the
docstring says how; `zero.functional.from_torch` gives torch's rule exactly.
"""

from __future__ import annotations

import torch

from zero.functional import transforms as T
from zero.functional.aliases import Mask, ScalarOrSchedule, alias
from zero.functional.base import GradientTransformation
from zero.functional.combine import chain
from zero.functional.transforms.sign import scale_by_sign

__all__ = ['lion', 'rprop', 'sign_sgd', 'signum']


@alias
def lion(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99, mu_dtype: torch.dtype | None = None,
         weight_decay: ScalarOrSchedule = 1e-3, mask: Mask | None = None) -> GradientTransformation:
    r"""Lion: the sign of an interpolation of momentum and gradient, plus decoupled decay.

    .. math::
        u_k = -\eta \left( \operatorname{sign}\big((1-\beta_1) g_k + \beta_1 m_{k-1}\big) + \lambda p_k \right),
        \qquad m_k = \beta_2 m_{k-1} + (1-\beta_2) g_k

    Mirrors ``optax.lion`` (``torch.optim`` has no Lion). Every element moves by exactly ``eta``
    before decay, so learning rates are typically 3-10x smaller than Adam's.

    Args:
        learning_rate: a float or a schedule ``count -> float``.
        b1: weight of the momentum in the sign's argument.
        b2: decay of the momentum.
        mu_dtype: dtype the momentum is kept (and accumulated) in.
        weight_decay: decoupled decay ``lambda`` (a float or a schedule).
        mask: which params decay (a pytree of bools or a function returning one).

    Returns:
        ``chain(scale_by_lion(b1, b2, mu_dtype), add_decayed_weights(...), scale_by_learning_rate(...))``;
        state ``(ScaleByLionState(count, mu), ...)``.

    References:
        Chen et al., Symbolic Discovery of Optimization Algorithms, 2023 (arXiv:2302.06675).

    Example:
        >>> import torch
        >>> import zero.functional as F
        >>> params = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> tx = F.lion(learning_rate=0.1)
        >>> state = tx.init(params)
        >>> for _ in range(3):  # minimise sum(w ** 2), whose gradient is 2 w
        ...     updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        ...     params = F.apply_updates(params, updates)
        >>> params["w"]
        tensor([ 0.6997, -1.6994,  2.6991])
    """
    return chain(T.scale_by_lion(b1, b2, mu_dtype), T.add_decayed_weights(weight_decay, mask),
                 T.scale_by_learning_rate(learning_rate))


@alias
def rprop(learning_rate: float, eta_minus: float = 0.5, eta_plus: float = 1.2, min_step_size: float = 1e-6,
          max_step_size: float = 50.0) -> GradientTransformation:
    r"""Rprop: per-element step sizes driven by the sign of the gradient alone.

    .. math::
        \delta_k = \begin{cases} \min(\eta_+ \delta_{k-1}, \delta_{max}) & g_k g_{k-1} > 0 \\
        \max(\eta_- \delta_{k-1}, \delta_{min}) & g_k g_{k-1} < 0 \\ \delta_{k-1} & \text{else}
        \end{cases}, \qquad u_k = -\operatorname{sign}(g_k)\, \delta_k

    and after a sign flip the step is skipped and the gradient forgotten. Mirrors
    ``optax.rprop`` (Optax's order of that bookkeeping); ``torch.optim.Rprop`` differs in it,
    and `from_torch` gives torch's rule.

    Args:
        learning_rate: the initial step size ``delta_0``.
        eta_minus: shrink factor on a sign flip, in (0, 1).
        eta_plus: growth factor while the sign holds, > 1.
        min_step_size, max_step_size: bounds on ``delta``.

    Returns:
        ``chain(scale_by_rprop(...), scale(-1))``; state ``(ScaleByRpropState(step_sizes,
        prev_updates), EmptyState)``.

    References:
        Riedmiller and Braun, A Direct Adaptive Method for Faster Backpropagation Learning: The
        RPROP Algorithm, 1993.

    Example:
        >>> import torch
        >>> import zero.functional as F
        >>> params = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> tx = F.rprop(learning_rate=0.1)
        >>> state = tx.init(params)
        >>> for _ in range(3):  # minimise sum(w ** 2), whose gradient is 2 w
        ...     updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        ...     params = F.apply_updates(params, updates)
        >>> params["w"]
        tensor([ 0.7800, -1.7800,  2.7800])
    """
    return chain(T.scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size),
                 T.scale(-1.0))


@alias
def sign_sgd(learning_rate: ScalarOrSchedule) -> GradientTransformation:
    r"""SGD on the signs of the gradient.

    .. math:: u_t = -\alpha_t \operatorname{sign}(g_t)

    Args:
        learning_rate: a float or a schedule.

    Returns:
        ``chain(scale_by_sign(), scale_by_learning_rate(learning_rate))`` (``optax.sign_sgd``).

    Reference: Bernstein et al., signSGD: Compressed Optimisation for Non-Convex Problems, 2018.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.sign_sgd(0.1)
        >>> p = torch.tensor([1.0, 1.0])
        >>> u, _ = tx.update(torch.tensor([3.0, -0.5]), tx.init(p), p)
        >>> u
        tensor([-0.1000,  0.1000])
    """
    return chain(scale_by_sign(), T.scale_by_learning_rate(learning_rate))


@alias
def signum(learning_rate: ScalarOrSchedule, beta: float = 0.9,
           accumulator_dtype: torch.dtype | str | None = None) -> GradientTransformation:
    r"""SGD on the signs of an exponential moving average of the gradient.

    .. math:: m_t = \beta m_{t-1} + (1-\beta) g_t,\quad u_t = -\alpha_t \operatorname{sign}(m_t)

    Args:
        learning_rate: a float or a schedule; beta: the average's decay; accumulator_dtype: its dtype.

    Returns:
        ``chain(ema(beta, debias=False), scale_by_sign(), scale_by_learning_rate(...))`` (``optax.signum``).

    Reference: Bernstein et al., signSGD, 2018.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.signum(0.1)
        >>> p = torch.tensor([1.0, 1.0])
        >>> u, _ = tx.update(torch.tensor([3.0, -0.5]), tx.init(p), p)
        >>> u
        tensor([-0.1000,  0.1000])
    """
    return chain(T.ema(beta, debias=False, accumulator_dtype=accumulator_dtype), scale_by_sign(),
                 T.scale_by_learning_rate(learning_rate))
