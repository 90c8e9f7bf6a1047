"""Optax's optimizer aliases: each is one `chain` whose docstring carries the maths.

``adam`` and ``adamw`` also carry a ``fused`` fast path (torch's fused Adam kernels) that
`zero.functional.Optimizer` uses to step parameters and state in place; ``update`` stays the
pure reference.
"""

from __future__ import annotations

import torch

from zero.functional import adam_family as A
from zero.functional import transform as T
from zero.functional.base import GradientTransformation, identity
from zero.functional.combine import chain

__all__ = ["sgd", "adam", "adamw", "adagrad", "adadelta", "adamax", "rmsprop", "rprop", "lion",
           "lamb", "nadam", "radam"]


def sgd(learning_rate, momentum: float | None = None, nesterov: bool = False,
        accumulator_dtype: torch.dtype | None = None) -> GradientTransformation:
    """SGD: ``t = g + momentum * t``; ``u = -lr * t`` (``g + momentum * t`` with ``nesterov``)."""
    tr = T.trace(momentum, nesterov, accumulator_dtype) if momentum is not None else identity()
    return chain(tr, T.scale_by_learning_rate(learning_rate))


def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
         mu_dtype: torch.dtype | None = None, *, nesterov: bool = False) -> GradientTransformation:
    """Adam: ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
    ``u = -lr * m_hat / (sqrt(v_hat + eps_root) + eps)`` with ``x_hat = x / (1 - b^t)``."""
    return chain(A.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 T.scale_by_learning_rate(learning_rate))


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
          mu_dtype: torch.dtype | None = None, weight_decay=1e-4, mask=None, *,
          nesterov: bool = False) -> GradientTransformation:
    """AdamW: Adam's rescaling plus decoupled decay, ``u = -lr * (adam(g) + weight_decay * p)``."""
    return chain(A.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 T.add_decayed_weights(weight_decay, mask), T.scale_by_learning_rate(learning_rate))


def adagrad(learning_rate, initial_accumulator_value: float = 0.1, eps: float = 1e-7) -> GradientTransformation:
    """Adagrad: ``s += g^2``; ``u = -lr * g / sqrt(s + eps)`` (0 where ``s = 0``)."""
    return chain(T.scale_by_rss(initial_accumulator_value, eps), T.scale_by_learning_rate(learning_rate))


def adadelta(learning_rate=None, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0.0,
             weight_decay_mask=None) -> GradientTransformation:
    """Adadelta: ``E[g^2] = rho E + (1-rho) g^2``; ``d = sqrt(E[dx^2] + eps) / sqrt(E[g^2] + eps) g``;
    ``E[dx^2] = rho E + (1-rho) d^2``; ``u = -lr * d`` (after coupled weight decay)."""
    return chain(T.add_decayed_weights(weight_decay, weight_decay_mask), T.scale_by_adadelta(rho, eps),
                 T.scale_by_learning_rate(learning_rate))


def adamax(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adamax: ``m = b1 m + (1-b1) g``, ``v = max(|g| + eps, b2 v)``; ``u = -lr * m_hat / v``."""
    return chain(A.scale_by_adamax(b1, b2, eps), T.scale_by_learning_rate(learning_rate))


def rmsprop(learning_rate, decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0,
            eps_in_sqrt: bool = True, centered: bool = False, momentum: float | None = None,
            nesterov: bool = False, bias_correction: bool = False) -> GradientTransformation:
    """RMSProp: ``v = decay v + (1-decay) g^2``; ``u = -lr * g / sqrt(v + eps)``, centred on the
    running mean when ``centered``; then momentum on the scaled updates."""
    scaler = T.scale_by_stddev if centered else T.scale_by_rms
    return chain(scaler(decay, eps, initial_scale, eps_in_sqrt, bias_correction),
                 T.scale_by_learning_rate(learning_rate),
                 T.trace(momentum, nesterov) if momentum is not None else identity())


def rprop(learning_rate: float, eta_minus: float = 0.5, eta_plus: float = 1.2, min_step_size: float = 1e-6,
          max_step_size: float = 50.0) -> GradientTransformation:
    """Rprop: per-element step sizes grow by ``eta_plus`` while the gradient keeps its sign and
    shrink by ``eta_minus`` when it flips; updates move against the gradient's sign."""
    return chain(T.scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size),
                 T.scale(-1.0))


def lion(learning_rate, b1: float = 0.9, b2: float = 0.99, mu_dtype: torch.dtype | None = None,
         weight_decay=1e-3, mask=None) -> GradientTransformation:
    """Lion: ``u = -lr * (sign((1-b1) g + b1 m) + weight_decay p)``; ``m = b2 m + (1-b2) g``."""
    return chain(T.scale_by_lion(b1, b2, mu_dtype), T.add_decayed_weights(weight_decay, mask),
                 T.scale_by_learning_rate(learning_rate))


def lamb(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6, eps_root: float = 0.0,
         weight_decay=0.0, mask=None) -> GradientTransformation:
    """LAMB: Adam's update plus decay, rescaled per tensor by ``|p| / |update|``, times ``-lr``."""
    return chain(A.scale_by_adam(b1, b2, eps, eps_root), T.add_decayed_weights(weight_decay, mask),
                 T.scale_by_trust_ratio(), T.scale_by_learning_rate(learning_rate))


def nadam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
          mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    """NAdam (Optax's form): Adam with the Nesterov look-ahead
    ``m_hat = b1 m / (1 - b1^(t+1)) + (1-b1) g / (1 - b1^t)``."""
    return adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=True)


def radam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
          threshold: float = 5.0, *, nesterov: bool = False) -> GradientTransformation:
    """RAdam: Adam rectified by ``r_t`` once the variance estimate's ``rho_t >= threshold``;
    before that, momentum SGD on ``m_hat``."""
    return chain(A.scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov),
                 T.scale_by_learning_rate(learning_rate))
