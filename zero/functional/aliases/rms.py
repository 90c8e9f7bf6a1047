"""Rules over accumulated squares: ``adagrad``, ``adadelta``, ``rmsprop``.

Each alias is one `chain` whose docstring carries the maths, and mirrors the Optax function of
the same name (same arguments, defaults and state layout); ``tests/functional/test_functional_optax_parity.py``
proves them equal. Where Optax's rule and the ``torch.optim`` class of the same name differ, the
docstring says how; `zero.functional.from_torch` gives torch's rule exactly.
"""

from __future__ import annotations

from zero.functional import transforms as T
from zero.functional.aliases import Mask, ScalarOrSchedule, alias
from zero.functional.base import GradientTransformation, identity
from zero.functional.combine import chain

__all__ = ['adagrad', 'adadelta', 'rmsprop']


@alias
def adagrad(learning_rate: ScalarOrSchedule, initial_accumulator_value: float = 0.1,
            eps: float = 1e-7) -> GradientTransformation:
    r"""Adagrad: steps shrink with the sum of all past squared gradients.

    .. math::
        s_k = s_{k-1} + g_k^2, \qquad u_k = -\eta\, \frac{g_k}{\sqrt{s_k + \epsilon}}
        \quad (0 \text{ where } s_k = 0)

    Mirrors ``optax.adagrad``. ``torch.optim.Adagrad`` differs: ``eps`` outside the root,
    ``initial_accumulator_value=0`` and an ``lr_decay``; `from_torch` gives torch's rule.

    Args:
        learning_rate: a float or a schedule ``count -> float``.
        initial_accumulator_value: the starting value of ``s``.
        eps: added to ``s`` inside the root.

    Returns:
        ``chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate))``;
        state ``(ScaleByRssState(sum_of_squares), ...)``.

    References:
        Duchi, Hazan and Singer, Adaptive Subgradient Methods for Online Learning and Stochastic
        Optimization, JMLR 2011.

    Example:
        >>> import torch
        >>> import zero.functional as F
        >>> params = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> tx = F.adagrad(learning_rate=0.1)
        >>> state = tx.init(params)
        >>> for _ in range(3):  # minimise sum(w ** 2), whose gradient is 2 w
        ...     updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        ...     params = F.apply_updates(params, updates)
        >>> params["w"]
        tensor([ 0.7823, -1.7763,  2.7746])
    """
    return chain(T.scale_by_rss(initial_accumulator_value, eps), T.scale_by_learning_rate(learning_rate))


@alias
def adadelta(learning_rate: ScalarOrSchedule | None = None, rho: float = 0.9, eps: float = 1e-6,
             weight_decay: float = 0.0, weight_decay_mask: Mask | None = None) -> GradientTransformation:
    r"""Adadelta: steps in the units of the params, from running averages of squared gradients
    and squared steps.

    .. math::
        E[g^2]_k = \rho E[g^2]_{k-1} + (1-\rho) g_k^2, \quad
        d_k = \frac{\sqrt{E[d^2]_{k-1} + \epsilon}}{\sqrt{E[g^2]_k + \epsilon}}\, g_k, \quad
        E[d^2]_k = \rho E[d^2]_{k-1} + (1-\rho) d_k^2, \quad u_k = -\eta\, d_k

    where ``g`` already includes the coupled decay ``lambda p``. Mirrors ``optax.adadelta``; the
    same rule as ``torch.optim.Adadelta`` (`from_torch` takes torch's argument names).

    Args:
        learning_rate: a float, a schedule, or ``None`` for no scaling (``eta = -1``, Zeiler's form).
        rho: decay of both running averages, in [0, 1].
        eps: added inside both roots.
        weight_decay: coupled L2 decay ``lambda``, added to the gradient first.
        weight_decay_mask: which params decay (a pytree of bools or a function returning one).

    Returns:
        ``chain(add_decayed_weights(...), scale_by_adadelta(rho, eps), scale_by_learning_rate(...))``;
        the middle state is ``ScaleByAdaDeltaState(e_g, e_x)``.

    References:
        Zeiler, ADADELTA: An Adaptive Learning Rate Method, 2012 (arXiv:1212.5701).

    Example:
        >>> import torch
        >>> import zero.functional as F
        >>> params = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> tx = F.adadelta(learning_rate=10.0)
        >>> state = tx.init(params)
        >>> for _ in range(3):  # minimise sum(w ** 2), whose gradient is 2 w
        ...     updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        ...     params = F.apply_updates(params, updates)
        >>> params["w"]
        tensor([ 0.9046, -1.9038,  2.9035])
    """
    return chain(T.add_decayed_weights(weight_decay, weight_decay_mask), T.scale_by_adadelta(rho, eps),
                 T.scale_by_learning_rate(learning_rate))


@alias
def rmsprop(learning_rate: ScalarOrSchedule, decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0,
            eps_in_sqrt: bool = True, centered: bool = False, momentum: float | None = None,
            nesterov: bool = False, bias_correction: bool = False) -> GradientTransformation:
    r"""RMSProp: divide by the root of a running average of squared gradients.

    .. math::
        v_k = \rho v_{k-1} + (1-\rho) g_k^2, \qquad s_k = -\eta\, \frac{g_k}{\sqrt{v_k + \epsilon}}

    (``eps`` outside the root when ``eps_in_sqrt=False``; ``v - m^2`` with ``m`` the running mean
    of ``g`` when ``centered``), then momentum on the scaled steps: ``t_k = s_k + mu t_{k-1}``.
    Mirrors ``optax.rmsprop``. ``torch.optim.RMSprop`` puts ``eps`` outside the root and uses
    ``alpha=0.99``; `from_torch` gives torch's rule.

    Args:
        learning_rate: a float or a schedule ``count -> float``.
        decay: ``rho``, the decay of the running averages.
        eps: the damping term.
        initial_scale: the starting value of ``v``.
        eps_in_sqrt: whether ``eps`` goes inside the root.
        centered: divide by the running standard deviation instead (centred RMSProp).
        momentum: the decay of a trace on the scaled steps; ``None`` for none.
        nesterov: Nesterov's momentum for that trace.
        bias_correction: debias the running averages as Adam does.

    Returns:
        ``chain(scale_by_rms | scale_by_stddev, scale_by_learning_rate, trace)``.

    References:
        Hinton, Neural Networks for Machine Learning, lecture 6e, 2012; Graves, Generating
        Sequences With Recurrent Neural Networks, 2013 (centred form).

    Example:
        >>> import torch
        >>> import zero.functional as F
        >>> params = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> tx = F.rmsprop(learning_rate=0.1)
        >>> state = tx.init(params)
        >>> for _ in range(3):  # minimise sum(w ** 2), whose gradient is 2 w
        ...     updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        ...     params = F.apply_updates(params, updates)
        >>> params["w"]
        tensor([ 0.3692, -1.3087,  2.2918])
    """
    scaler = T.scale_by_stddev if centered else T.scale_by_rms
    return chain(scaler(decay, eps, initial_scale, eps_in_sqrt, bias_correction),
                 T.scale_by_learning_rate(learning_rate),
                 T.trace(momentum, nesterov) if momentum is not None else identity())
