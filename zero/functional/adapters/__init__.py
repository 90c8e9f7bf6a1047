"""Adapters between transformations and the optimizers people already use: `torch_rules`
(`from_torch`: ``torch.optim`` semantics as chains), `optimizer` (`Optimizer`, a real
``torch.optim.Optimizer`` running any transformation, and the bucket-wise `FunctionalOptimizer`),
`group_settings` (param-group keys as injected hyperparameters), `state_tree` (a state's leaves
per param, for splitting and checkpoints), `optax_bridge` (`from_optax`: any Optax
transformation on torch tensors, and state both ways), `sharded_storage` (params that are sharded
storage, FSDP2's DTensors, stepped by the executor a backend gives, found by name).
"""
