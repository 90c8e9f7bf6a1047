"""Complex params stepped as pairs of real ones (mirrors ``optax.contrib.split_real_and_imaginary``,
``SplitRealAndImaginaryState`` and ``SplitRealAndImaginaryArrays``): for rules meant for real
numbers. Under a sharded optimizer the pair doubles the leaves the inner rule sees, so an inner
rule that asks about whole tensors is refused there by name; element-wise ones step the same."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from zero.functional.base import GradientTransformation

__all__ = ["SplitRealAndImaginaryArrays", "SplitRealAndImaginaryState", "split_real_and_imaginary"]


class SplitRealAndImaginaryArrays(NamedTuple):
    """A complex tensor as its real and imaginary parts (``optax.contrib.SplitRealAndImaginaryArrays``)."""

    real: torch.Tensor
    imaginary: torch.Tensor


class SplitRealAndImaginaryState(NamedTuple):
    """State of ``split_real_and_imaginary``: the inner rule's (over the real pairs)."""

    inner_state: Any


def _split(x: torch.Tensor) -> Any:
    return SplitRealAndImaginaryArrays(x.real, x.imag) if x.is_complex() else x


def _join(x: Any) -> torch.Tensor:
    return torch.complex(x.real, x.imaginary) if isinstance(x, SplitRealAndImaginaryArrays) else x


def split_real_and_imaginary(inner: GradientTransformation) -> GradientTransformation:
    """``inner`` on every complex leaf's real and imaginary parts as two real leaves, its updates
    joined back into complex ones (``optax.contrib.split_real_and_imaginary``)."""

    def init(params):
        return SplitRealAndImaginaryState(inner.init(optree.tree_map(_split, params)))

    def update(updates, state, params=None):
        split_params = None if params is None else optree.tree_map(_split, params)
        out, inner_state = inner.update(optree.tree_map(_split, updates), state.inner_state, split_params)
        joined = optree.tree_map(_join, out, is_leaf=lambda x: isinstance(x, SplitRealAndImaginaryArrays))
        return joined, SplitRealAndImaginaryState(inner_state)

    return GradientTransformation(init, update)
