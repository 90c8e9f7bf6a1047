"""Execution: the only layer that imports ``torch.distributed``.

It takes plans from `zero` and transformations from `zero.functional` and runs collectives.
Machinery: ``comm`` (collectives), ``sync`` (the param sync), ``local_optimizer``,
``state_dict``. Systems: ``zero_optimizer`` (the wiring of plan -> mode -> local optimizer),
``overlap`` (DDP comm hooks), ``averagers`` and ``post_localsgd``, ``rpc_optimizer``,
``grad_scaler`` (a loss scale that agrees across ranks); ``masters`` (master weights);
``checkpoint`` (sharded checkpoints in torch.distributed.checkpoint's format).
``modes/``: one object per way of executing a plan; a new ZeRO mode goes there.
``jax_mesh``: the same plans executed on a JAX device mesh (jax and optax, never torch).
"""

_LAZY = {  # name -> module: loaded on first access, so zero.backends.jax_mesh never loads torch
    "HierarchicalModelAverager": "zero.backends.averagers",
    "PeriodicModelAverager": "zero.backends.averagers",
    "average_parameters": "zero.backends.averagers",
    "get_state_dict": "zero.backends.checkpoint",
    "set_state_dict": "zero.backends.checkpoint",
    "ShardedGradScaler": "zero.backends.grad_scaler",
    "hook_with_zero_step": "zero.backends.overlap",
    "hook_with_zero_step_interleaved": "zero.backends.overlap",
    "PostLocalSGDOptimizer": "zero.backends.post_localsgd",
    "register_post_local_sgd_hook": "zero.backends.post_localsgd",
    "DistributedOptimizer": "zero.backends.rpc_optimizer",
    "ZeroRedundancyOptimizer": "zero.backends.zero_optimizer",
}

__all__ = [
    "DistributedOptimizer",
    "HierarchicalModelAverager",
    "PeriodicModelAverager",
    "PostLocalSGDOptimizer",
    "ShardedGradScaler",
    "ZeroRedundancyOptimizer",
    "average_parameters",
    "get_state_dict",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "register_post_local_sgd_hook",
    "set_state_dict",
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zero.backends' has no attribute {name!r}")
