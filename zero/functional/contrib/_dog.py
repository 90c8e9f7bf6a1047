"""DoG and DoWG: step sizes from the distance travelled over the gradients seen (mirrors
``optax.contrib.scale_by_dog``, ``dog``, ``scale_by_dowg``, ``dowg`` and their states, argument for
argument). Their distances and gradient norms are over the whole model: asked of
`zero.functional.sharding` (`total_sums`, one all-reduce a step when sharded)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zero.functional import transforms as T
from zero.functional.aliases import Mask, ScalarOrSchedule, alias
from zero.functional.base import (
    NO_PARAMS_MSG,
    GradientTransformation,
    identity,
    lowest_dtype,
    tree_leaves,
    tree_map,
)
from zero.functional.combine import chain
from zero.functional.elementwise import abs_sq
from zero.functional.sharding import total_sums

__all__ = ["DoGState", "scale_by_dog", "dog", "DoWGState", "scale_by_dowg", "dowg"]

INIT_STEPS = ("distance", "learning_rate", "heuristic")


class DoGState(NamedTuple):
    """State of ``scale_by_dog`` (``optax.contrib.DoGState``).

    Fields:
        is_init_step: whether the next step is the first (0-d bool); init_params: the start;
        max_dist: the largest distance from the start so far; sum_sq_norm_grads: the sum of the
        gradients' squared norms (0-d, params' lowest dtype).
    """

    is_init_step: torch.Tensor
    init_params: Any
    max_dist: torch.Tensor
    sum_sq_norm_grads: torch.Tensor


class DoWGState(NamedTuple):
    """State of ``scale_by_dowg`` (``optax.contrib.DoWGState``).

    Fields:
        init_params: the start; weighted_sq_norm_grads: the distance-weighted sum of squared
        gradient norms; estim_sq_dist: the largest squared distance so far (0-d).
    """

    init_params: Any
    weighted_sq_norm_grads: torch.Tensor
    estim_sq_dist: torch.Tensor


def _squares(trees: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each list's squared norm over the whole model, the lists in one collective when sharded."""
    return total_sums(*[[abs_sq(x) for x in leaves] for leaves in trees])


def _distance_and_grads(updates: Any, start: Any, params: Any) -> tuple[torch.Tensor, torch.Tensor]:
    moved = [x0 - p for x0, p in zip(tree_leaves(start), tree_leaves(params))]
    return tuple(_squares([moved, tree_leaves(updates)]))


def scale_by_dog(init_step: tuple[str, float], eps: float = 1e-8) -> GradientTransformation:
    r"""DoG's rescaling (``optax.contrib.scale_by_dog``): the step size is
    :math:`\bar r_t / \sqrt{\sum_{i \le t} \lVert g_i\rVert^2 + \epsilon}`, :math:`\bar r_t` the largest
    distance from the start so far (at first: ``init_step``'s ``"distance"``, ``"heuristic"``
    ``value (1 + |x_0|)``, or a first step of ``"learning_rate"``)."""
    kind, value = init_step
    if kind not in INIT_STEPS:
        raise ValueError(f"Invalid init_step specification for scale_by_dog: init_step_type={kind!r}; "
                         f"one of {INIT_STEPS}")

    def init(params):
        dtype = lowest_dtype(params)
        if kind == "heuristic":
            (norm_sq,) = _squares([tree_leaves(params)])
            r = value * (1 + torch.sqrt(norm_sq))
        else:
            r = value if kind == "distance" else 0.0
        return DoGState(torch.tensor(True), tree_map(lambda p: p.detach().clone(), params),
                        torch.as_tensor(r, dtype=dtype).clone(), torch.zeros((), dtype=dtype))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        dist_sq, grad_sq = _distance_and_grads(updates, state.init_params, params)
        max_dist = torch.maximum(state.max_dist, torch.sqrt(dist_sq).to(state.max_dist.dtype))
        sums = state.sum_sq_norm_grads + grad_sq.to(state.sum_sq_norm_grads.dtype)
        lr = max_dist / torch.sqrt(sums + eps)
        if kind == "learning_rate":
            lr = torch.where(state.is_init_step, torch.as_tensor(value, dtype=lr.dtype), lr)
        out = tree_map(lambda u: lr.to(u.dtype) * u, updates)
        return out, DoGState(torch.tensor(False), state.init_params, max_dist, sums)

    return GradientTransformation(init, update)


@alias
def dog(learning_rate: ScalarOrSchedule = 1.0, init_step: tuple[str, float] = ("heuristic", 1e-6),
        eps: float = 1e-8, weight_decay: float | None = None, mask: Mask | None = None) -> GradientTransformation:
    """DoG, "Distance over Gradients" (``optax.contrib.dog``): a parameter-free step size from
    the distance travelled, times ``learning_rate`` (1.0: none).

    Returns:
        ``chain(add_decayed_weights or identity, scale_by_dog, scale_by_learning_rate)``.

    Reference: Ivgi et al., DoG is SGD's Best Friend, 2023 (arXiv:2302.12022).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.dog(init_step=("distance", 0.5))
        >>> p = torch.tensor([3.0, 4.0])
        >>> u, _ = tx.update(torch.tensor([3.0, 4.0]), tx.init(p), p)  # 0.5 / |g| along -g
        >>> u
        tensor([-0.3000, -0.4000])
    """
    return chain(T.add_decayed_weights(weight_decay, mask) if weight_decay is not None else identity(),
                 scale_by_dog(init_step, eps), T.scale_by_learning_rate(learning_rate))


def scale_by_dowg(init_estim_sq_dist: float | None = None, eps: float = 1e-4) -> GradientTransformation:
    r"""DoWG's rescaling (``optax.contrib.scale_by_dowg``): the step size is
    :math:`\bar r_t^2 / (\sqrt{\sum_{i \le t} \bar r_i^2 \lVert g_i\rVert^2} + \epsilon)`."""

    def init(params):
        dtype = lowest_dtype(params)
        first = eps if init_estim_sq_dist is None else init_estim_sq_dist
        return DoWGState(tree_map(lambda p: p.detach().clone(), params), torch.zeros((), dtype=dtype),
                         torch.as_tensor(first, dtype=dtype).clone())

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        dist_sq, grad_sq = _distance_and_grads(updates, state.init_params, params)
        estim = torch.maximum(state.estim_sq_dist, dist_sq.to(state.estim_sq_dist.dtype))
        weighted = estim * grad_sq.to(estim.dtype) + state.weighted_sq_norm_grads
        lr = estim / (torch.sqrt(weighted) + eps)
        out = tree_map(lambda u: lr.to(u.dtype) * u, updates)
        return out, DoWGState(state.init_params, weighted, estim)

    return GradientTransformation(init, update)


@alias
def dowg(learning_rate: ScalarOrSchedule = 1.0, init_estim_sq_dist: float | None = None, eps: float = 1e-4,
         weight_decay: float | None = None, mask: Mask | None = None) -> GradientTransformation:
    """DoWG, "Distance over Weighted Gradients" (``optax.contrib.dowg``).

    Returns:
        ``chain(add_decayed_weights or identity, scale_by_dowg, scale_by_learning_rate)``.

    Reference: Khaled et al., DoWG Unleashed: An Efficient Universal Parameter-Free
    Gradient Descent Method, 2023 (arXiv:2305.16284).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.dowg()
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> float(u) < 0
        True
    """
    return chain(T.add_decayed_weights(weight_decay, mask) if weight_decay is not None else identity(),
                 scale_by_dowg(init_estim_sq_dist, eps), T.scale_by_learning_rate(learning_rate))
