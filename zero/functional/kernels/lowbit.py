"""The in-place step of the low-bit Adam chains (`zero.functional.contrib.adamw_8bit` ...).

Matched from a chain's specs like the fused kernels: ``[decay] scale_by_adam_{8,4}bit [decay]
scale_by_learning_rate``. Param by param, as torchao's ``AdamW8bit`` steps: the moments
advance (`zero.functional.quantize.advance`) and are written back into their codes and
scales in place, and the param takes the step in float32, ``p - lr wd p - lr u`` (decoupled) or
with ``wd p`` added to the gradient first (coupled), rounded once into its dtype. The pure
``update`` computes the same moments; its param update is ``p + (-lr (u + wd p))``, which rounds
differently, so each path is held to torchao by the tests.
"""

from __future__ import annotations

from typing import Any

import torch

from zero.functional.base import Spec, count_inc, without_grad
from zero.functional.kernels.knobs import now
from zero.functional.kernels.matching import decayed_rule, take
from zero.functional.kernels.steps import KernelStep, Lists, advanced, by_decay, marked, rate_of
from zero.functional.quantize import CHUNK_NUMEL, Quantized, advance, direction

__all__ = ["LOWBIT_KERNELS"]

_CORES = {"scale_by_adam_8bit": 8, "scale_by_adam_4bit": 4}


def _lowbit_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    rule = decayed_rule(specs, lambda specs: next((found for name in _CORES if (found := take(specs, name))), None))
    if rule is None or rule[0]:  # maximize: the pure path
        return None
    _, decay, decoupled, core_at, core_spec, lr_at, learning_rate = rule
    bits, args = _CORES[core_spec.name], core_spec.args
    b1, b2, eps, block = args["b1"], args["b2"], args["eps"], args["block_size"]

    @without_grad
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        adam, params = state[core_at], lists.params
        if inplace.placement(params, lists.grads) is None:
            return None
        mu, nu = lists.leaves(adam.mu), lists.leaves(adam.nu)
        grads = lists.clipped(grad_scale_ok=False)[0]
        count = count_inc(adam.count)
        rate = rate_of(learning_rate, state[lr_at])
        for idx, weight_decay in by_decay([list(range(len(params)))], lists.decays(decay)):
            for i in idx:
                _step_one(params[i], grads[i], mu[i], nu[i], int(count), rate, weight_decay, decoupled,
                          (now(b1), now(b2), now(eps), bits, block))
        new = list(state)
        new[core_at] = adam._replace(count=count)
        new[lr_at] = advanced(learning_rate, state[lr_at])
        return tuple(new)

    inplace = marked(inplace, f"zero low-bit Adam ({bits}-bit moments, in place, param by param)", decay,
                     grad_scale=False)
    inplace.calls = lambda lists: len(lists.params)  # one step per param (of chunks: `_step_one`)
    return inplace


def _step_one(p: torch.Tensor, g: torch.Tensor, mu: Any, nu: Any, count: int, rate: float, weight_decay: float,
              decoupled: bool, hyper: tuple) -> None:
    """One param's step, `CHUNK_NUMEL` elements at a time (a whole number of blocks): the
    temporaries of dequantizing and quantizing again (about ten float32s an element) stay those
    of one chunk, whatever the param's size, and the results are the same bits (every operation
    is per element, or per block)."""
    b1, b2, eps, bits, block = hyper
    flat_p, flat_g = p.view(-1), g.reshape(-1)
    step = CHUNK_NUMEL - CHUNK_NUMEL % block if isinstance(mu, Quantized) else CHUNK_NUMEL
    for start in range(0, flat_p.numel(), step):
        end = min(start + step, flat_p.numel())
        m, v = (_chunk(x, start, end, bits, block) for x in (mu, nu))
        _step_chunk(flat_p[start:end], flat_g[start:end], m, v, count, rate, weight_decay, decoupled, hyper)


def _chunk(moment: Any, start: int, end: int, bits: int, block: int) -> Any:
    """Elements ``start:end`` of a moment (views: written in place)."""
    if not isinstance(moment, Quantized):
        return moment.view(-1)[start:end]
    per_byte = 8 // bits
    codes = moment.codes.view(-1)[start // per_byte:end // per_byte]
    return Quantized(codes, moment.scale[start // block:end // block])


def _step_chunk(p: torch.Tensor, g: torch.Tensor, mu: Any, nu: Any, count: int, rate: float, weight_decay: float,
                decoupled: bool, hyper: tuple) -> None:
    b1, b2, eps, bits, block = hyper
    wide = torch.promote_types(p.dtype, torch.float32)
    p32 = p.to(wide)
    if weight_decay and decoupled:
        p32 = p32 - p32 * (rate * weight_decay)
    elif weight_decay:
        g = g.to(wide) + p32 * weight_decay
    m, v, new_mu, new_nu = advance(g, mu, nu, b1, b2, bits, block)
    _write(mu, new_mu)
    _write(nu, new_nu)
    p.copy_(p32 - direction(m, v, count, b1, b2, eps) * rate)


def _write(dst: Any, src: Any) -> None:
    if isinstance(dst, Quantized):
        dst.codes.view(-1).copy_(src.codes.view(-1))
        dst.scale.copy_(src.scale)
    else:
        dst.copy_(src)


LOWBIT_KERNELS = (_lowbit_kernel,)
