"""The Adam family: ``adam``, ``adamw``, ``adamax``, ``adamaxw``, ``nadam``, ``nadamw``, ``radam``,
``amsgrad``, ``adabelief``, ``yogi``, ``adan``, ``optimistic_adam``, ``optimistic_adam_v2``.

Each alias is one `chain` whose docstring carries the maths, and mirrors the Optax function of
the same name (same arguments, defaults and state layout); ``tests/functional/test_functional_optax_parity.py``
proves them equal. Where Optax's rule and the ``torch.optim`` class of the same name differ, the
docstring says how; `zero.functional.from_torch` gives torch's rule exactly. ``adam`` and
``adamw`` step in place with torch's fused kernel (`zero.functional.kernels.fused`).
"""

from __future__ import annotations

import warnings

import torch

from zero.functional import transforms as T
from zero.functional.aliases import Mask, ScalarOrSchedule, alias
from zero.functional.base import GradientTransformation
from zero.functional.combine import chain
from zero.functional.transforms.adam import scale_by_adan, scale_by_yogi
from zero.functional.transforms.momentum import scale_by_optimistic_gradient

__all__ = ["adam", "adamw", "adamax", "nadam", "radam", "nadamw", "adamaxw", "amsgrad", "adabelief", "yogi", "adan",
           "optimistic_adam", "optimistic_adam_v2"]


@alias
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
    return chain(T.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 T.scale_by_learning_rate(learning_rate))


@alias
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
    return chain(T.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 T.add_decayed_weights(weight_decay, mask), T.scale_by_learning_rate(learning_rate))


@alias
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
    return chain(T.scale_by_adamax(b1, b2, eps), T.scale_by_learning_rate(learning_rate))


@alias
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


@alias
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
    return chain(T.scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov),
                 T.scale_by_learning_rate(learning_rate))


@alias
def nadamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
           eps_root: float = 0.0, mu_dtype: torch.dtype | str | None = None, weight_decay: ScalarOrSchedule = 1e-4,
           mask: Mask | None = None) -> GradientTransformation:
    r"""NAdamW: `adamw` with Nesterov's momentum (``optax.nadamw``, ``adamw(..., nesterov=True)``).

    .. math:: u_t = -\alpha_t \big((\beta_1 \hat m_t^{+} + (1-\beta_1)\hat g_t) / (\sqrt{\hat v_t} + \epsilon)
        + \lambda p_t\big)

    Args:
        learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask: as in `adamw`.

    Returns:
        The chain of ``adamw(..., nesterov=True)``.

    Reference: Dozat, Incorporating Nesterov Momentum into Adam, 2016.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.nadamw(0.1, weight_decay=0.0)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u
        tensor([-0.1474])
    """

    return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov=True)


@alias
def adamaxw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
            weight_decay: ScalarOrSchedule = 1e-4, mask: Mask | None = None) -> GradientTransformation:
    r"""Adamax with decoupled weight decay.

    .. math:: u_t = -\alpha_t (\hat m_t / v_t + \lambda p_t),\quad v_t = \max(\beta_2 v_{t-1}, |g_t| + \epsilon)

    Args:
        learning_rate: a float or a schedule.
        b1, b2, eps: as in `adamax`.
        weight_decay: ``lambda``, a float or a schedule; ``mask`` selects the params it applies to.

    Returns:
        ``chain(scale_by_adamax, add_decayed_weights, scale_by_learning_rate)`` (``optax.adamaxw``).
        torch.optim has no decoupled-decay Adamax.

    Reference: Loshchilov and Hutter, Decoupled Weight Decay Regularization, 2019.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.adamaxw(0.1, weight_decay=0.0)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u
        tensor([-0.1000])
    """
    return chain(T.scale_by_adamax(b1, b2, eps), T.add_decayed_weights(weight_decay, mask),
                 T.scale_by_learning_rate(learning_rate))


@alias
def amsgrad(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
            eps_root: float = 0.0, mu_dtype: torch.dtype | str | None = None, bias_correction_mu: bool = True,
            bias_correction_nu: bool = True) -> GradientTransformation:
    r"""AMSGrad: Adam dividing by the running maximum of the second moment.

    .. math:: u_t = -\alpha_t \hat m_t / (\sqrt{\max_{s \le t} \hat v_s + \bar\epsilon} + \epsilon)

    Args:
        learning_rate: a float or a schedule.
        b1, b2, eps, eps_root, mu_dtype: as in `adam`.
        bias_correction_mu, bias_correction_nu: debias each moment.

    Returns:
        ``chain(scale_by_amsgrad(...), scale_by_learning_rate(...))`` (``optax.amsgrad``). torch's
        ``Adam(amsgrad=True)`` keeps the maximum of the raw second moment and debiases it after.

    Reference: Reddi et al., On the Convergence of Adam and Beyond, 2018.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.amsgrad(0.1)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u
        tensor([-0.1000])
    """
    return chain(T.scale_by_amsgrad(b1, b2, eps, eps_root, mu_dtype, bias_correction_mu, bias_correction_nu),
                 T.scale_by_learning_rate(learning_rate))


@alias
def adabelief(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16,
              eps_root: float = 1e-16, *, nesterov: bool = False) -> GradientTransformation:
    r"""AdaBelief: Adam whose second moment tracks ``(g - m)^2``, the "belief" in the gradient.

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad
        s_t = \beta_2 s_{t-1} + (1-\beta_2)(g_t - m_t)^2 + \bar\epsilon,\quad
        u_t = -\alpha_t \hat m_t / (\sqrt{\hat s_t} + \epsilon)

    Args:
        learning_rate: a float or a schedule of the step count.
        b1, b2: decay rates of the two moments.
        eps, eps_root: added outside and inside the root.
        nesterov: use Nesterov's form of the first moment.

    Returns:
        ``chain(scale_by_belief(...), scale_by_learning_rate(learning_rate))`` (``optax.adabelief``).
        torch.optim has no AdaBelief.

    Reference: Zhuang et al., AdaBelief Optimizer, 2020 (arXiv:2010.07468).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.adabelief(0.1)
        >>> p = torch.tensor([1.0, -2.0])
        >>> u, _ = tx.update(torch.tensor([0.5, -0.5]), tx.init(p), p)
        >>> u
        tensor([-0.1111,  0.1111])
    """
    return chain(T.scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov), T.scale_by_learning_rate(learning_rate))


@alias
def yogi(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-3
         ) -> GradientTransformation:
    r"""Yogi: Adam with an additive second-moment update that cannot blow up.

    .. math:: v_t = v_{t-1} - (1-\beta_2)\operatorname{sign}(v_{t-1} - g_t^2) g_t^2,\quad
        u_t = -\alpha_t \hat m_t / (\sqrt{\hat v_t} + \epsilon)

    Args:
        learning_rate: a float or a schedule; b1, b2, eps: as in `adam` (``eps`` defaults to 1e-3).

    Returns:
        ``chain(scale_by_yogi(...), scale_by_learning_rate(...))`` (``optax.yogi``).

    Reference: Zaheer et al., Adaptive Methods for Nonconvex Optimization, 2018.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.yogi(0.1)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u
        tensor([-0.0999])
    """
    return chain(scale_by_yogi(b1, b2, eps), T.scale_by_learning_rate(learning_rate))


@alias
def adan(learning_rate: ScalarOrSchedule, b1: float = 0.98, b2: float = 0.92, b3: float = 0.99, eps: float = 1e-8,
         eps_root: float = 1e-8, weight_decay: ScalarOrSchedule = 0.0, mask: Mask | None = None
         ) -> GradientTransformation:
    r"""Adan: adaptive Nesterov momentum.

    .. math::
        m_t = (1-\beta_1) m + \beta_1 g,\ v_t = (1-\beta_2) v + \beta_2 (g - g_{prev}),\
        n_t = (1-\beta_3) n + \beta_3 (g + (1-\beta_2)(g - g_{prev}))^2,\
        u_t = -\alpha ((\hat m + (1-\beta_2)\hat v) / (\sqrt{\hat n + \bar\epsilon} + \epsilon) + \lambda p)

    (Optax's ``b*`` weigh the old moment, as above with ``1 - b`` and ``b`` swapped.)

    Args:
        learning_rate: a float or a schedule.
        b1, b2, b3: decay rates of the three moments; eps, eps_root: outside and inside the root.
        weight_decay, mask: decoupled weight decay and the params it applies to.

    Returns:
        ``chain(scale_by_adan, add_decayed_weights, scale_by_learning_rate)`` (``optax.adan``).

    Reference: Xie et al., Adan: Adaptive Nesterov Momentum Algorithm, 2022 (arXiv:2208.06677).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.adan(0.1)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u
        tensor([-0.1000])
    """
    return chain(scale_by_adan(b1, b2, b3, eps, eps_root), T.add_decayed_weights(weight_decay, mask),
                 T.scale_by_learning_rate(learning_rate))


def optimistic_adam(learning_rate: float, optimism: float | None = None, b1: float = 0.9, b2: float = 0.999,
                    eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: torch.dtype | str | None = None, *,
                    nesterov: bool = True) -> GradientTransformation:
    r"""Optimistic Adam (deprecated in Optax in favour of ``optimistic_adam_v2``; warns as Optax does).

    .. math:: r_t = \hat m_t / (\sqrt{\hat v_t + \bar\epsilon} + \epsilon),\quad u_t = -\alpha r_t - o (r_t - r_{t-1})

    Args:
        learning_rate: a float (no schedule, as in Optax); optimism: ``o`` (``None``: the learning rate).
        b1, b2, eps, eps_root, mu_dtype, nesterov: as in `adam` (``nesterov`` defaults to True).

    Returns:
        ``chain(scale_by_adam, scale_by_optimistic_gradient, scale_by_learning_rate(1.0))``.

    Reference: Daskalakis et al., Training GANs with Optimism, 2017.
    """
    warnings.warn("`optimistic_adam` is deprecated, please use `optimistic_adam_v2` instead.",
                  DeprecationWarning, stacklevel=2)
    if callable(learning_rate):
        raise ValueError("optimistic_adam does not take a learning rate schedule (as in Optax)")
    optimism = learning_rate if optimism is None else optimism
    return chain(T.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism), T.scale_by_learning_rate(1.0))


@alias
def optimistic_adam_v2(learning_rate: ScalarOrSchedule, *, alpha: float = 1.0, beta: float = 1.0, b1: float = 0.9,
                       b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                       mu_dtype: torch.dtype | str | None = None, nesterov: bool = True) -> GradientTransformation:
    r"""Optimistic Adam: optimistic gradient steps on Adam's direction.

    .. math:: r_t = \hat m_t / (\sqrt{\hat v_t + \bar\epsilon} + \epsilon),\quad
        u_t = -\alpha_t ((\alpha + \beta) r_t - \beta r_{t-1})

    Args:
        learning_rate: a float or a schedule; alpha, beta: the optimistic coefficients.
        b1, b2, eps, eps_root, mu_dtype, nesterov: as in `adam` (``nesterov`` defaults to True).

    Returns:
        ``chain(scale_by_adam, scale_by_optimistic_gradient, scale_by_learning_rate)`` (``optax.optimistic_adam_v2``).

    Reference: Daskalakis et al., Training GANs with Optimism, 2017.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.optimistic_adam_v2(0.1)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u
        tensor([-0.1474])
    """
    return chain(T.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 scale_by_optimistic_gradient(alpha, beta), T.scale_by_learning_rate(learning_rate))
