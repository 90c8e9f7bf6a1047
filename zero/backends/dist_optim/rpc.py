"""`DistributedOptimizer`: step parameters that live on other RPC workers, with torch's semantics.

The client groups the parameter RRefs by owner and asks each owner, in parallel, to build a
local optimizer over its own params; `DistributedOptimizer.step` asks every owner, in parallel,
to read that distributed-autograd context's gradients and step, and waits for all of them.

Local optimizers come from `zero.functional`: a ``torch.optim`` class runs as
``from_torch(cls, ...)``, any other callable is a factory returning a `GradientTransformation`.
They are sent as a recipe (class or factory, arguments) and built on the worker, because
transformations are closures and do not pickle; a factory must therefore be importable there,
as torch requires of custom optimizer classes.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from zero.functional import FunctionalOptimizer, GradientTransformation, from_torch
from zero.functional.adapters.group_settings import check_not_optax

__all__ = ["DistributedOptimizer", "local_transformation"]

# One lock per worker process, as torch: every DistributedOptimizer stepping params here (one per
# trainer, usually over the same params) applies one context's gradients at a time.
_STEP_LOCK = threading.Lock()


def local_transformation(optimizer_class: Any, args: tuple, kwargs: dict) -> tuple[GradientTransformation, bool]:
    """The transformation a worker runs, and whether its state is kept per param.

    A ``torch.optim`` class steps each param alone (its rules are per param, and torch skips a
    param without a gradient, so its state must not advance); a factory's transformation may
    couple params (global-norm clipping), so a worker steps its params together.
    """
    check_not_optax(optimizer_class, "optimizer_class")
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer):
        try:
            bound = inspect.signature(optimizer_class).bind(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{optimizer_class.__name__}{args + tuple(kwargs.items())}: {e}") from None
        options = dict(list(bound.arguments.items())[1:])  # drop ``params``
        return from_torch(optimizer_class, **options), True
    if isinstance(optimizer_class, GradientTransformation):
        raise TypeError("optimizer_class is a GradientTransformation instance, which cannot be sent to other "
                        "workers (its functions are closures): pass the factory that builds it, e.g. "
                        "zero.functional.adam with its hyperparameters, or a module-level function")
    if callable(optimizer_class) and not isinstance(optimizer_class, type):
        tx = optimizer_class(*args, **kwargs)
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"optimizer_class {optimizer_class!r} returned {type(tx).__name__}, "
                            "not a GradientTransformation")
        return tx, False
    raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass or a factory returning a "
                    f"zero.functional GradientTransformation, got {optimizer_class!r}")


class _LocalOptimizer:
    """Lives on a worker: its params (RRef values) and their functional optimizers."""

    def __init__(self, recipe: tuple[Any, tuple, dict], param_rrefs: list[rpc.RRef]):
        self.params = [rref.local_value() for rref in param_rrefs]
        for i, p in enumerate(self.params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params_rref {i} on {rpc.get_worker_info().name} holds a "
                                f"{type(p).__name__}, not a tensor")
        tx, self.per_param = local_transformation(*recipe)
        self.optim = FunctionalOptimizer(self.params, tx, per_param=self.per_param)

    def step(self, context_id: int) -> None:
        """Apply this context's gradients.

        A param without a gradient in the context is skipped under a torch class (torch's rule;
        its state does not advance) and gets a zero gradient under a factory (Optax's: every
        param has a gradient, zero when it did not take part), so a factory's state stays one
        state over all the params.
        """
        grads = dist_autograd.get_gradients(context_id)
        found = [grads.get(p) for p in self.params]
        if not self.per_param:
            found = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, found)]
        with _STEP_LOCK:
            self.optim.step(found)


def _new_local_optimizer(recipe: tuple, param_rrefs: list[rpc.RRef]) -> rpc.RRef:
    return rpc.RRef(_LocalOptimizer(recipe, param_rrefs))


def _local_step(optim_rref: rpc.RRef, context_id: int) -> None:
    optim_rref.local_value().step(context_id)


class DistributedOptimizer:
    """Step params scattered over RPC workers, each on its owner (``torch.distributed.optim``'s API).

    ``optimizer_class``: a ``torch.optim`` class (run as `zero.functional.from_torch`) or a
    factory returning a `GradientTransformation` (e.g. ``zero.functional.adamw``); ``*args`` and
    ``**kwargs`` are its arguments. ``params_rref``: RRefs to the params, local or remote.

    Concurrent `step` calls, from one client or several, are serialised on each worker; nothing
    orders them across workers (as in torch).
    """

    def __init__(self, optimizer_class: Any, params_rref: list[rpc.RRef], *args: Any, **kwargs: Any):
        local_transformation(optimizer_class, args, kwargs)  # bad options fail here, not on a worker
        params_rref = _check_rrefs(params_rref)
        by_owner: dict[Any, list[rpc.RRef]] = {}
        for rref in params_rref:
            by_owner.setdefault(rref.owner(), []).append(rref)
        recipe = (optimizer_class, args, kwargs)
        calls = {owner.name: rpc.rpc_async(owner, _new_local_optimizer, args=(recipe, rrefs))
                 for owner, rrefs in by_owner.items()}
        self.remote_optimizers = _wait_for_all(calls, "building the local optimizers", None)

    def step(self, context_id: int, timeout: float | None = None) -> None:
        """Step every worker's params with the gradients of ``context_id``; wait for all of them.

        ``timeout`` (seconds) bounds each worker's answer; None: the RPC agent's default. A
        worker that fails or does not answer raises a ``RuntimeError`` naming it, after the
        other workers have finished.
        """
        if isinstance(context_id, bool) or not isinstance(context_id, int):
            raise TypeError(f"context_id must be the int of a dist_autograd.context(), got {context_id!r}")
        seconds = rpc.get_rpc_timeout() if timeout is None else timeout
        calls = {optim.owner().name: rpc.rpc_async(optim.owner(), _local_step, args=(optim, context_id),
                                                   timeout=seconds)
                 for optim in self.remote_optimizers}
        _wait_for_all(calls, f"step(context_id={context_id})", seconds)


def _check_rrefs(params_rref: Any) -> list[rpc.RRef]:
    if isinstance(params_rref, (rpc.PyRRef, torch.Tensor)) or not hasattr(params_rref, "__iter__"):
        raise TypeError(f"params_rref must be a list of RRefs, got {type(params_rref).__name__}")
    params_rref = list(params_rref)
    if not params_rref:
        raise ValueError("DistributedOptimizer got an empty params_rref list")
    for i, rref in enumerate(params_rref):
        if not isinstance(rref, rpc.PyRRef):
            raise TypeError(f"params_rref[{i}] is a {type(rref).__name__}, not an RRef")
    return params_rref


def _wait_for_all(calls: dict[str, torch.futures.Future], what: str, timeout: float | None) -> list:
    """Every call's result, waiting for all; one error naming each worker that failed."""
    results, failures = [], []
    for name, fut in calls.items():
        try:
            results.append(fut.wait())
        except Exception as e:  # noqa: BLE001 - collected, then raised together below
            first_line = (str(e).strip() or type(e).__name__).splitlines()[0]
            late = timeout is not None and "timeout" in first_line.lower()  # the RPC agent's own wording
            reason = f"did not answer within the RPC timeout of {timeout:g} s" if late else "failed"
            failures.append(f"{name} {reason}: {first_line}")
    if failures:
        raise RuntimeError(f"DistributedOptimizer {what}: " + "; ".join(failures))
    return results

