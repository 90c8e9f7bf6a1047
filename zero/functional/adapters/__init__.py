"""Adapters between transformations and the optimizers people already use: `torch_rules`
(`from_torch`: ``torch.optim`` semantics as chains), `optimizer` (`Optimizer`, a real
``torch.optim.Optimizer`` running any transformation, and the bucket-wise `FunctionalOptimizer`),
`face` (torch's optimizer contract, once, for every zero optimizer: ``state``, ``state_dict``,
``load_state_dict``), `executor` (what steps an `Optimizer`'s params: plain tensors here, sharded
storage such as FSDP2's DTensors by the backend module it names), `rule_states` (a group's states,
one per set of params stepped together), `state_names` (a state's leaves as torch's per-param
entries, under torch's names for `from_torch` rules), `group_settings` (param-group keys as
injected hyperparameters), `state_tree` (a state's leaves per param, for splitting and
checkpoints), `optax_bridge` (`from_optax`: any Optax transformation on torch tensors, and state
both ways).
"""
