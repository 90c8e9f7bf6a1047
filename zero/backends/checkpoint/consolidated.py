"""torch's consolidated format: one optimizer state dict over all params, as a plain optimizer saves it.

The global form is exactly a plain ``torch.optim`` state dict over all params: ``state`` keyed by
the param's position across ``param_groups``, each group's ``params`` listing those positions. It
loads into a plain optimizer, into torch's `ZeroRedundancyOptimizer`, and into ours at any world
size and plan, because state is per param and each rank picks out what it holds.

Both directions read what each rank holds from the plan (`zero.plans.holdings`), for every mode
alike: a whole param's state travels as it is; a param held in pieces (flat shards) is put
together from, or cut into, the pieces' elements, its per-param scalars (``step``) copied.

A `zero.functional` local optimizer keeps one Optax-shaped state per set of params stepped
together; its leaves travel per param, as `torch.distributed.checkpoint`'s entries do
(`zero.backends.checkpoint.dcp_pieces.functional_leaves`): ``state[i]`` holds each of param
``i``'s leaves under its path (``"0.mu"``; a quantized moment's ``"0.mu.codes"`` and
``"0.mu.scale"``, one element per block, 1-D), put together from every rank's pieces, and the
counts and hyperparameters its set shares; fp32 masters under ``"master"``. So it reloads at any
world size and plan, each rank taking its pieces. (A state dict of the earlier form, the states
as they were, ``tx_states``, reloads onto the same placement only.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from zero.backends import comm
from zero.backends.checkpoint.dcp_pieces import functional_leaves, held_elements, load_functional
from zero.backends.checkpoint.integrity import verify_state_dict
from zero.backends.local_optimizer import check_state_keys, is_functional, is_per_element
from zero.backends.rank_state import RankState
from zero.plans.checks import check_int
from zero.plans.chunks import Held
from zero.plans.holdings import Holdings
from zero.plans.plan import Plan
from zero.plans.shards import group_ranges

__all__ = ["gather", "to_global", "load", "is_global", "merge", "cut", "placement", "check_compatible"]


def gather(state: RankState, to: int) -> list[dict] | None:
    """Every rank's local state dict, on rank ``to`` (in CPU memory), None elsewhere (call on all
    ranks). They move as raw tensors, rank by rank, point to point to ``to``."""
    state.push()
    mine = _local_form(state)
    if state.rank != to:
        comm.send_tree(mine, to, state.process_group, state.comm_device)
        return None
    return [_cpu_copy(mine) if r == state.rank else comm.recv_tree(r, state.process_group, state.comm_device)
            for r in range(state.world_size)]


def _local_form(state: RankState) -> dict:
    """What a rank sends: its local optimizer's state dict; for a `zero.functional` one, each
    held piece of each leaf as ``(param, key, start, end, k, tensor)`` (elements ``start:end`` of
    a tensor of ``numel // k``; ``k`` 0: the leaf as it is)."""
    if not is_functional(state.optim):
        return state.state_dict()
    return {"pieces": [(h.param, key, h.start // k, h.end // k, k, held_elements(h, leaf, k)) if k
                       else (h.param, key, 0, 0, 0, leaf) for h, key, leaf, k in functional_leaves(state)]}


def to_global(state: RankState, local_dicts: Sequence[dict]) -> dict[str, Any]:
    """The global state dict out of every rank's local one (`gather`), each cut as the plan says."""
    if local_dicts and "pieces" in local_dicts[0]:
        out = _global_dict(_joined_leaves(local_dicts, state.params), state.param_groups)
    else:
        held = [state.holdings_of(r) for r in range(state.world_size)]
        out = merge(local_dicts, held, state.param_groups, state.per_element_keys())
    return out  # torch's reference semantics: integrity is checked where bytes are written (zero's checkpoints)


def _joined_leaves(local_dicts: Sequence[dict], params: Sequence[torch.Tensor]) -> dict[int, dict]:
    """Each param's `zero.functional` leaves out of every rank's pieces (`_local_form`)."""
    state: dict[int, dict] = {}
    covered: dict[tuple[int, str], int] = {}
    for local in local_dicts:
        for i, key, start, end, k, value in local["pieces"]:
            entry = state.setdefault(i, {})
            if not k:  # a leaf kept whole, or shared by the set: the same on every holder
                entry.setdefault(key, value)
                continue
            whole = entry.setdefault(key, torch.empty(params[i].numel() // k, dtype=value.dtype))
            whole[start:end] = value.reshape(-1)
            covered[i, key] = covered.get((i, key), 0) + end - start
    for (i, key), n in covered.items():
        if n != state[i][key].numel():
            raise ValueError(f"state {key!r} of param {i}: the ranks hold {n} of its {state[i][key].numel()} elements")
        if state[i][key].numel() == params[i].numel():
            state[i][key] = state[i][key].view(params[i].shape)
    return state


def is_global(saved: Any) -> bool:
    """Whether ``saved`` is a global state dict (this format, torch's ZeRO's, a plain optimizer's:
    positions as keys, whole tensors), not one rank's part of a sharded one (zero's `state_dict`
    without consolidating, which names its layout; torch's ``set_state_dict``, keyed by FQN)."""
    from zero.functional.adapters.face import LAYOUT_KEY

    if not isinstance(saved, dict) or LAYOUT_KEY in saved or not isinstance(saved.get("state"), dict):
        return False
    return all(isinstance(k, int) and isinstance(v, dict) and not any(hasattr(x, "local_shards") or
                                                                      hasattr(x, "to_local") for x in v.values())
               for k, v in saved["state"].items())


def load(state: RankState, saved: dict[str, Any], check_settings: Any = None) -> None:
    """Load a global state dict (ours at any world size and plan, torch's, a plain optimizer's):
    this rank's part of it into its local optimizer, which places each tensor where it keeps it.
    One saved by an earlier zero carries a checksum per tensor (``"zero_checksums"``), checked
    first: a changed byte is a ``ValueError`` naming the param and key, before anything is loaded.
    ``check_settings(groups)``: the optimizer's check of the saved groups' settings, after the
    state's own checks (which name the optimizer that saved it)."""
    functional = is_functional(state.optim)
    check_compatible(saved, state.params, [len(g["params"]) for g in state.param_groups], functional)
    verify_state_dict(saved, lambda i: state.plan.metas[i].name)
    check_state_keys(saved, state.optim)
    if check_settings is not None:
        check_settings([{k: v for k, v in g.items() if k not in ("params", "param_names")}
                        for g in saved["param_groups"]])
    if functional and "tx_states" not in saved:
        names = [f"param {i}" for i in range(len(state.params))]
        load_functional(state, names, {"state": {names[i]: st for i, st in saved["state"].items()},
                                       "param_groups": saved["param_groups"]})
        return
    state.load_state_dict(cut(saved, state.holdings, state.per_element_keys()))


def merge(local_dicts: Sequence[dict], held: Sequence[Holdings], param_groups: list[dict],
          per_element: set[str] | None) -> dict[str, Any]:
    """The global state dict out of every rank's local ``state_dict()`` (``held[r]``: what rank
    ``r`` holds). ``per_element``: the state keys shaped like their tensor (None: every tensor
    with dimensions); the rest (``step`` ...) are equal on every holder and copied."""
    pieces: dict[int, list[tuple[dict | None, Held, bool]]] = {}
    for local, h in zip(local_dicts, held):
        for piece in h.held:
            pieces.setdefault(piece.param, []).append((local["state"].get(piece.local), piece,
                                                       h.tensors[piece.local].whole))
    state: dict[int, Any] = {}
    for i, ps in sorted(pieces.items()):
        if ps[0][2]:  # held whole: its state as the local optimizer keeps it
            if ps[0][0] is not None:
                state[i] = ps[0][0]
        elif all(st for st, _, _ in ps):
            state[i] = _joined(ps, held[0].plan.metas[i].shape, per_element)
    return _global_dict(state, param_groups)


def _joined(ps: list[tuple[dict, Held, bool]], shape: tuple[int, ...], per_element: set[str] | None) -> dict:
    """One param's state out of its pieces: per-element keys concatenated in element order."""
    ps = sorted(ps, key=lambda p: p[1].start)
    out = {}
    for key, value in ps[0][0].items():
        if is_per_element(key, value, per_element):
            parts = [st[key].reshape(-1)[h.offset:h.offset + h.end - h.start] for st, h, _ in ps]
            out[key] = torch.cat(parts).view(shape)
        else:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def _global_dict(state: dict[int, Any], param_groups: list[dict]) -> dict:
    """The global state dict of per-param ``state`` (global indices), with the groups' settings."""
    ranges = group_ranges([len(g["params"]) for g in param_groups])
    groups = [{**_settings(g), "params": list(r)} for g, r in zip(param_groups, ranges)]
    out: dict[str, Any] = {"state": state, "param_groups": groups}
    return out


def cut(saved: dict, held: Holdings, per_element: set[str] | None) -> dict[str, Any]:
    """This rank's local state dict (what ``held`` says it holds) cut out of a global one."""
    state: dict[int, Any] = {}
    for j, t in enumerate(held.tensors):
        if t.whole:
            if t.param in saved["state"]:
                state[j] = saved["state"][t.param]
            continue
        st = _shard_state(saved["state"], held, j, per_element)
        if st:
            state[j] = st
    return _local_dict(state, held.group_sizes(), saved, held.rank, placement(held.plan))


def _shard_state(saved_state: dict, held: Holdings, j: int, per_element: set[str] | None) -> dict:
    """Local tensor ``j``'s state (a flat shard) out of its params' global ones: their pieces'
    elements at their offsets, zeros elsewhere; the scalars of its buffer's first param with state
    (empty when none has any)."""
    t = held.tensors[j]
    with_state = [i for i in held.plan.flat.buffers[t.buffer].params if saved_state.get(i)]
    if not with_state:
        return {}
    st = {}
    for key, value in saved_state[with_state[0]].items():
        if is_per_element(key, value, per_element):
            flat = torch.zeros(t.numel, dtype=value.dtype, device=value.device)
            for h in held.pieces(j):
                if saved_state.get(h.param):
                    flat[h.offset:h.offset + h.end - h.start] = saved_state[h.param][key].reshape(-1)[h.start:h.end]
            st[key] = flat
        else:
            st[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return st


def _local_dict(state: dict[int, Any], group_sizes: Sequence[int], saved: dict, rank: int, where: Any) -> dict:
    """A local ``state_dict`` of ``state`` (local indices) and the global one's group settings."""
    ranges = group_ranges(group_sizes)
    # the global groups' param_names name the model's params, not this rank's tensors (shards, or
    # a subset): without them the local optimizer keeps its own (torch's load_state_dict does)
    groups = [{**{k: v for k, v in _settings(g).items() if k != "param_names"}, "params": list(r)}
              for g, r in zip(saved["param_groups"], ranges)]
    local: dict[str, Any] = {"state": state, "param_groups": groups}
    if "tx_states" in saved:
        owner = saved["owner"]
        if (list(owner) if isinstance(owner, (list, tuple)) else owner) != where or rank >= len(saved["tx_states"]):
            raise ValueError("this state_dict holds zero.functional transformation states, which reload only onto "
                             "the same plan and world size they were saved with; use a torch.optim class as "
                             "optimizer_class to reshard state")
        local["tx_states"] = saved["tx_states"][rank]
    return local


def placement(plan: Plan) -> list[int] | str:
    """What `zero.functional` states saved under ``plan`` reload onto: a whole-param plan's owners
    (any plan with the same owners), else the plan's fingerprint."""
    return list(plan.partition.owner) if plan.flat is None else plan.fingerprint


def _settings(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def check_compatible(state_dict: Any, params: Sequence[torch.Tensor], group_sizes: Sequence[int],
                     functional: bool = False) -> None:
    """``ValueError`` naming the mismatch when ``state_dict`` was saved for other params
    (``functional``: for a `zero.functional` rule, whose state may hold 1-D tensors of one
    element per block, or statistics of other shapes; loading checks each against its place)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        keys = sorted(state_dict) if isinstance(state_dict, dict) else "-"
        raise ValueError("state_dict must be an optimizer state dict with 'state' and 'param_groups' keys, got "
                         f"{type(state_dict).__name__} with keys {keys}")
    saved = [len(g["params"]) for g in state_dict["param_groups"]]
    if saved != list(group_sizes):
        raise ValueError(f"state_dict has param groups of sizes {saved} but this optimizer has {list(group_sizes)}: "
                         "it was saved for a different model or different param groups")
    for index, st in state_dict["state"].items():
        check_int("state_dict's param index", index, 0, len(params))
        for key, value in (st or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[index].shape \
                    and not functional:
                raise ValueError(f"state_dict's {key!r} for param {index} has shape {tuple(value.shape)} but the "
                                 f"param has shape {tuple(params[index].shape)}: it was saved for a different model")


def _cpu_copy(tree: Any) -> Any:
    return optree.tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x,
                           tree, none_is_leaf=True)
