"""The state formats, each written once over what a rank holds (`zero.plans.holdings`, kept by
the optimizer's `zero.backends.rank_state.RankState`). A new format goes here, as a module.

- ``consolidated``: torch's one optimizer state dict over all params, put together on one rank
  (``consolidate_state_dict`` / ``state_dict`` / ``load_state_dict``).
- ``dcp`` and ``dcp_pieces``: sharded checkpoints in `torch.distributed.checkpoint`'s format,
  each rank saving what it holds; ``files``: checkpoint directories (`save`, `load`, `describe`).

DCP's state dicts are the ones ``torch.distributed.checkpoint.state_dict.get_state_dict`` makes for
FSDP2: the model's by fully qualified name (DDP's ``module.`` and ``torch.compile``'s
``_orig_mod.`` left out), the optimizer's as ``{"state": {fqn: {key: tensor}}, "param_groups":
[{..., "params": [fqn, ...]}]}``. Every tensor has its param's shape and dtype; a rank puts in
only the pieces its plan gives it: the whole tensor of an owned param, or under a flat plan the
boxes of its element range (`zero.plans.chunks`), as a ``ShardedTensor`` whose local shards are
views into the optimizer's own state. Nothing is gathered and nothing is copied: DCP writes the
views on save and fills them in place on load, resharding between any two chunkings (another
world size, another plan, FSDP2's row shards). Master weights travel under ``"master"``.

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    # resuming, at any world size and plan: get the tensors to fill, fill them, hand them back
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)

`save` and `load` do those steps and check the checkpoint against this model first (a missing,
extra or reshaped FQN, an unfinished save: a ``ValueError`` naming it).
"""

from zero._lazy import module_getattr
from zero.backends.checkpoint.dcp import get_state_dict, model_fqns, set_state_dict
from zero.backends.checkpoint.files import describe, load, read_metadata, save

__all__ = ["get_state_dict", "set_state_dict", "save", "load", "read_metadata", "describe", "model_fqns"]

__getattr__ = module_getattr(__name__)  # a submodule not imported yet resolves on first access
