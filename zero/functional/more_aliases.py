"""Optax's other aliases on torch tensors: ``adabelief``, ``amsgrad``, ``adamaxw``, ``adan``,
``fromage``, ``lars``, ``nadamw``, ``noisy_sgd``, ``novograd``, the optimistic methods,
``polyak_sgd``, ``sign_sgd``, ``signum`` and ``yogi``: each one `chain`, with its maths in the
docstring, proven equal to Optax's by ``tests/test_functional_optax_parity.py``.
"""

from __future__ import annotations

import warnings

import torch

from zero.functional import adam_family as A
from zero.functional import transform as T
from zero.functional.alias import Mask, ScalarOrSchedule, _alias, sgd
from zero.functional.base import NO_PARAMS_MSG, EmptyState, GradientTransformation, tree_map
from zero.functional.combine import chain
from zero.functional.more_rules import (
    scale_by_adan,
    scale_by_novograd,
    scale_by_optimistic_gradient,
    scale_by_polyak,
    scale_by_sign,
    scale_by_sm3,
    scale_by_yogi,
)

__all__ = ["adabelief", "amsgrad", "adamaxw", "adan", "fromage", "lars", "noisy_sgd", "novograd",
           "optimistic_gradient_descent", "optimistic_adam", "optimistic_adam_v2", "nadamw", "polyak_sgd",
           "sign_sgd", "signum", "sm3", "yogi"]


@_alias
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
    return chain(A.scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov), T.scale_by_learning_rate(learning_rate))


@_alias
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
    return chain(A.scale_by_amsgrad(b1, b2, eps, eps_root, mu_dtype, bias_correction_mu, bias_correction_nu),
                 T.scale_by_learning_rate(learning_rate))


@_alias
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
    return chain(A.scale_by_adamax(b1, b2, eps), T.add_decayed_weights(weight_decay, mask),
                 T.scale_by_learning_rate(learning_rate))


@_alias
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


@_alias
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


def _decay_by(factor: float) -> GradientTransformation:
    """``updates + factor * params`` for any sign of ``factor`` (``add_decayed_weights`` checks it
    is a decay, >= 0; Fromage shrinks the weights with a negative one)."""
    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        return tree_map(lambda g, p: g + factor * p, updates, params), state

    return GradientTransformation(lambda params: EmptyState(), update)


@_alias
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
    from zero.functional.wrappers import masked

    return chain(T.add_decayed_weights(weight_decay, weight_decay_mask),
                 masked(T.scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps), trust_ratio_mask),
                 T.scale_by_learning_rate(learning_rate), T.trace(momentum, nesterov))


@_alias
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


@_alias
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


@_alias
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
    return chain(A.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism), T.scale_by_learning_rate(1.0))


@_alias
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
    return chain(A.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 scale_by_optimistic_gradient(alpha, beta), T.scale_by_learning_rate(learning_rate))


@_alias
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
    from zero.functional.alias import adamw

    return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov=True)


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


@_alias
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


@_alias
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


@_alias
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



@_alias
def sm3(learning_rate: float, momentum: float = 0.9) -> GradientTransformation:
    r"""SM3: Adagrad-like steps whose second moment costs memory per axis, not per element.

    .. math:: v_t = g_t^2 + \min_{axes} \mu_{t-1},\quad
        m_t = \beta m_{t-1} + (1-\beta)\, g_t / \sqrt{v_t + \epsilon},\quad u_t = -\alpha m_t

    Args:
        learning_rate: a float; momentum: ``beta``.

    Returns:
        ``chain(scale_by_sm3(momentum), scale(-learning_rate))`` (``optax.sm3``).

    Reference: Anil et al., Memory-Efficient Adaptive Optimization, 2019.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.sm3(0.1)
        >>> p = torch.ones(2, 2)
        >>> u, _ = tx.update(torch.full((2, 2), 2.0), tx.init(p), p)
        >>> u
        tensor([[-0.0100, -0.0100],
                [-0.0100, -0.0100]])
    """
    return chain(scale_by_sm3(momentum), T.scale(-learning_rate))
