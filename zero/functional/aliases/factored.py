"""Rules whose second moments take less memory than the params: ``adafactor``, ``sm3``.

Each alias is one `chain` whose docstring carries the maths, and mirrors the Optax function of
the same name (same arguments, defaults and state layout); ``tests/functional/test_functional_optax_parity.py``
proves them equal. Where Optax's rule and the ``torch.optim`` class of the same name differ, the
docstring says how; `zero.functional.from_torch` gives torch's rule exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from zero.functional import transforms as T
from zero.functional.aliases import ScalarOrSchedule, alias
from zero.functional.base import (
    GradientTransformation,
)
from zero.functional.combine import chain
from zero.functional.transforms.factorized import scale_by_factored_rms, scale_by_param_block_rms, scale_by_sm3

__all__ = ['adafactor', 'sm3']


@alias
def adafactor(learning_rate: ScalarOrSchedule | None = None, min_dim_size_to_factor: int = 128,
              decay_rate: float = 0.8, decay_offset: int = 0, multiply_by_parameter_scale: bool = True,
              clipping_threshold: float | None = 1.0, momentum: float | None = None,
              dtype_momentum: torch.dtype | str = torch.float32, weight_decay_rate: ScalarOrSchedule | None = None,
              eps: float = 1e-30, factored: bool = True, weight_decay_mask: Any = None) -> GradientTransformation:
    r"""Adafactor: Adam-like steps with factored second moments and relative step sizes.

    .. math:: u_t = -\alpha_t\, \mathrm{RMS}(p)\, \mathrm{clip}\big(g_t / \sqrt{\hat V_t}\big),\quad
        \hat V_t = R_t C_t / \mathrm{mean}(R_t)

    Args:
        learning_rate: a float or a schedule (``None``: no scaling, as Optax).
        min_dim_size_to_factor, decay_rate, decay_offset, eps, factored: as in `scale_by_factored_rms`.
        multiply_by_parameter_scale: scale by each param's root mean square (`scale_by_param_block_rms`).
        clipping_threshold: clip each update's root mean square (``None``: no clipping).
        momentum, dtype_momentum: an optional moving average of the updates, and its dtype.
        weight_decay_rate, weight_decay_mask: optional decoupled weight decay, and where.

    Returns:
        The chain of ``optax.adafactor``. torch's ``Adafactor`` (2.5+) follows the paper's
        later form (no clipping by default, other decay); `from_torch` does not cover it.

    Reference: Shazeer and Stern, Adafactor: Adaptive Learning Rates with Sublinear Memory Cost, 2018.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.adafactor(0.1)
        >>> p = torch.full((2, 2), 3.0)
        >>> u, _ = tx.update(torch.ones(2, 2), tx.init(p), p)
        >>> u
        tensor([[-0.3000, -0.3000],
                [-0.3000, -0.3000]])
    """
    from zero.functional.transforms.clipping import clip_by_block_rms

    links = [scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps)]
    if clipping_threshold is not None:
        links.append(clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        links.append(T.scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        links.append(scale_by_param_block_rms())
    if momentum is not None:
        links.append(T.ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None:
        links.append(T.add_decayed_weights(weight_decay_rate, mask=weight_decay_mask))
    links.append(T.scale(-1))
    return chain(*links)


@alias
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
