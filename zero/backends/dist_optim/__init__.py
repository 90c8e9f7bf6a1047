"""`torch.distributed.optim`'s other members, beside ZeRO: model averaging and post-local SGD
(``averagers``, ``post_localsgd``: `PeriodicModelAverager`, `HierarchicalModelAverager`,
`PostLocalSGDOptimizer`) and RPC's `DistributedOptimizer` (``rpc``), each with its local
optimizer from `zero.functional`. A new system of that family goes here, one module each."""

from zero._lazy import module_getattr

__getattr__ = module_getattr(__name__)  # a submodule not imported yet resolves on first access
