"""Optax's optimizer aliases on torch tensors: each is one `chain` whose docstring carries the maths.

Every alias mirrors the Optax function of the same name (same arguments, defaults and state
layout) and is proven equal to it by ``tests/test_functional_optax_parity.py``. Where Optax's rule
and the ``torch.optim`` class of the same name differ, the docstring says how;
`zero.functional.from_torch` gives torch's rule exactly. Chains that torch has a fused kernel for
(``adam``, ``adamw``) step in place with it (`zero.functional.kernels`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from zero.functional import adam_family as A
from zero.functional import transform as T
from zero.functional.base import GradientTransformation, Spec, identity
from zero.functional.combine import chain

__all__ = ["sgd", "adam", "adamw", "adagrad", "adadelta", "adamax", "rmsprop", "rprop", "lion",
           "lamb", "nadam", "radam"]

Schedule = Callable[[Any], float]
ScalarOrSchedule = float | Schedule
Mask = Any  # a pytree of bools like the params, or a function of the params returning one


def _alias(factory: Callable[..., GradientTransformation]) -> Callable[..., GradientTransformation]:
    """Record the alias and its arguments as the chain's spec, so it can be rebuilt under
    `inject_hyperparams` (what `zero.functional.Optimizer` does to let param groups set them)."""
    signature = inspect.signature(factory)

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return factory(*args, **kwargs)._replace(spec=Spec(factory.__name__, dict(bound.arguments), build))

    return build


@_alias
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


@_alias
def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype: torch.dtype | None = None, *,
         nesterov: bool = False) -> GradientTransformation:
    r"""Adam: per-element steps from bias-corrected first and second moments.

    .. math::
        m_k = \beta_1 m_{k-1} + (1-\beta_1) g_k, \quad v_k = \beta_2 v_{k-1} + (1-\beta_2) g_k^2,
        \quad \hat m_k = \frac{m_k}{1-\beta_1^k}, \quad \hat v_k = \frac{v_k}{1-\beta_2^k},
        \quad u_k = -\eta\, \frac{\hat m_k}{\sqrt{\hat v_k + \epsilon_{root}} + \epsilon}

    Mirrors ``optax.adam``; the same rule as ``torch.optim.Adam`` (``eps`` outside the root).
    With ``eps_root = 0``, no ``mu_dtype`` and no ``nesterov`` it steps in place with torch's
    fused Adam kernel.

    Args:
        learning_rate: a float or a schedule ``count -> float``.
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: added to the denominator outside the root, for numerical stability.
        eps_root: added inside the root (useful when differentiating through the update).
        mu_dtype: dtype the first moment is kept in (``None``: the updates' dtype).
        nesterov: Nesterov's look-ahead on the first moment (then this is `nadam`).

    Returns:
        ``chain(scale_by_adam(...), scale_by_learning_rate(learning_rate))``; state
        ``(ScaleByAdamState(count, mu, nu), EmptyState | ScaleByScheduleState)``.

    References:
        Kingma and Ba, Adam: A Method for Stochastic Optimization, 2014 (arXiv:1412.6980).

    Example:
        >>> import torch
        >>> import zero.functional as F
        >>> params = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> tx = F.adam(learning_rate=0.1)
        >>> state = tx.init(params)
        >>> for _ in range(3):  # minimise sum(w ** 2), whose gradient is 2 w
        ...     updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        ...     params = F.apply_updates(params, updates)
        >>> params["w"]
        tensor([ 0.7016, -1.7006,  2.7004])
    """
    return chain(A.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 T.scale_by_learning_rate(learning_rate))


@_alias
def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: torch.dtype | None = None, weight_decay: ScalarOrSchedule = 1e-4,
          mask: Mask | None = None, *, nesterov: bool = False) -> GradientTransformation:
    r"""AdamW: Adam with weight decay decoupled from the moments.

    .. math::
        u_k = -\eta \left( \frac{\hat m_k}{\sqrt{\hat v_k + \epsilon_{root}} + \epsilon} + \lambda\, p_k \right)

    with ``m_hat``, ``v_hat`` as in `adam`. Mirrors ``optax.adamw``. ``torch.optim.AdamW`` takes
    the same step (it writes it as ``p (1 - eta lambda) - eta adam(g)``) but defaults to
    ``weight_decay=1e-2``; this, like Optax, defaults to ``1e-4``. Without ``mask``, schedules
    for the decay, ``eps_root``, ``mu_dtype`` or ``nesterov`` it steps in place with torch's
    fused AdamW kernel.

    Args:
        learning_rate: a float or a schedule ``count -> float``.
        b1, b2, eps, eps_root, mu_dtype, nesterov: as in `adam`.
        weight_decay: the decay ``lambda`` (a float or a schedule).
        mask: which params decay: a pytree of bools like the params, or a function returning one
            (e.g. no decay for biases and norms).

    Returns:
        ``chain(scale_by_adam(...), add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate))``.

    References:
        Loshchilov and Hutter, Decoupled Weight Decay Regularization, 2019 (arXiv:1711.05101).

    Example:
        >>> import torch
        >>> import zero.functional as F
        >>> params = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> tx = F.adamw(learning_rate=0.1, weight_decay=0.1)
        >>> state = tx.init(params)
        >>> for _ in range(3):  # minimise sum(w ** 2), whose gradient is 2 w
        ...     updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        ...     params = F.apply_updates(params, updates)
        >>> params["w"]
        tensor([ 0.6751, -1.6444,  2.6144])
    """
    return chain(A.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 T.add_decayed_weights(weight_decay, mask), T.scale_by_learning_rate(learning_rate))


@_alias
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


@_alias
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


@_alias
def adamax(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
           eps: float = 1e-8) -> GradientTransformation:
    r"""Adamax: Adam with the infinity norm in place of the second moment.

    .. math::
        m_k = \beta_1 m_{k-1} + (1-\beta_1) g_k, \quad v_k = \max(|g_k| + \epsilon, \beta_2 v_{k-1}),
        \quad u_k = -\eta\, \frac{m_k}{(1-\beta_1^k)\, v_k}

    Mirrors ``optax.adamax``; the same rule as ``torch.optim.Adamax``.

    Args:
        learning_rate: a float or a schedule ``count -> float``.
        b1: decay of the first moment, in [0, 1).
        b2: decay of the infinity norm, in [0, 1).
        eps: added to ``|g|`` so the norm is never 0.

    Returns:
        ``chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(learning_rate))``; state
        ``(ScaleByAdamState(count, mu, nu), ...)`` with ``nu`` the infinity norm.

    References:
        Kingma and Ba, Adam: A Method for Stochastic Optimization, 2014, section 7.1.

    Example:
        >>> import torch
        >>> import zero.functional as F
        >>> params = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> tx = F.adamax(learning_rate=0.1)
        >>> state = tx.init(params)
        >>> for _ in range(3):  # minimise sum(w ** 2), whose gradient is 2 w
        ...     updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        ...     params = F.apply_updates(params, updates)
        >>> params["w"]
        tensor([ 0.7155, -1.7076,  2.7050])
    """
    return chain(A.scale_by_adamax(b1, b2, eps), T.scale_by_learning_rate(learning_rate))


@_alias
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


@_alias
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


@_alias
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


@_alias
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
    return chain(A.scale_by_adam(b1, b2, eps, eps_root), T.add_decayed_weights(weight_decay, mask),
                 T.scale_by_trust_ratio(), T.scale_by_learning_rate(learning_rate))


@_alias
def nadam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""NAdam in Optax's form: Adam with a Nesterov look-ahead on the first moment.

    .. math::
        \hat m_k = \frac{\beta_1 m_k}{1-\beta_1^{k+1}} + \frac{(1-\beta_1) g_k}{1-\beta_1^k}, \qquad
        u_k = -\eta\, \frac{\hat m_k}{\sqrt{\hat v_k + \epsilon_{root}} + \epsilon}

    Mirrors ``optax.nadam``. ``torch.optim.NAdam`` is Dozat's variant with a momentum-decay
    schedule (``momentum_decay``) and gives different numbers; `from_torch` gives torch's rule.

    Args:
        learning_rate, b1, b2, eps, eps_root, mu_dtype: as in `adam`.

    Returns:
        ``adam(..., nesterov=True)``.

    References:
        Dozat, Incorporating Nesterov Momentum into Adam, ICLR workshop 2016.

    Example:
        >>> import torch
        >>> import zero.functional as F
        >>> params = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> tx = F.nadam(learning_rate=0.1)
        >>> state = tx.init(params)
        >>> for _ in range(3):  # minimise sum(w ** 2), whose gradient is 2 w
        ...     updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        ...     params = F.apply_updates(params, updates)
        >>> params["w"]
        tensor([ 0.6406, -1.6343,  2.6324])
    """
    return adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=True)


@_alias
def radam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, threshold: float = 5.0, *, nesterov: bool = False) -> GradientTransformation:
    r"""RAdam: Adam rectified while its variance estimate is unreliable.

    .. math::
        \rho_\infty = \frac{2}{1-\beta_2} - 1, \quad \rho_k = \rho_\infty - \frac{2 k \beta_2^k}{1-\beta_2^k},
        \quad u_k = \begin{cases} -\eta\, r_k \frac{\hat m_k}{\sqrt{\hat v_k + \epsilon_{root}} + \epsilon}
        & \rho_k \ge \text{threshold} \\ -\eta\, \hat m_k & \text{else} \end{cases}

    with ``r_k = sqrt((rho_k - 4)(rho_k - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_k))``.
    Mirrors ``optax.radam``. ``torch.optim.RAdam`` rectifies when ``rho_k > 5`` and puts ``eps``
    after the bias correction; `from_torch` gives torch's rule.

    Args:
        learning_rate, b1, b2, eps, eps_root: as in `adam`.
        threshold: the ``rho_k`` from which the rectified step is used (>= 4).
        nesterov: Nesterov's look-ahead on the first moment.

    Returns:
        ``chain(scale_by_radam(...), scale_by_learning_rate(learning_rate))``.

    References:
        Liu et al., On the Variance of the Adaptive Learning Rate and Beyond, 2020 (arXiv:1908.03265).

    Example:
        >>> import torch
        >>> import zero.functional as F
        >>> params = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> tx = F.radam(learning_rate=0.1)
        >>> state = tx.init(params)
        >>> for _ in range(3):  # minimise sum(w ** 2), whose gradient is 2 w
        ...     updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        ...     params = F.apply_updates(params, updates)
        >>> params["w"]
        tensor([ 0.4623, -0.9246,  1.3869])
    """
    return chain(A.scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov),
                 T.scale_by_learning_rate(learning_rate))
