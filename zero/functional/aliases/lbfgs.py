"""L-BFGS (``optax.lbfgs``): the quasi-Newton direction of `scale_by_lbfgs` and a line search."""

from __future__ import annotations

from typing import Any

from zero.functional import transforms as T
from zero.functional.aliases import ScalarOrSchedule, alias
from zero.functional.base import GradientTransformation, identity
from zero.functional.combine import chain
from zero.functional.transforms.lbfgs import scale_by_lbfgs
from zero.functional.transforms.linesearch import scale_by_zoom_linesearch

__all__ = ["lbfgs"]

_DEFAULT = object()


@alias
def lbfgs(learning_rate: ScalarOrSchedule | None = None, memory_size: int = 10, scale_init_precond: bool = True,
          linesearch: Any = _DEFAULT) -> GradientTransformation:
    r"""L-BFGS (``optax.lbfgs``): ``chain(scale_by_lbfgs, scale(-1) or scale_by_learning_rate,
    linesearch)``; by default a zoom line search (strong Wolfe, 20 trials, a first guess of 1).

    The line search needs the loss: ``update(grads, state, params, value=loss, grad=grads,
    value_fn=loss_fn)`` on the pure path (`value_and_grad_from_state` reuses its last trial), or
    ``Optimizer.step(closure)`` as ``torch.optim.LBFGS`` takes it (the closure evaluates the loss and
    its gradients at each trial). ``linesearch=None`` steps at the learning rate instead.

    Reference: Nocedal and Wright, Numerical Optimization, 2006, Algorithm 7.4.

    Example:
        >>> import torch, zero.functional as F
        >>> f = lambda p: ((p["x"] - 3.0) ** 2).sum()
        >>> tx, p = F.lbfgs(), {"x": torch.zeros(2, dtype=torch.float64)}
        >>> state = tx.init(p)
        >>> for _ in range(3):
        ...     value, grad = F.value_and_grad_from_state(f)(p, state=state)
        ...     u, state = tx.update(grad, state, p, value=value, grad=grad, value_fn=f)
        ...     p = F.apply_updates(p, u)
        >>> p["x"]
        tensor([3., 3.], dtype=torch.float64)
    """
    search = scale_by_zoom_linesearch(max_linesearch_steps=20, initial_guess_strategy="one") \
        if linesearch is _DEFAULT else linesearch
    return chain(scale_by_lbfgs(memory_size, scale_init_precond),
                 T.scale(-1.0) if learning_rate is None else T.scale_by_learning_rate(learning_rate),
                 identity() if search is None else search)
