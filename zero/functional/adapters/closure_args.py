"""What ``Optimizer.step(closure)`` hands a rule that reads the loss again (a line search, as
``torch.optim.LBFGS`` takes a closure): Optax's extra args ``value`` (the closure's loss),
``grad`` (the gradients the step started from) and ``value_fn`` (the loss at other params: each
trial writes them into the params, runs the closure, reads the loss and the gradients it left, and
puts the params back), for one set of params stepped together.

Under a sharded optimizer a rank holds pieces: the loss at other params would need every rank's
trial written and gathered before the closure runs, which the executors do not do; a trial there
is a ``ValueError`` saying so (the rule's first trial, on every rank alike)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from zero.functional.sharding.context import SHARDING, current

__all__ = ["CLOSURE", "with_closure_args"]

CLOSURE = "_closure"  # the extra arg `Optimizer.step` carries the closure in, to the set's step


def with_closure_args(extra_args: dict, tree: Any, grads: Any) -> dict:
    """``extra_args`` with the closure replaced by ``grad`` and ``value_fn`` for the params ``tree``."""
    closure = extra_args[CLOSURE]
    out = {k: v for k, v in extra_args.items() if k != CLOSURE}
    out.setdefault("grad", optree.tree_map(lambda g: g.detach().clone(), grads))
    out.setdefault("value_fn", _value_fn(closure, tree))
    return out


def _value_fn(closure: Callable[[], Any], tree: Any) -> Callable[[Any], Any]:
    def value_and_grad(candidate: Any) -> tuple[torch.Tensor, Any]:
        if current(SHARDING) is not None:
            raise ValueError("this rule evaluates the loss at other params (a line search), which needs the whole "
                             "params on every rank: under a sharded optimizer (ZeRO, FSDP2) it is not supported; "
                             "step it with zero.functional.Optimizer on plain params, or use a rule without one")
        params, treedef = optree.tree_flatten(tree)
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, c in zip(params, treedef.flatten_up_to(candidate)):
                p.copy_(c)
        try:
            with torch.enable_grad():
                loss = closure()
            grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
        return torch.as_tensor(loss).detach(), treedef.unflatten(grads)

    def value_fn(candidate: Any) -> torch.Tensor:
        return value_and_grad(candidate)[0]

    value_fn.value_and_grad = value_and_grad
    return value_fn
