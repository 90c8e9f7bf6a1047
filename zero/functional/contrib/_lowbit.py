"""Adam and AdamW with 8-bit and 4-bit moments (torchao's ``AdamW8bit``, ``AdamW4bit``,
``Adam8bit``, ``Adam4bit``), whose numbers no sharding changes.

Each moment of a param of at least 4,096 elements that divides into blocks is kept block-wise
quantized (`zero.functional.quantize`: blocks of 256 for 8 bits, 128 for 4); smaller
params keep full-precision moments, in their own dtype. Which params are quantized is decided
by the *whole* param's size, and blocks lie in each param's own element space: under a sharded
optimizer each rank steps whole blocks (a whole-param plan, or a flat plan cut at block edges,
which ``zero.make_plan(..., optimizer="adamw8bit")`` makes), so every rank count gives the same
bits. torchao decides by the size of the *local* tensor (pytorch/ao#4912), and a shard of a
param then gets other state than the param would.

A step, as torchao's: the moments are dequantized to float32, moved toward the gradient, kept
for this step's update in float32 and stored quantized again:

.. math::
    m_t = m_{t-1} + (1 - \\beta_1)(g_t - m_{t-1}), \\quad v_t = v_{t-1} + (1 - \\beta_2)(g_t^2 - v_{t-1}),
    \\quad u_t = \\frac{m_t / (1 - \\beta_1^t)}{\\sqrt{v_t} / \\sqrt{1 - \\beta_2^t} + \\epsilon}

one IEEE operation at a time (no fused multiply-add, whose rounding would depend on where an
element sits in a tensor), so the result of each element is independent of the layout.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import quantize as Q
from zero.functional import sharding
from zero.functional import transforms as T
from zero.functional.aliases import ScalarOrSchedule, alias
from zero.functional.base import (
    GradientTransformation,
    Spec,
    check_non_negative,
    check_unit,
    count_inc,
    count_zero,
    tree_leaves,
    tree_map,
)
from zero.functional.combine import chain
from zero.functional.quantize import advance, direction

__all__ = ["ScaleByLowBitAdamState", "scale_by_adam_8bit", "scale_by_adam_4bit", "adamw_8bit", "adamw_4bit",
           "adam_8bit", "adam_4bit", "MIN_QUANTIZED_NUMEL", "quantizes"]

MIN_QUANTIZED_NUMEL = 4096  # torchao's threshold (bitsandbytes' before it)


class ScaleByLowBitAdamState(NamedTuple):
    """State of ``scale_by_adam_8bit`` / ``scale_by_adam_4bit``.

    Fields:
        count: steps taken, a 0-d int32 tensor.
        mu: first moment, a pytree like the params; each leaf a `zero.functional.quantize.Quantized`
            (signed map) or, for a param kept at full precision, a tensor like the param.
        nu: second moment, likewise (unsigned map).
    """

    count: torch.Tensor
    mu: Any
    nu: Any


def quantizes(numel: int, block_size: int) -> bool:
    """Whether a (whole) param of ``numel`` elements gets quantized moments: torchao's rule."""
    return numel >= MIN_QUANTIZED_NUMEL and numel % block_size == 0


def _check_block(block_size: Any) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"block_size must be an even int >= 2 (two 4-bit codes share a byte), got {block_size!r}")


def _scale_by_lowbit_adam(bits: int, b1: float, b2: float, eps: float, block_size: int) -> GradientTransformation:
    check_unit("b1", b1)
    check_unit("b2", b2)
    check_non_negative("eps", eps)
    _check_block(block_size)
    name = f"scale_by_adam_{bits}bit"
    whole = functools.partial(quantizes, block_size=block_size)

    def init(params):
        leaves = tree_leaves(params)
        kinds = dict(zip(map(id, leaves), sharding.quantized(leaves, block_size, whole, name, bits)))

        def moment(p):
            if not p.is_floating_point():
                raise TypeError(f"{name} keeps real moments and steps float params; got a {p.dtype} param of shape "
                                f"{tuple(p.shape)}")
            if kinds[id(p)]:
                return Q.zeros(p.numel(), tuple(p.shape), bits, block_size, p.device)
            return torch.zeros_like(p)

        return ScaleByLowBitAdamState(count_zero(), tree_map(moment, params), tree_map(moment, params))

    def update(updates, state, params=None):
        count = count_inc(state.count)
        grads, treedef = optree.tree_flatten(updates)
        outs = [_leaf_update(g, m, v, int(count), b1, b2, eps, bits, block_size)
                for g, m, v in zip(grads, treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu))]
        tree = lambda k: treedef.unflatten([out[k] for out in outs])  # noqa: E731
        return tree(0), ScaleByLowBitAdamState(count, tree(1), tree(2))

    spec = Spec(name, {"b1": b1, "b2": b2, "eps": eps, "block_size": block_size})
    return GradientTransformation(init, update, spec=spec)


def _leaf_update(g, mu, nu, count, b1, b2, eps, bits, block_size):
    m, v, mu, nu = advance(g, mu, nu, b1, b2, bits, block_size)
    return direction(m, v, count, b1, b2, eps), mu, nu


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                       block_size: int = 256) -> GradientTransformation:
    """Adam's rescaling with 8-bit block-wise quantized moments (torchao's ``Adam8bit`` state).

    Args:
        b1, b2: decay rates of the first and second moments, in [0, 1).
        eps: added to the debiased root of the second moment.
        block_size: elements per quantization block (torchao's default, 256).

    Returns:
        A transformation with state `ScaleByLowBitAdamState`. Params of fewer than 4,096
        elements, or not a whole number of blocks, keep full-precision moments.
    """
    return _scale_by_lowbit_adam(8, b1, b2, eps, block_size)


def scale_by_adam_4bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                       block_size: int = 128) -> GradientTransformation:
    """`scale_by_adam_8bit` with 4-bit moments (torchao's ``Adam4bit``: a 16-value dynamic map
    for the first moment, the linear map without zero for the second; blocks of 128)."""
    return _scale_by_lowbit_adam(4, b1, b2, eps, block_size)


def _decoupled(bits: int, learning_rate, b1, b2, eps, weight_decay, mask, block_size) -> GradientTransformation:
    core = _scale_by_lowbit_adam(bits, b1, b2, eps, block_size)
    return chain(core, T.add_decayed_weights(weight_decay, mask), T.scale_by_learning_rate(learning_rate))


def _coupled(bits: int, learning_rate, b1, b2, eps, weight_decay, block_size) -> GradientTransformation:
    core = _scale_by_lowbit_adam(bits, b1, b2, eps, block_size)
    return chain(T.add_decayed_weights(weight_decay), core, T.scale_by_learning_rate(learning_rate))


@alias
def adamw_8bit(learning_rate: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
               weight_decay: ScalarOrSchedule = 1e-2, mask: Any = None, *,
               block_size: int = 256) -> GradientTransformation:
    r"""AdamW with 8-bit moments: torchao's ``AdamW8bit`` (its defaults, ``weight_decay=1e-2``),
    whose numbers are the same under any plan and world size.

    .. math::
        u_t = -\eta \left( \frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon} + \lambda\, p_t \right)

    with the moments quantized between steps (`scale_by_adam_8bit`). Stepped in place (inside
    `zero.functional.Optimizer` and ``ZeroRedundancyOptimizer``) it updates each param as
    torchao does, ``p (1 - \eta\lambda) - \eta u``, in float32.

    Returns:
        ``chain(scale_by_adam_8bit(...), add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate))``.

    References:
        Dettmers et al., 8-bit Optimizers via Block-wise Quantization, 2022 (arXiv:2110.02861).
    """
    return _decoupled(8, learning_rate, b1, b2, eps, weight_decay, mask, block_size)


@alias
def adamw_4bit(learning_rate: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
               weight_decay: ScalarOrSchedule = 1e-2, mask: Any = None, *,
               block_size: int = 128) -> GradientTransformation:
    """`adamw_8bit` with 4-bit moments (torchao's ``AdamW4bit``; blocks of 128).

    References:
        Li et al., Memory Efficient Optimizers with 4-bit States, 2023 (arXiv:2309.01507).
    """
    return _decoupled(4, learning_rate, b1, b2, eps, weight_decay, mask, block_size)


@alias
def adam_8bit(learning_rate: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
              weight_decay: ScalarOrSchedule = 0.0, *, block_size: int = 256) -> GradientTransformation:
    """Adam with 8-bit moments (torchao's ``Adam8bit``): ``weight_decay`` is added to the
    gradient before the moments (L2), as torchao's and ``torch.optim.Adam``'s.

    Returns:
        ``chain(add_decayed_weights(weight_decay), scale_by_adam_8bit(...),
        scale_by_learning_rate(learning_rate))``.
    """
    return _coupled(8, learning_rate, b1, b2, eps, weight_decay, block_size)


@alias
def adam_4bit(learning_rate: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
              weight_decay: ScalarOrSchedule = 0.0, *, block_size: int = 128) -> GradientTransformation:
    """`adam_8bit` with 4-bit moments (torchao's ``Adam4bit``; blocks of 128)."""
    return _coupled(4, learning_rate, b1, b2, eps, weight_decay, block_size)
