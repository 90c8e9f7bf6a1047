"""Sharded checkpoints in `torch.distributed.checkpoint`'s format: each rank saves what it holds.

The state dicts are the ones ``torch.distributed.checkpoint.state_dict.get_state_dict`` makes for
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

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
from torch import nn

from zero.backends.local_optimizer import initial_state, is_functional
from zero.backends.masters import MASTER_KEY
from zero.functional.adapters.optimizer import map_state_leaves, state_leaves
from zero.plans.chunks import Held, range_boxes

__all__ = ["get_state_dict", "set_state_dict", "save", "load", "read_metadata", "describe", "model_fqns"]

_UNSUPPORTED_OPTIONS = ("full_state_dict", "cpu_offload", "broadcast_from_rank0")


@dataclass(frozen=True)
class _Options:
    strict: bool = True
    ignore_frozen_params: bool = False
    flatten_optimizer_state_dict: bool = False


def _options(options: Any) -> _Options:
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


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without torch's deprecation notice for ``ShardedTensor``, which DCP still reads and writes
    natively and which is the one public type for several boxes of a tensor on one rank."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
        yield


# -- names ---------------------------------------------------------------------------------------

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


def _param_names(optimizer: Any, model: nn.Module) -> list[str]:
    fqns = model_fqns(model)
    names = []
    for i, p in enumerate(optimizer._all_params):
        if id(p) not in fqns:
            raise ValueError(f"the optimizer's param {i} (shape {tuple(p.shape)}) is not a parameter of the model: "
                             "pass the model whose parameters the optimizer steps")
        names.append(fqns[id(p)])
    return names


# -- the state dicts -----------------------------------------------------------------------------

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
    opts = _options(options)
    inner, wrapper = _unwrap_post_local_sgd(optimizer)
    optim_sd = _optimizer_state_dict(inner, model, opts, masters)
    if wrapper is not None:
        optim_sd["step"] = wrapper.averager.step  # as PostLocalSGDOptimizer.state_dict keeps it
    return _model_state_dict(model, opts), optim_sd


def _unwrap_post_local_sgd(optimizer: Any) -> tuple[Any, Any]:
    """``(the ZeRO optimizer, the PostLocalSGDOptimizer around it or None)``, checked: local SGD
    keeps one model and one sharded state only when the ZeRO group is the averager's whole group
    and its replicas have just been averaged (or are still warming up)."""
    from zero.backends.post_localsgd import PostLocalSGDOptimizer, replicas_agree

    if not isinstance(optimizer, PostLocalSGDOptimizer):
        return optimizer, None
    inner, averager = optimizer.optim, optimizer.averager
    _check_optimizer(inner)
    from zero.backends import comm

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


def _check_optimizer(optimizer: Any) -> None:
    from zero.backends.zero_optimizer import ZeroRedundancyOptimizer

    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        raise TypeError(f"optimizer must be a zero.backends.ZeroRedundancyOptimizer, got {type(optimizer).__name__} "
                        "(for other optimizers use torch.distributed.checkpoint.state_dict.get_state_dict)")


def _optimizer_state_dict(optimizer: Any, model: nn.Module, opts: _Options, masters: bool) -> dict[str, Any]:
    _check_optimizer(optimizer)
    names = _param_names(optimizer, model)
    optimizer._local.push()
    entries = _functional_entries if is_functional(optimizer.optim) else _torch_entries
    state: dict[str, dict] = {}
    for h, key, value in entries(optimizer):
        if key != MASTER_KEY or masters:
            state.setdefault(names[h.param], {})[key] = value
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": fqns}
              for g, fqns in zip(optimizer.param_groups, _groups_of(optimizer, names))]
    sd = {"state": state, "param_groups": groups}
    return _flatten(sd) if opts.flatten_optimizer_state_dict else sd


def _torch_entries(optimizer: Any) -> Iterator[tuple[Held, str, Any]]:
    """``(held piece, key, value for DCP)`` of a ``torch.optim`` local optimizer's state."""
    local = _local_state(optimizer)
    per_element = optimizer._local.per_element_keys()
    for h in optimizer.mode.holdings():
        for key, value in local["state"].get(h.local, {}).items():
            yield h, key, _piece(optimizer, h, value) if _is_per_element(key, value, per_element) else value


def _local_state(optimizer: Any) -> dict:
    """The local optimizer's state dict (masters included), every param given a state first."""
    initial_state(optimizer.optim, _trainable(optimizer))  # a frozen param has no state, as in torch
    return optimizer._local.state_dict()


def _trainable(optimizer: Any) -> set[int]:
    """The local optimizer's params (positions across its groups) that stand for trainable params."""
    return {h.local for h in optimizer.mode.holdings() if optimizer._all_params[h.param].requires_grad}


def _functional_sets(optimizer: Any) -> Iterator[tuple[dict, tuple[int, ...], list[int]]]:
    """Each set of a `zero.functional` local optimizer's params stepped together: the group's
    states, the set's positions in the group, their positions across groups. Params without
    state start from the transformation's ``init`` (stepped together, as a step would)."""
    optim, trainable, first = optimizer.optim, _trainable(optimizer), 0
    for k, group in enumerate(optim.param_groups):
        n = len(group["params"])
        optim.ensure_state(k, tuple(i for i in range(n) if first + i in trainable))
        states = optim.set_states(k)
        for idx in list(states):
            yield states, idx, [first + i for i in idx]
        first += n


def _functional_entries(optimizer: Any) -> Iterator[tuple[Held, str, Any]]:
    """The Optax-shaped state of a `zero.functional` local optimizer, per held piece: each
    per-param leaf under its path (``"0.mu"`` ...), each shared leaf (counts, hyperparameters)
    under every param of its set; masters under `MASTER_KEY`."""
    by_local = _by_local(optimizer)
    params = [p for g in optimizer.optim.param_groups for p in g["params"]]
    for states, idx, js in _functional_sets(optimizer):
        for key, pos, leaf in state_leaves(states[idx], len(idx)):
            for j in js if pos is None else [js[pos]]:
                for h in by_local.get(j, ()):
                    per_param = pos is not None and _shaped_like(leaf, params[j], h, optimizer, key)
                    yield h, key, _piece(optimizer, h, leaf) if per_param else leaf
    for j, p in enumerate(params):
        if optimizer.masters.stepped(p) is not None:
            for h in by_local.get(j, ()):
                yield h, MASTER_KEY, _piece(optimizer, h, p)


def _by_local(optimizer: Any) -> dict[int, list[Held]]:
    out: dict[int, list[Held]] = {}
    for h in optimizer.mode.holdings():
        out.setdefault(h.local, []).append(h)
    return out


def _shaped_like(leaf: Any, local: torch.Tensor, h: Held, optimizer: Any, key: str) -> bool:
    """Whether a per-param leaf is element-wise (saved in pieces, like the param); a leaf of
    another shape (a factored statistic, a norm) is saved whole, which needs the whole param."""
    if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape == local.shape:
        return True
    whole = optimizer._all_params[h.param].numel()
    if h.end - h.start != whole or local.numel() != whole:
        raise ValueError(f"state {key!r} of param {h.param} is not shaped like the param, and this rank holds only "
                         "part of it (a flat plan): it cannot be saved by FQN; use a whole-param plan")
    return False


def _is_per_element(key: str, value: Any, per_element: set[str] | None) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    return key in per_element if per_element is not None else value.dim() > 0


def _piece(optimizer: Any, h: Held, value: torch.Tensor) -> torch.Tensor:
    """This rank's piece of one state tensor: the tensor itself (param-shaped) when it holds all of
    it, else a ``ShardedTensor`` of its boxes, views into ``value``."""
    shape = tuple(optimizer._all_params[h.param].shape)
    flat = value.reshape(-1)[h.offset:h.offset + h.end - h.start]
    chunks = optimizer.mode.chunks(h.param)
    if len(chunks) == 1:
        return flat.view(shape)
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    def placed(rank: int) -> str:
        return f"rank:{_global_rank(optimizer.process_group, rank)}/{value.device}"

    local = [Shard(flat[b.start - h.start:b.start - h.start + b.numel].view(b.sizes),
                   ShardMetadata(list(b.offsets), list(b.sizes), placed(optimizer.rank)))
             for b in range_boxes(shape, h.start, h.end)]
    everyone = [ShardMetadata(list(b.offsets), list(b.sizes), placed(r))
                for r, s, e in chunks for b in range_boxes(shape, s, e)]
    meta = ShardedTensorMetadata(everyone, torch.Size(shape), TensorProperties(dtype=value.dtype))
    with _quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta,
                                                                         process_group=optimizer.process_group)


def _global_rank(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)


# -- loading -------------------------------------------------------------------------------------

def set_state_dict(model: nn.Module, optimizer: Any, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any], options: Any = None) -> None:
    """Load the state dicts `get_state_dict` made (filled by ``dcp.load``) into ``model`` and
    ``optimizer``. The model first: master weights missing from ``optim_state_dict`` start
    again from its params. Call on every rank; nothing is communicated."""
    opts = _options(options)
    inner, wrapper = _unwrap_post_local_sgd(optimizer)
    _load_model(model, model_state_dict, opts)
    optim_state_dict = dict(optim_state_dict)
    step = optim_state_dict.pop("step", None)
    _load_optimizer(inner, model, optim_state_dict)
    if wrapper is not None:
        wrapper.restore_step(step)


def _load_model(model: nn.Module, sd: dict[str, Any], opts: _Options) -> None:
    module = _unwrap(model)
    names = {_clean(k): k for k in module.state_dict()}
    unknown = sorted(set(sd) - set(names))
    if unknown and opts.strict:
        raise ValueError(f"model_state_dict has FQNs the model does not: {unknown[:5]}")
    result = module.load_state_dict({names[k]: v for k, v in sd.items() if k in names},
                                    strict=opts.strict and not opts.ignore_frozen_params)
    if opts.strict and not opts.ignore_frozen_params and (result.missing_keys or result.unexpected_keys):
        raise ValueError(f"model_state_dict does not fit the model: {result}")


def _load_optimizer(optimizer: Any, model: nn.Module, sd: dict[str, Any]) -> None:
    _check_optimizer(optimizer)
    names = _param_names(optimizer, model)
    sd = _unflatten(sd, _groups_of(optimizer, names)) if _is_flat(sd) else sd
    _check_groups(sd, optimizer, names)
    if is_functional(optimizer.optim):
        _load_functional(optimizer, names, sd)
        return
    local = _local_state(optimizer)
    restart: set[int] = set()  # local tensors whose masters start again from their params
    for h in optimizer.mode.holdings():
        fqn = names[h.param]
        saved, mine = sd["state"].get(fqn), local["state"].get(h.local)
        if not mine:  # a frozen param: no state here, none to load (it does not step)
            continue
        if saved is None:
            raise ValueError(f"optim_state_dict has no state for {fqn!r}, which this rank steps: it was saved for "
                             "another model or before that param had state")
        missing = sorted(set(mine) - set(saved) - {MASTER_KEY})
        if missing:
            keeps = sorted(set(mine) - {MASTER_KEY})
            raise ValueError(f"optim_state_dict's state for {fqn!r} has {sorted(saved)} but "
                             f"{type(optimizer.optim).__name__} keeps {keeps} (missing {missing}): it was saved by "
                             "another optimizer")
        if MASTER_KEY in mine and MASTER_KEY not in saved:
            restart.add(h.local)
        for key, value in saved.items():
            if key not in mine:
                continue  # e.g. masters saved by a run with them, loaded where params step themselves
            if isinstance(mine[key], torch.Tensor) and mine[key].dim() > 0:
                _copy_piece(mine[key], h, value, fqn, key, tuple(optimizer._all_params[h.param].shape))
            else:
                mine[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    state = {j: {k: v for k, v in st.items() if not (k == MASTER_KEY and j in restart)}
             for j, st in local["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": mine["params"]}
              for g, mine in zip(sd["param_groups"], local["param_groups"])]
    optimizer._local.load_state_dict({"state": state, "param_groups": groups})


def _load_functional(optimizer: Any, names: list[str], sd: dict) -> None:
    """Load into a `zero.functional` local optimizer's states, leaf by leaf (in place where DCP
    loaded into them), then its masters and the groups' settings."""
    by_local = _by_local(optimizer)
    params = [p for g in optimizer.optim.param_groups for p in g["params"]]
    for states, idx, js in _functional_sets(optimizer):
        def fill(key: str, pos: int | None, leaf: Any, js: list[int] = js) -> Any:
            held = [h for j in (js if pos is None else [js[pos]]) for h in by_local.get(j, ())]
            for h in held if pos is not None else held[:1]:
                saved = _saved(sd, names[h.param], key)
                if pos is not None and _shaped_like(leaf, params[h.local], h, optimizer, key):
                    _copy_piece(leaf, h, saved, names[h.param], key, tuple(optimizer._all_params[h.param].shape))
                elif isinstance(leaf, torch.Tensor):
                    _copy_whole(leaf, saved, names[h.param], key)
                else:
                    leaf = saved
            return leaf
        states[idx] = map_state_leaves(states[idx], len(idx), fill)
    for j, p in enumerate(params):
        stepped = optimizer.masters.stepped(p)
        for h in by_local.get(j, ()) if stepped is not None else ():
            saved = sd["state"].get(names[h.param], {}).get(MASTER_KEY)
            if saved is None:  # a checkpoint without masters: they start again from the loaded params
                p.copy_(stepped)
                break
            _copy_piece(p, h, saved, names[h.param], MASTER_KEY, tuple(optimizer._all_params[h.param].shape))
    for group, saved in zip(optimizer.param_groups, sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer._local.push()


def _saved(sd: dict, fqn: str, key: str) -> Any:
    st = sd["state"].get(fqn)
    if not st or key not in st:
        raise ValueError(f"optim_state_dict has no {key!r} for {fqn!r} (it has {sorted(st or ())}): it was saved "
                         "by another transformation or optimizer")
    return st[key]


def _copy_whole(dst: torch.Tensor, value: Any, fqn: str, key: str) -> None:
    if not isinstance(value, torch.Tensor) or value.shape != dst.shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"optim_state_dict's {key!r} of {fqn!r} has shape {got}, here {tuple(dst.shape)}")
    if value is not dst:
        dst.copy_(value)


def _check_groups(sd: dict, optimizer: Any, names: list[str]) -> None:
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("optim_state_dict must have 'state' and 'param_groups' (made by get_state_dict)")
    saved = [list(g["params"]) for g in sd["param_groups"]]
    mine = _groups_of(optimizer, names)
    if saved != mine:
        missing = sorted(set(names) - {n for g in saved for n in g})
        extra = sorted({n for g in saved for n in g} - set(names))
        raise ValueError(f"optim_state_dict's param groups do not match this optimizer's: missing FQNs {missing}, "
                         f"extra FQNs {extra}, group sizes {[len(g) for g in saved]} vs {[len(g) for g in mine]}")


def _groups_of(optimizer: Any, names: list[str]) -> list[list[str]]:
    """The FQNs of each of the optimizer's param groups."""
    out, first = [], 0
    for g in optimizer.param_groups:
        out.append(names[first:first + len(g["params"])])
        first += len(g["params"])
    return out


def _copy_piece(dst: torch.Tensor, h: Held, value: Any, fqn: str, key: str, shape: tuple[int, ...]) -> None:
    """Write param ``h.param``'s elements ``h.start:h.end`` of ``value`` into ``dst`` at ``h.offset``
    (skipped where ``value`` is a view of that very memory: DCP loaded into it)."""
    region = dst.reshape(-1)[h.offset:h.offset + h.end - h.start]
    if hasattr(value, "local_shards"):
        strides = [prod(shape[d + 1:]) for d in range(len(shape))]
        covered = 0
        for shard in value.local_shards():
            start = sum(o * s for o, s in zip(shard.metadata.shard_offsets, strides)) - h.start
            piece = shard.tensor.reshape(-1)
            if start < 0 or start + piece.numel() > region.numel():
                raise ValueError(f"optim_state_dict's {key!r} of {fqn!r} holds a shard outside this rank's elements")
            if piece.data_ptr() != region[start:].data_ptr():
                region[start:start + piece.numel()].copy_(piece)
            covered += piece.numel()
        if covered != region.numel():
            raise ValueError(f"optim_state_dict's {key!r} of {fqn!r} covers {covered} of this rank's "
                             f"{region.numel()} elements")
        return
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"optim_state_dict's {key!r} of {fqn!r} has shape {got} but the param has shape {shape}")
    piece = value.reshape(-1)[h.start:h.end]
    if piece.data_ptr() != region.data_ptr():
        region.copy_(piece)


# -- torch's flattened optimizer layout (flatten_optimizer_state_dict=True) -----------------------

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


# -- save and load, checked ----------------------------------------------------------------------

def save(checkpoint_id: Any, model: nn.Module, optimizer: Any, *, masters: bool = True, options: Any = None,
         async_save: bool = False, **dcp_kwargs: Any) -> Any:
    """`get_state_dict` saved with ``torch.distributed.checkpoint.save`` (``async_save``: its
    ``async_save``, which copies the state before it returns; its future is returned) under
    ``{"model": ..., "optim": ...}``, FSDP2's convention. Call on every rank. Save each checkpoint
    to a new directory: DCP writes ``.metadata`` last, so a save that dies leaves the last one whole.
    ``dcp_kwargs`` go to DCP (``storage_writer=FileSystemWriter(path, sync_files=False)`` ...)."""
    import torch.distributed.checkpoint as dcp

    with _quiet():
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options, masters=masters)
        inner = _unwrap_post_local_sgd(optimizer)[0]
        if not async_save:
            return dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_id,
                            process_group=inner.process_group, **dcp_kwargs)
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        # DCP's default stager cannot copy a ShardedTensor; this one copies every piece before returning
        dcp_kwargs.setdefault("async_stager", BlockingAsyncStager())
        return dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_id,
                              process_group=_saving_group(inner), **dcp_kwargs)


def _saving_group(optimizer: Any) -> Any:
    """A gloo group of the optimizer's ranks for background saves, made at the first one: the
    save's collectives run on a thread while training's run on the optimizer's group, and two
    threads must not share one group's order of collectives."""
    import torch.distributed as dist

    group = getattr(optimizer, "_saving_group", None)
    if group is None:
        group = dist.new_group(dist.get_process_group_ranks(optimizer.process_group or dist.group.WORLD),
                               backend="gloo")
        optimizer._saving_group = group
    return group


def load(checkpoint_id: Any, model: nn.Module, optimizer: Any, *, options: Any = None) -> None:
    """Load a checkpoint `save` (or FSDP2, or ``dcp.save`` of `get_state_dict`'s dicts) wrote,
    at any world size and plan. Call on every rank.

    It is checked first: an unfinished save, a tensor whose chunks do not cover it, an FQN of
    another model (missing, extra or reshaped) or state of another optimizer is a ``ValueError``
    naming it. Master weights absent from the checkpoint start again from the loaded params."""
    import torch.distributed.checkpoint as dcp

    metadata = read_metadata(checkpoint_id)
    with _quiet():
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        if _missing(metadata, {"model": model_sd, "optim": optim_sd}, masters_only=True):
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options, masters=False)
        request = {"model": model_sd, "optim": optim_sd}
        _check_against(metadata, request, _options(options).strict)
        dcp.load(request, checkpoint_id=checkpoint_id, process_group=_unwrap_post_local_sgd(optimizer)[0].process_group)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)


def read_metadata(checkpoint_id: Any) -> Any:
    """DCP's metadata of a checkpoint directory; a ``ValueError`` when its save did not finish."""
    import os

    from torch.distributed.checkpoint import FileSystemReader

    path = os.fspath(checkpoint_id)
    if not os.path.isdir(path):
        raise ValueError(f"no checkpoint at {path!r}: not a directory")
    if not os.path.exists(os.path.join(path, ".metadata")):
        written = sorted(f for f in os.listdir(path) if not f.startswith("."))
        raise ValueError(f"the checkpoint at {path!r} is incomplete: it has no .metadata (written last, once every "
                         f"rank has written its data), so its save did not finish; data files present: {written}")
    return FileSystemReader(path).read_metadata()


def _tensors(request: dict) -> dict[str, Any]:
    """DCP's flat key -> tensor (or ShardedTensor) of a nested state dict."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(request)
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _missing(metadata: Any, request: dict, masters_only: bool = False) -> list[str]:
    keys = [k for k in _tensors(request) if k not in metadata.state_dict_metadata]
    return [k for k in keys if k.endswith("." + MASTER_KEY)] if masters_only else keys


def _check_against(metadata: Any, request: dict, strict: bool) -> None:
    """``ValueError`` naming what the checkpoint lacks or holds differently from ``request``."""
    saved = metadata.state_dict_metadata
    missing = _missing(metadata, request)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors this model and optimizer need: {missing[:6]}")
    for key, value in _tensors(request).items():
        md = saved[key]
        if not hasattr(md, "chunks"):
            raise ValueError(f"the checkpoint holds {key!r} as bytes, not a tensor")
        if tuple(md.size) != tuple(value.size()):
            raise ValueError(f"the checkpoint's {key!r} has shape {tuple(md.size)} but here it has shape "
                             f"{tuple(value.size())}: it was saved for another model")
        covered = sum(prod(c.sizes) for c in md.chunks)
        if covered != prod(md.size):
            raise ValueError(f"the checkpoint's {key!r} is incomplete: its chunks hold {covered} of "
                             f"{prod(md.size)} elements")
    if strict:
        params = {k for k in _tensors(request) if k.startswith("model.")}
        extra = sorted(k for k in saved if k.startswith("model.") and k not in params)
        if extra:
            raise ValueError(f"the checkpoint holds model tensors this model does not have: {extra[:6]}")


def describe(checkpoint_id: Any) -> list[dict[str, Any]]:
    """What a checkpoint holds, read from its metadata alone (no process group): per saved tensor
    its key, shape, dtype, bytes, the chunks written (offsets, sizes, the file holding each: DCP's
    ``__<rank>_<n>.distcp`` names the rank that wrote it) and whether they cover it;
    per non-tensor entry (param-group settings ...) its key."""
    metadata, rows = read_metadata(checkpoint_id), []
    files = {(index.fqn, tuple(index.offset or ())): info.relative_path
             for index, info in (metadata.storage_data or {}).items()}
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if not hasattr(md, "chunks"):
            rows.append({"key": key, "kind": "bytes"})
            continue
        numel, dtype = prod(md.size), md.properties.dtype
        covered = sum(prod(c.sizes) for c in md.chunks)
        rows.append({"key": key, "kind": "tensor", "shape": list(md.size), "dtype": str(dtype).removeprefix("torch."),
                     "bytes": numel * dtype.itemsize, "complete": covered == numel,
                     "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes),
                                 "file": files.get((key, tuple(c.offsets)))} for c in md.chunks]})
    return rows
