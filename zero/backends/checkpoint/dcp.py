"""DCP's format: `get_state_dict` and `set_state_dict`, the model's and the optimizer's state dicts
in `torch.distributed.checkpoint`'s layout (FSDP2's), keyed by FQN as torch's own functions key
them. Every zero optimizer's ``state_dict()`` is torch's form already, each rank's pieces in their
placements (`zero.functional.adapters.face`): here it is only re-keyed, one path for all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zero.backends import comm
from zero.backends.precision import MASTER_KEY

__all__ = ["get_state_dict", "set_state_dict", "model_fqns", "check_optimizer", "resolve_options",
           "unwrap_post_local_sgd"]

_UNSUPPORTED_OPTIONS = ("full_state_dict", "cpu_offload", "broadcast_from_rank0")


@dataclass(frozen=True)
class _Options:
    strict: bool = True
    ignore_frozen_params: bool = False
    flatten_optimizer_state_dict: bool = False


def resolve_options(options: Any) -> _Options:
    """torch's ``StateDictOptions`` (or None), as far as a sharded optimizer can honour it."""
    if options is None:
        return _Options()
    for name in _UNSUPPORTED_OPTIONS:
        if getattr(options, name, False):
            raise ValueError(f"StateDictOptions({name}=True) is not supported: zero's state dicts are sharded "
                             "(each rank holds its own pieces); for one full state dict on one rank use "
                             "ZeroRedundancyOptimizer.consolidate_state_dict")
    return _Options(bool(getattr(options, "strict", True)), bool(getattr(options, "ignore_frozen_params", False)),
                    bool(getattr(options, "flatten_optimizer_state_dict", False)))


def _unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP's and ``torch.compile``'s wrappers (whose prefixes are not part of FQNs)."""
    while True:
        inner = getattr(model, "module", None) if type(model).__name__ == "DistributedDataParallel" else None
        inner = inner if inner is not None else getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def model_fqns(model: nn.Module) -> dict[int, str]:
    """``id(param)`` -> its fully qualified name (the first, for a param registered twice)."""
    out: dict[int, str] = {}
    for name, p in _unwrap(model).named_parameters(remove_duplicate=False):
        out.setdefault(id(p), _clean(name))
    return out


def get_state_dict(model: nn.Module, optimizer: Any, *, options: Any = None,
                   masters: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and ``optimizer``'s state dicts in DCP's layout, this rank's pieces only.

    Call on every rank. The optimizer's tensors are its state itself (views, not copies): save
    them, or `torch.distributed.checkpoint.load` into them and hand them to `set_state_dict`. A
    param without state yet gets zeros (``step`` 0), which step exactly as a fresh state does.
    ``masters=False`` leaves the master weights out (a checkpoint without them, e.g. FSDP2's,
    then loads: the masters start again from the loaded params). ``options``: torch's
    ``StateDictOptions`` (``strict``, ``ignore_frozen_params``, ``flatten_optimizer_state_dict``).
    """
    opts = resolve_options(options)
    inner, wrapper = unwrap_post_local_sgd(optimizer)
    optim_sd = _optimizer_state_dict(inner, model, opts, masters)
    if wrapper is not None:
        optim_sd["step"] = wrapper.averager.step  # as PostLocalSGDOptimizer.state_dict keeps it
    return _model_state_dict(model, opts), optim_sd


def unwrap_post_local_sgd(optimizer: Any) -> tuple[Any, Any]:
    """``(the ZeRO optimizer, the PostLocalSGDOptimizer around it or None)``, checked: local SGD
    keeps one model and one sharded state only when the ZeRO group is the averager's whole group
    and its replicas have just been averaged (or are still warming up)."""
    from zero.backends.dist_optim.post_localsgd import PostLocalSGDOptimizer, replicas_agree

    if not isinstance(optimizer, PostLocalSGDOptimizer):
        return optimizer, None
    inner, averager = optimizer.optim, optimizer.averager
    check_optimizer(inner)
    if comm.group_size(inner.process_group) != comm.group_size(averager.process_group):
        raise ValueError(f"the ZeroRedundancyOptimizer shards over {comm.group_size(inner.process_group)} ranks but "
                         f"the averager averages over {comm.group_size(averager.process_group)}: each of its "
                         "subgroups keeps a state of its own, which one sharded checkpoint cannot hold")
    if not replicas_agree(averager):
        raise ValueError(f"the model replicas differ at averager step {averager.step} (local SGD since the last "
                         "average): save right after a step that averaged over the whole group")
    return inner, optimizer


def _model_state_dict(model: nn.Module, opts: _Options) -> dict[str, Any]:
    module = _unwrap(model)
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad} if opts.ignore_frozen_params else set()
    return {_clean(k): v for k, v in module.state_dict().items() if k not in frozen}


def check_optimizer(optimizer: Any) -> Any:
    """``optimizer``, one of zero's (`zero.functional.adapters.face.OptimizerFace`: its
    ``state_dict()`` is torch's form, this rank's entries in their placements); a ``TypeError``
    for another optimizer."""
    from zero.functional.adapters.face import OptimizerFace

    if not isinstance(optimizer, OptimizerFace):
        raise TypeError(f"optimizer must be one of zero's (ZeroRedundancyOptimizer, zero.functional.Optimizer), got "
                        f"{type(optimizer).__name__} (for other optimizers use torch.distributed.checkpoint.state_dict."
                        "get_state_dict)")
    return optimizer


def _face_names(optimizer: Any, model: nn.Module) -> list[str]:
    """Every param's FQN, in the optimizer's order; a ``ValueError`` for one the model lacks."""
    check_optimizer(optimizer)
    fqns = model_fqns(model)
    params = optimizer.all_params()
    missing = [i for i, p in enumerate(params) if id(p) not in fqns]
    if missing:
        i = missing[0]
        raise ValueError(f"the optimizer's param {i} (shape {tuple(params[i].shape)}) is not a parameter of the model: "
                         "pass the model whose parameters the optimizer steps")
    return [fqns[id(p)] for p in params]


def _by_fqn(optimizer: Any, names: list[str], masters: bool) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by FQN, as torch's ``get_optimizer_state_dict`` keys it
    (``param_names`` left out: FQNs name the params, and a checkpoint of an optimizer built from
    unnamed params has none)."""
    sd = optimizer.torch_state_dict()  # this rank's pieces (a ZeRO optimizer's, even just consolidated)
    state = {names[i]: {k: v for k, v in st.items() if masters or k != MASTER_KEY} for i, st in sd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
               "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def _optimizer_state_dict(optimizer: Any, model: nn.Module, opts: _Options, masters: bool) -> dict[str, Any]:
    sd = _by_fqn(optimizer, _face_names(optimizer, model), masters)
    return _flatten(sd) if opts.flatten_optimizer_state_dict else sd


def set_state_dict(model: nn.Module, optimizer: Any, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any], options: Any = None) -> None:
    """Load the state dicts `get_state_dict` made (filled by ``dcp.load``) into ``model`` and
    ``optimizer``. The model first: master weights missing from ``optim_state_dict`` start
    again from its params. Call on every rank; nothing is communicated."""
    opts = resolve_options(options)
    inner, wrapper = unwrap_post_local_sgd(optimizer)
    _load_model(model, model_state_dict, opts)
    optim_state_dict = dict(optim_state_dict)
    step = optim_state_dict.pop("step", None)
    _load_optimizer(inner, model, optim_state_dict)
    if wrapper is not None:
        wrapper.restore_step(step)


def _load_model(model: nn.Module, sd: dict[str, Any], opts: _Options) -> None:
    """Copy into the model what is not already its own memory (DCP loads `get_state_dict`'s
    tensors in place: copying those onto themselves would only cost time)."""
    module = _unwrap(model)
    own = {_clean(k): (k, v) for k, v in module.state_dict().items()}
    frozen = {_clean(n) for n, p in module.named_parameters() if not p.requires_grad} \
        if opts.ignore_frozen_params else set()
    unexpected, missing = sorted(set(sd) - set(own)), sorted(set(own) - set(sd) - frozen)
    if opts.strict and (unexpected or missing):
        raise ValueError(f"model_state_dict does not fit the model: missing FQNs {missing[:5]}, "
                         f"unexpected FQNs {unexpected[:5]}")
    module.load_state_dict({own[k][0]: v for k, v in sd.items() if k in own and not _same(v, own[k][1])},
                           strict=False)


def _same(a: Any, b: torch.Tensor) -> bool:
    return (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.dtype == b.dtype and a.stride() == b.stride())


def _load_optimizer(optimizer: Any, model: nn.Module, sd: dict[str, Any]) -> None:
    names = _face_names(optimizer, model)
    groups, first = [], 0
    for g in optimizer.param_groups:
        groups.append(names[first:first + len(g["params"])])
        first += len(g["params"])
    sd = _unflatten(sd, groups) if _is_flat(sd) else sd
    _load_by_fqn(optimizer, names, groups, sd)


def _load_by_fqn(optimizer: Any, names: list[str], groups: list[list[str]], sd: dict[str, Any]) -> None:
    """``sd`` (FQN-keyed, `get_state_dict`'s form) into ``optimizer.load_state_dict``, by position.
    As torch's ``set_state_dict``, params are found by FQN: each of this optimizer's groups takes the
    settings of the saved group that holds its first param, so a checkpoint of other groupings loads."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("optim_state_dict must have 'state' and 'param_groups' (made by get_state_dict)")
    holder = {n: g for g in sd["param_groups"] for n in g["params"]}
    missing = [n for g in groups for n in g if n not in holder]
    if missing:
        raise ValueError(f"optim_state_dict's param groups do not hold {missing[:5]}, which this optimizer steps: it "
                         "was saved for another model")
    at = {n: i for i, n in enumerate(names)}
    state = {at[fqn]: st for fqn, st in sd["state"].items() if fqn in at}
    param_groups = [{**({k: v for k, v in holder[g[0]].items() if k != "params"} if g else {}),
                     "params": [at[n] for n in g]} for g in groups]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def _flatten(sd: dict) -> dict[str, Any]:
    out = {f"state.{fqn}.{k}": v for fqn, st in sd["state"].items() for k, v in st.items()}
    for g in sd["param_groups"]:
        for fqn in g["params"]:
            out.update({f"param_groups.{fqn}.{k}": v for k, v in g.items() if k != "params"})
    return out


def _is_flat(sd: Any) -> bool:
    return isinstance(sd, dict) and "param_groups" not in sd and all(k.startswith(("state.", "param_groups."))
                                                                     for k in sd)


def _unflatten(sd: dict, groups: list[list[str]]) -> dict:
    """The nested layout back, the FQNs (which contain dots) known from the optimizer's groups."""
    state: dict[str, dict] = {}
    for fqn in (n for g in groups for n in g):
        prefix = f"state.{fqn}."
        st = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        if st:
            state[fqn] = st
    out_groups = []
    for g in groups:
        prefix = f"param_groups.{g[0]}." if g else None
        settings = {k[len(prefix):]: v for k, v in sd.items() if prefix and k.startswith(prefix)
                    and "." not in k[len(prefix):]}
        out_groups.append({**settings, "params": list(g)})
    return {"state": state, "param_groups": out_groups}
