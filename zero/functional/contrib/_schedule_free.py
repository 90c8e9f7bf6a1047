"""Schedule-free learning (mirrors ``optax.contrib.schedule_free``, ``schedule_free_sgd``,
``schedule_free_adamw``, ``schedule_free_eval_params`` and ``ScheduleFreeState``, argument for
argument): the params a step leaves are the gradient point ``y``, an interpolation of the base
rule's iterate ``z`` (kept in the state) and the running average ``x`` (what to evaluate), so no
learning-rate decay is needed.

Element-wise, so a piece of a tensor steps as the whole would. The evaluation params are
``x = (y - (1 - b1) z) / b1``: `schedule_free_eval_params` computes them purely, and
`swap_eval` / `swap_train` write them into (and back out of) the params in place, which is what
``Optimizer.eval()`` / ``.train()`` run, as ``schedulefree``'s torch optimizers do.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from zero.functional import transforms as T
from zero.functional.aliases import ScalarOrSchedule, alias
from zero.functional.aliases.sgd import sgd
from zero.functional.base import (
    GradientTransformation,
    as_dtype,
    check_positive,
    lowest_dtype,
    step_count,
    takes_extra_args,
    tree_leaves,
    tree_map,
    update_with,
)
from zero.functional.combine import chain
from zero.functional.schedules.join import warmup_constant_schedule

__all__ = ["ScheduleFreeState", "schedule_free", "schedule_free_sgd", "schedule_free_adamw",
           "schedule_free_eval_params", "swap_eval", "swap_train", "schedule_free_states"]


class ScheduleFreeState(NamedTuple):
    """State of ``schedule_free`` (``optax.contrib.ScheduleFreeState``).

    Fields:
        b1: the interpolation weight, 0-d in the params' lowest dtype.
        weight_sum: the sum of the averaging weights so far; step_count: the next step (from 1),
            0-d int32; max_lr: the largest learning rate seen.
        base_optimizer_state: the base rule's state; z: the base rule's iterate, like the params.
    """

    b1: torch.Tensor
    weight_sum: torch.Tensor
    step_count: torch.Tensor
    max_lr: torch.Tensor
    base_optimizer_state: Any
    z: Any



def schedule_free(base_optimizer: GradientTransformation, learning_rate: ScalarOrSchedule, b1: float = 0.9,
                  weight_lr_power: float = 2.0, state_dtype: Any = None) -> GradientTransformation:
    r"""Make ``base_optimizer`` schedule-free (``optax.contrib.schedule_free``).

    .. math::
        y_t = (1-\beta_1) z_t + \beta_1 x_t,\quad z_{t+1} = z_t + \mathrm{base}(g(y_t)),\quad
        x_{t+1} = (1 - c_{t+1}) x_t + c_{t+1} z_{t+1},\quad
        c_{t+1} = \frac{\gamma_{max}^{p}}{\sum_{i \le t+1} \gamma_{max,i}^{p}}

    Turn the base rule's momentum off (``b1=0`` for Adam): the interpolation replaces it. Evaluate
    at `schedule_free_eval_params` (or ``Optimizer.eval()``).

    Args:
        base_optimizer: the rule whose updates move ``z``.
        learning_rate: its learning rate or schedule (warm-up, no decay), for the averaging weights.
        b1: the interpolation weight, > 0.
        weight_lr_power: the power of the learning rate in the averaging weights.
        state_dtype: dtype ``z`` is kept in (``None``: the params').
    """
    check_positive("b1", b1)
    state_dtype = as_dtype(state_dtype, "state_dtype")
    extra = takes_extra_args(base_optimizer)

    def init(params):
        dtype = lowest_dtype(params)
        z = tree_map(lambda p: p.detach().to(state_dtype or p.dtype, copy=True), params)
        return ScheduleFreeState(torch.tensor(b1, dtype=dtype), torch.zeros((), dtype=dtype),
                                 torch.ones((), dtype=torch.int32), torch.zeros((), dtype=dtype),
                                 base_optimizer.init(params), z)

    def update(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("schedule_free needs the current params: call update(updates, state, params)")
        lr = learning_rate(step_count(state.step_count)) if callable(learning_rate) else learning_rate
        max_lr = torch.maximum(state.max_lr, torch.as_tensor(lr, dtype=state.max_lr.dtype))
        weight = max_lr ** weight_lr_power
        total = state.weight_sum + weight
        ck = torch.where(torch.isnan(weight) | torch.isnan(total), torch.full_like(weight, torch.nan),
                         torch.nan_to_num(weight / total, nan=0.0, posinf=torch.inf))
        base_updates, base_state = (update_with(base_optimizer, updates, state.base_optimizer_state, params, extra_args)
                                    if extra else base_optimizer.update(updates, state.base_optimizer_state, params))
        z = tree_map(lambda zi, ui: (zi + ui).to(zi.dtype), state.z, base_updates)

        def step(y, z_old, z_new):
            x = (1.0 - ck) * ((y - (1.0 - b1) * z_old) / b1) + ck * z_new
            return b1 * x + (1.0 - b1) * z_new - y

        out = tree_map(step, params, state.z, z)
        count = torch.where(state.step_count < 2**31 - 1, state.step_count + 1, state.step_count).to(torch.int32)
        return out, ScheduleFreeState(state.b1, total, count, max_lr, base_state, z)

    return GradientTransformation(init, update)


def schedule_free_eval_params(state: Any, params: Any) -> Any:
    """The params to evaluate at, ``x = (y - (1 - b1) z) / b1`` (``optax.contrib.schedule_free_eval_params``).

    ``state`` is a `ScheduleFreeState`, or a state holding exactly one (a chain's, an injected
    rule's, an `Optimizer` set's); ``params`` are the params the steps left (``y``)."""
    found = [state] if isinstance(state, ScheduleFreeState) else schedule_free_states(state)
    if len(found) == 1:
        state = found[0]
    b1, z = getattr(state, "b1", None), getattr(state, "z", None)
    if b1 is None or z is None:
        raise ValueError(f"schedule_free_eval_params needs a ScheduleFreeState, got {type(state).__name__} holding "
                         f"{len(found)}: pass the state of schedule_free (or of the schedule_free_* aliases), or the "
                         "one wanted of zero.functional.contrib.schedule_free_states(state)")
    return tree_map(lambda y, zi: (y - (1.0 - b1) * zi) / b1, params, z)


def schedule_free_states(state: Any) -> list[ScheduleFreeState]:
    """Every `ScheduleFreeState` inside a (chain's, a masked rule's ...) state, outermost first."""
    def is_state(node: Any) -> bool:
        return isinstance(node, ScheduleFreeState)

    return [s for s in optree.tree_leaves(state, is_leaf=is_state, none_is_leaf=True) if is_state(s)]


@torch.no_grad()
def swap_eval(state: Any, params: list[torch.Tensor]) -> None:
    """Write the evaluation params ``x`` into ``params`` (the leaves ``state`` steps, in its
    order) in place: what ``Optimizer.eval()`` runs. A rule with no schedule-free state: nothing."""
    for sf in schedule_free_states(state):
        b1 = sf.b1
        for y, z in zip(params, tree_leaves(sf.z)):
            y.copy_((y - (1.0 - b1) * z) / b1)


@torch.no_grad()
def swap_train(state: Any, params: list[torch.Tensor]) -> None:
    """Undo `swap_eval`: the gradient point ``y = b1 x + (1 - b1) z`` back into ``params``."""
    for sf in reversed(schedule_free_states(state)):
        b1 = sf.b1
        for x, z in zip(params, tree_leaves(sf.z)):
            x.copy_(b1 * x + (1.0 - b1) * z)


def _warmed(learning_rate: float, warmup_steps: int | None) -> ScalarOrSchedule:
    if warmup_steps is None:
        return learning_rate
    return warmup_constant_schedule(0.0, learning_rate, warmup_steps)


@alias
def schedule_free_sgd(learning_rate: float = 1.0, warmup_steps: int | None = None, b1: float = 0.9,
                      weight_decay: float | None = None, weight_lr_power: float = 2.0,
                      state_dtype: Any = None) -> GradientTransformation:
    """Schedule-free SGD (``optax.contrib.schedule_free_sgd``): `schedule_free` around ``sgd``
    (after ``add_decayed_weights`` when ``weight_decay`` is given), with a linear warm-up of
    ``warmup_steps`` when given.

    Reference: Defazio et al., The Road Less Scheduled, 2024 (arXiv:2405.15682).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.schedule_free_sgd(0.5)
        >>> p = torch.tensor([1.0])
        >>> u, state = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u, F.contrib.schedule_free_eval_params(state, p + u)
        (tensor([-0.1000]), tensor([0.]))
    """
    lr = _warmed(learning_rate, warmup_steps)
    base = sgd(lr) if weight_decay is None else chain(T.add_decayed_weights(weight_decay), sgd(lr))
    return schedule_free(base, lr, b1, weight_lr_power, state_dtype)


@alias
def schedule_free_adamw(learning_rate: float = 0.0025, warmup_steps: int | None = None, b1: float = 0.9,
                        b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                        weight_lr_power: float = 2.0, state_dtype: Any = None) -> GradientTransformation:
    """Schedule-free AdamW (``optax.contrib.schedule_free_adamw``): `schedule_free` around Adam
    without momentum (``scale_by_rms`` with bias correction, ``eps`` outside the root), decoupled
    weight decay and the learning rate, warmed up over ``warmup_steps`` when given.

    Reference: Defazio et al., The Road Less Scheduled, 2024 (arXiv:2405.15682).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.schedule_free_adamw(0.1)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u
        tensor([-0.0100])
    """
    lr = _warmed(learning_rate, warmup_steps)
    base = chain(T.scale_by_rms(decay=b2, eps=eps, eps_in_sqrt=False, bias_correction=True),
                 T.add_decayed_weights(weight_decay), T.scale_by_learning_rate(lr))
    return schedule_free(base, lr, b1, weight_lr_power, state_dtype)


