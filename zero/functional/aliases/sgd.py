"""The SGD family: ``sgd``, ``noisy_sgd``, ``polyak_sgd``, ``optimistic_gradient_descent``.

Each alias is one `chain` whose docstring carries the maths, and mirrors the Optax function of
the same name (same arguments, defaults and state layout); ``tests/functional/test_functional_optax_parity.py``
proves them equal. Where Optax's rule and the ``torch.optim`` class of the same name differ, the
docstring says how; `zero.functional.from_torch` gives torch's rule exactly.
"""

from __future__ import annotations

import torch

from zero.functional import transforms as T
from zero.functional.aliases import ScalarOrSchedule, alias
from zero.functional.base import GradientTransformation, identity
from zero.functional.combine import chain
from zero.functional.transforms.momentum import scale_by_optimistic_gradient
from zero.functional.transforms.scaling import scale_by_polyak

__all__ = ['sgd', 'noisy_sgd', 'polyak_sgd', 'optimistic_gradient_descent']


@alias
def sgd(learning_rate: ScalarOrSchedule, momentum: float | None = None, nesterov: bool = False,
        accumulator_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Stochastic gradient descent, with optional (Nesterov) momentum.

    .. math::
        t_k = g_k + \mu\, t_{k-1}, \qquad u_k = -\eta\, t_k
        \quad (\text{Nesterov: } u_k = -\eta\, (g_k + \mu\, t_k))

    Mirrors ``optax.sgd``. Equal to ``torch.optim.SGD(lr, momentum, nesterov=...)`` with
    ``dampening=0`` and no weight decay (torch's first momentum buffer is the first gradient,
    which is ``g + mu * 0`` here too); `from_torch` covers dampening and torch's coupled decay.

    Args:
        learning_rate: a float or a schedule ``count -> float``.
        momentum: the decay ``mu`` of the trace; ``None`` for plain SGD.
        nesterov: use Nesterov's momentum.
        accumulator_dtype: dtype of the trace (``None``: the updates' dtype).

    Returns:
        ``chain(trace(momentum, nesterov), scale_by_learning_rate(learning_rate))``; state
        ``(TraceState | EmptyState, EmptyState | ScaleByScheduleState)``.

    References:
        Sutskever et al., On the importance of initialization and momentum in deep learning, 2013.

    Example:
        >>> import torch
        >>> import zero.functional as F
        >>> params = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> tx = F.sgd(learning_rate=0.1, momentum=0.9)
        >>> state = tx.init(params)
        >>> for _ in range(3):  # minimise sum(w ** 2), whose gradient is 2 w
        ...     updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        ...     params = F.apply_updates(params, updates)
        >>> params["w"]
        tensor([ 0.0620, -0.1240,  0.1860])
    """
    tr = T.trace(momentum, nesterov, accumulator_dtype) if momentum is not None else identity()
    return chain(tr, T.scale_by_learning_rate(learning_rate))


@alias
def noisy_sgd(learning_rate: ScalarOrSchedule, eta: float = 0.01, gamma: float = 0.55, key: int | None = None
              ) -> GradientTransformation:
    r"""SGD on gradients with added Gaussian noise of variance ``eta / (1 + t)^gamma``.

    .. math:: u_t = -\alpha_t (g_t + N(0, \eta / (1 + t)^\gamma))

    Args:
        learning_rate: a float or a schedule.
        eta, gamma: the noise's initial variance and its decay.
        key: seed of the torch generator (``None``: 0). The samples differ from JAX's PRNG.

    Returns:
        ``chain(add_noise(eta, gamma, key), scale_by_learning_rate(learning_rate))`` (``optax.noisy_sgd``).

    Reference: Neelakantan et al., Adding Gradient Noise Improves Learning for Very Deep Networks, 2015.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.noisy_sgd(0.1, eta=0.0)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u
        tensor([-0.2000])
    """
    return chain(T.add_noise(eta, gamma, 0 if key is None else key), T.scale_by_learning_rate(learning_rate))


def polyak_sgd(max_learning_rate: float = 1.0, scaling: ScalarOrSchedule = 1.0, f_min: float = 0.0,
               eps: float = 0.0, variant: str = "sps") -> GradientTransformation:
    r"""SGD with the Polyak step size; ``update`` takes the objective's value as ``value=``.

    .. math:: u_t = -s \min\Big(\frac{f(x_t) - f^\star}{|g_t|^2 + \epsilon}, \gamma_{max}\Big) g_t

    Args:
        max_learning_rate: ``gamma_max``; scaling: ``s``, a float or a schedule.
        f_min: ``f*``, a lower bound of the objective; eps: added to the denominator.
        variant: ``"sps"``, or ``"sps+"`` for the positive part of the gap.

    Returns:
        ``chain(sgd(scaling), scale_by_polyak(...))`` (``optax.polyak_sgd``).

    Reference: Loizou et al., Stochastic Polyak Step-size for SGD, 2021.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.polyak_sgd()
        >>> p = torch.tensor([1.0, 2.0])
        >>> u, _ = tx.update(2 * p, tx.init(p), p, value=(p ** 2).sum())
        >>> u
        tensor([-0.5000, -1.0000])
    """
    return chain(sgd(learning_rate=scaling), scale_by_polyak(f_min, max_learning_rate, eps, variant))


@alias
def optimistic_gradient_descent(learning_rate: ScalarOrSchedule, alpha: float = 1.0,
                                beta: float = 1.0) -> GradientTransformation:
    r"""Optimistic gradient descent, for min-max games.

    .. math:: u_t = -\eta_t ((\alpha + \beta) g_t - \beta g_{t-1})

    Args:
        learning_rate: a float or a schedule; alpha, beta: the generalised OGD coefficients.

    Returns:
        ``chain(scale_by_optimistic_gradient, scale_by_learning_rate)`` (``optax.optimistic_gradient_descent``).

    Reference: Mokhtari et al., A Unified Analysis of Extra-gradient and Optimistic Gradient
    Methods for Saddle Point Problems, 2019.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.optimistic_gradient_descent(0.1)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u
        tensor([-0.2000])
    """
    return chain(scale_by_optimistic_gradient(alpha, beta), T.scale_by_learning_rate(learning_rate))
