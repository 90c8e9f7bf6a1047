"""Adapters between transformations and the optimizers people already use: `torch_rules`
(`from_torch`: ``torch.optim`` semantics as chains), `optimizer` (`Optimizer`, a real
``torch.optim.Optimizer`` running any transformation, and the bucket-wise `FunctionalOptimizer`),
`optax_bridge` (`from_optax`: any Optax transformation on torch tensors, and state both ways).
"""
