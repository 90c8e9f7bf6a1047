"""Running Optax on torch tensors, and moving optimizer state between the two frameworks.

Tensors cross through DLPack, which shares memory where the device allows (CPU and CUDA
buffers JAX can read in place) instead of copying. JAX is imported on first use only, so
``import zero.functional`` never loads it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from zero.functional import base, inject, transforms
from zero.functional.base import GradientTransformation, Spec

__all__ = ["from_optax", "to_optax_state", "from_optax_state"]


def _jax():
    import jax

    return jax


def _to_jax(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return _jax().dlpack.from_dlpack(t)
    return x


def _to_torch(x: Any) -> Any:
    jax = _jax()
    if isinstance(x, jax.Array):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x  # a PRNG key (e.g. optax.add_noise's) has no torch counterpart: it stays JAX's
        return torch.from_dlpack(x)
    return x


def _map(fn, tree):
    return _jax().tree_util.tree_map(fn, tree)


def from_optax(optax_tx: Any, *, per_tensor: bool = False) -> GradientTransformation:
    """Run any Optax transformation on torch tensors.

    ``init`` and ``update`` take and return torch pytrees; the state keeps Optax's classes with
    torch leaves. Extra args of ``update`` (``value=``...) go to the Optax transformation. The
    update is ``jax.jit``-compiled once per tree structure (jit's cache).

    ``per_tensor=True`` declares that the transformation treats each tensor alone (``optax.adam``,
    ``lion``, ``adafactor``: no ``clip_by_global_norm``, no norm over several tensors), which zero
    cannot see in Optax's code: a sharded optimizer then steps each param whole on the rank that
    owns it. Without it, a sharded optimizer whose ranks each step some of the params refuses the
    transformation (a ``ValueError``): Optax's code would read only the rank's own tensors.
    """
    if not (hasattr(optax_tx, "init") and hasattr(optax_tx, "update")):
        raise TypeError(f"from_optax needs an Optax GradientTransformation, got {type(optax_tx).__name__}")
    if not isinstance(per_tensor, bool):
        raise TypeError(f"from_optax: per_tensor must be True or False, got {per_tensor!r}")
    # Its states hold Optax's classes: let torch.load(weights_only=True) read checkpoints of them.
    torch.serialization.add_safe_globals(list(_optax_classes().values()))

    @functools.cache
    def jitted():
        return _jax().jit(_extra_args_update(optax_tx))

    def init(params):
        return _map(_to_torch, optax_tx.init(_map(_to_jax, params)))

    def update(updates, state, params=None, **extra_args):
        args = (_map(_to_jax, updates), _map(_to_jax, state), None if params is None else _map(_to_jax, params))
        arrays = {k: _to_jax(v) for k, v in extra_args.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in extra_args.items() if k not in arrays}
        # Extra args that are not arrays (a function, a flag) are static: compiled into the call.
        step = _jax().jit(functools.partial(_extra_args_update(optax_tx), **others)) if others else jitted()
        new_updates, new_state = step(*args, **arrays)
        return _map(_to_torch, new_updates), _map(_to_torch, new_state)

    return GradientTransformation(init, update, spec=_injected_spec(optax_tx, per_tensor))


def _extra_args_update(optax_tx: Any):
    """``optax_tx.update``, taking (and for a plain transformation ignoring) extra args."""
    import optax

    return optax.with_extra_args_support(optax_tx).update


def _injected_spec(optax_tx: Any, per_tensor: bool) -> Spec:
    """Names the bridge (sharded backends cannot see into Optax's code), with the hyperparameters
    of ``optax.inject_hyperparams(...)(...)``, which Optax keeps only in its state: read from a
    state made for no params (none for any other transformation)."""
    try:
        state = optax_tx.init({})
    except Exception:  # noqa: BLE001 - an Optax transformation that needs params has no injected values
        state = None
    hyperparams = getattr(state, "hyperparams", None)
    if not isinstance(hyperparams, dict) or not hasattr(state, "inner_state"):
        hyperparams = {}
    return Spec("from_optax", {"hyperparams": {k: float(v) for k, v in hyperparams.items()}, "per_tensor": per_tensor})


@functools.cache
def _optax_classes() -> dict[str, type]:
    """Optax's state classes by name (ours share the names and fields)."""
    import optax
    from optax._src import base, transform
    from optax.transforms import _accumulation, _conditionality, _masking

    found = {}
    for module in (base, transform, _masking, _conditionality, _accumulation, optax):
        for name in dir(module):
            obj = getattr(module, name)
            if isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_fields"):
                found.setdefault(name, obj)
    return found


@functools.cache
def _our_classes() -> dict[str, type]:
    """Our state classes by name: those of the core and the transformations (the layer below)."""
    return {name: getattr(m, name) for m in (base, inject, transforms) for name in m.__all__
            if isinstance(getattr(m, name), type) and hasattr(getattr(m, name), "_fields") and name != "Spec"}


def _convert(node: Any, leaf, classes: dict[str, type]) -> Any:
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        name = type(node).__name__
        if name not in classes:
            raise ValueError(f"no counterpart for state class {name} in the other framework")
        return classes[name](*(_convert(x, leaf, classes) for x in node))
    if isinstance(node, (list, tuple)):
        return type(node)(_convert(x, leaf, classes) for x in node)
    if isinstance(node, dict):
        return {k: _convert(v, leaf, classes) for k, v in node.items()}
    return leaf(node)


def to_optax_state(state: Any) -> Any:
    """A `zero.functional` state as the Optax state of the same transformation (JAX leaves)."""
    _check_transformation_state(state, "to_optax_state")
    return _convert(state, _to_jax, _optax_classes())


def from_optax_state(state: Any) -> Any:
    """An Optax state as the `zero.functional` state of the same transformation (torch leaves)."""
    _check_transformation_state(state, "from_optax_state")
    return _convert(state, _to_torch, _our_classes())


def _check_transformation_state(state: Any, who: str) -> None:
    if isinstance(state, dict) and {"state", "param_groups"} <= state.keys():
        raise TypeError(f"{who} takes a transformation's state (tx.init(params), or one of the values in "
                        "Optimizer.state_dict()['tx_states']), not a torch optimizer state_dict")
