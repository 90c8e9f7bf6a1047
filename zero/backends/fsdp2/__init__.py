"""zero's rules over FSDP2's params: `zero.functional.Optimizer(model.parameters(), tx)` over a
``fully_shard``-ed model steps every rule exactly as on the unsharded params (`executor`, found by
`zero.functional.adapters.executor`), by the plan of `zero.plans.fsdp2`; over HSDP's mesh
`zero.ZeroRedundancyOptimizer` (`ReplicaShardedOptimizer`) shards the state over the replicas too."""

from zero.backends.fsdp2.executor import Fsdp2Executor, executor
from zero.backends.fsdp2.replicas import ReplicaShardedOptimizer

__all__ = ["Fsdp2Executor", "ReplicaShardedOptimizer", "executor"]
