"""Execution: the only layer that imports ``torch.distributed``.

It takes plans from `zero` and transformations from `zero.functional` and runs them. Where things
live, one line each:

- ``zero_optimizer``: `ZeroRedundancyOptimizer`, the wiring plan -> mode -> rank state.
- ``rank_state``: `RankState`, what a rank holds (its holdings, local optimizer, masters) and its local step.
- ``modes/``: one executor per way of running a plan (live buffers, gradients, syncs); a new mode goes there.
- ``grads/``: ZeRO-2's gradients reduced during backward (a source over a bucket engine, DDP's unused-param
  protocol); ``comm.Reducer`` the collective a bucket takes (`MeanReducer`; ``int8_reducer``: `Int8Reducer`).
- ``checkpoint/``: the state formats, each written once over a rank's holdings; a new format goes there.
- ``comm``: the collectives; ``sync``: the params' sync after a step; ``local_optimizer``: what a rank steps with.
- ``consistency``: every rank in the same call, alive (check-ins, heartbeats, naming the rank that stopped).
- ``precision``: master weights, loss scaling (`ShardedGradScaler`), the dtypes a run steps and reduces in.
- ``ddp_hooks``: DDP comm hooks that step a ZeRO optimizer inside backward.
- ``dist_optim/``: torch.distributed.optim's other members (averagers, post-local SGD, RPC).
- ``jax_mesh/``: the same plans executed on a JAX device mesh (jax and optax, never torch).
"""

from zero._lazy import module_getattr

_LAZY = {  # name -> module: loaded on first access, so zero.backends.jax_mesh never loads torch
    "HierarchicalModelAverager": "zero.backends.dist_optim.averagers",
    "PeriodicModelAverager": "zero.backends.dist_optim.averagers",
    "average_parameters": "zero.backends.dist_optim.averagers",
    "get_state_dict": "zero.backends.checkpoint",
    "set_state_dict": "zero.backends.checkpoint",
    "ShardedGradScaler": "zero.backends.precision",
    "hook_with_zero_step": "zero.backends.ddp_hooks",
    "hook_with_zero_step_interleaved": "zero.backends.ddp_hooks",
    "PostLocalSGDOptimizer": "zero.backends.dist_optim.post_localsgd",
    "register_post_local_sgd_hook": "zero.backends.dist_optim.post_localsgd",
    "DistributedOptimizer": "zero.backends.dist_optim.rpc",
    "RankState": "zero.backends.rank_state",
    "MeanReducer": "zero.backends.comm",
    "Int8Reducer": "zero.backends.int8_reducer",
    "ZeroRedundancyOptimizer": "zero.backends.zero_optimizer",
}

__all__ = [
    "DistributedOptimizer",
    "HierarchicalModelAverager",
    "Int8Reducer",
    "MeanReducer",
    "PeriodicModelAverager",
    "PostLocalSGDOptimizer",
    "RankState",
    "ShardedGradScaler",
    "ZeroRedundancyOptimizer",
    "average_parameters",
    "get_state_dict",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "register_post_local_sgd_hook",
    "set_state_dict",
]


__getattr__ = module_getattr(__name__, _LAZY)  # and every submodule (zero.backends.checkpoint ...)
