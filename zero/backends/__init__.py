"""Execution: the only layer that imports ``torch.distributed``.

It takes plans from `zero` and transformations from `zero.functional` and runs collectives.
Machinery: ``comm`` (collectives), ``sync`` (the param sync), ``local_optimizer``,
``state_dict``. Systems: ``zero_optimizer`` (the wiring of plan -> mode -> local optimizer),
``overlap`` (DDP comm hooks), ``averagers`` and ``post_localsgd``, ``rpc_optimizer``,
``grad_scaler`` (a loss scale that agrees across ranks); ``masters`` (master weights);
``checkpoint`` (sharded checkpoints in torch.distributed.checkpoint's format).
``modes/``: one object per way of executing a plan; a new ZeRO mode goes there.
"""

from zero.backends.averagers import HierarchicalModelAverager
from zero.backends.averagers import PeriodicModelAverager
from zero.backends.averagers import average_parameters
from zero.backends.checkpoint import get_state_dict
from zero.backends.checkpoint import set_state_dict
from zero.backends.grad_scaler import ShardedGradScaler
from zero.backends.overlap import hook_with_zero_step
from zero.backends.overlap import hook_with_zero_step_interleaved
from zero.backends.post_localsgd import PostLocalSGDOptimizer
from zero.backends.post_localsgd import register_post_local_sgd_hook
from zero.backends.rpc_optimizer import DistributedOptimizer
from zero.backends.zero_optimizer import ZeroRedundancyOptimizer

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
