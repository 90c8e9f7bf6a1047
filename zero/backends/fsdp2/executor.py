"""`Fsdp2Executor`: how `zero.functional.Optimizer` steps FSDP2's DTensor params exactly.

Each group's step runs the rule once over plain tensors: this rank's local piece of every param
the rule steps element by element (on its fused and foreach kernels), and, whole, the params this
rank owns among those the rule needs whole (`zero.plans.fsdp2`). A `zero.functional.sharding.Sharding`
installed around the step says which piece of which whole tensor each leaf is, so the rule's
global and per-tensor norms and sums over axes are one partial sum per piece and one all-reduce
over the mesh; low-bit state is quantized in each param's own blocks, which the plan keeps whole
on one rank. The owners' params come whole by `exchange.to_owners` and go back by
`exchange.back_from_owners`; a per-head param FSDP2 cut inside heads is stepped by whole heads,
each on the rank that holds its anchor row (`exchange.to_head_steppers` and back).

On HSDP's mesh each replica's ranks hold the same pieces. By default each replica steps them alone
(its state replicated, as ``torch.optim`` over HSDP). An optimizer that asks for it (its
``executor_options()``, as `zero.ZeroRedundancyOptimizer`'s does) is stepped by a plan over the
replicas too: each rank steps its part of its pieces and the params it owns across the mesh, and
`exchange.gather_replicas` gives every replica the updated pieces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from zero.backends import comm
from zero.backends.fsdp2.exchange import (
    back_from_head_steppers,
    back_from_owners,
    gather_replicas,
    to_head_steppers,
    to_owners,
)
from zero.backends.fsdp2.guard import Fsdp2Guard
from zero.backends.fsdp2.layout import Layout, plan_for, read_layout
from zero.backends.fsdp2.state import fsdp2_entries, load_fsdp2_entries, start_states
from zero.functional import sharding
from zero.plans.fsdp2 import HEADS, Fsdp2Plan

__all__ = ["Fsdp2Executor", "executor"]


def executor(optimizer: Any, over_replicas: bool = False, master_dtype: torch.dtype | None = None) -> Fsdp2Executor:
    """The executor `zero.functional.adapters.executor` finds for DTensor params, with the
    options the optimizer asks for (``optimizer.executor_options()``): over HSDP's replicas too,
    with master weights."""
    return Fsdp2Executor(optimizer, over_replicas=over_replicas, master_dtype=master_dtype)


# How a param is kept whole here (errors about pieces say it): the plan asks the rule at construction
_WHOLE_HINT = ("over FSDP2 a param is stepped whole on an owner when its rule asks for it whole as the optimizer "
               "is built (asked on meta tensors of the params' names and shapes): make the rule's choice depend "
               "on those alone, not on values")


class Fsdp2Executor:
    """Steps a `zero.functional.Optimizer`'s DTensor params by the plan of its rules
    (``self.plan``, the same on every rank: its fingerprint is compared when made)."""

    def __init__(self, optimizer: Any, over_replicas: bool = False, master_dtype: torch.dtype | None = None):
        self.layout: Layout = read_layout(optimizer)
        self._groups = optimizer.param_groups
        replicas = self.layout.replicas if over_replicas else 1
        rules = [optimizer.rule(k) for k in range(len(optimizer.param_groups))]
        self.plan: Fsdp2Plan = plan_for(self.layout, rules, replicas)
        self.me = self.layout.replica * self.layout.world_size + self.layout.rank if replicas > 1 else self.layout.rank
        self._exchange_plan = self.plan.within(self.layout.replica)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.mesh = params[0].device_mesh
        self.mesh_ranks = _mesh_ranks(self.mesh)
        self._check_pieces(params)
        self._check_same_plan()
        device = params[0].device
        metas = self.layout.metas
        self.master_dtype = master_dtype
        self.masters: dict[int, torch.Tensor] = {}  # param -> the master of what this rank steps of it
        self._retaken = False
        self._stepped = False  # masters taken before the first step follow their params silently
        self._base = sharding.Sharding(
            {}, tuple(master_dtype or p.dtype for p in params), self._over_steppers(comm.summed, device),
            self._over_steppers(comm.maxed, device), every_group=True, names=tuple(m.name for m in metas),
            numels=tuple(m.numel for m in metas), shapes=tuple(m.shape for m in metas), whole_hint=_WHOLE_HINT)
        self._optimizer = optimizer
        self.guard = Fsdp2Guard(self, optimizer)  # the start of each step: the ranks' check-in, NaN and inf
        start_states(self, optimizer)

    @property
    def layout_key(self) -> str:
        """Which rank of which plan this is: a ``state_dict()`` of it holds this rank's pieces."""
        return f"rank {self.me} of FSDP2 plan {self.plan.fingerprint} ({self.plan.ranks} ranks)"

    def entries(self, saving: bool = True) -> Iterator[tuple[int, str, Any]]:
        """This rank's state entries by param position, in the params' placements (`fsdp2.state`)."""
        return fsdp2_entries(self, self._optimizer, saving)

    def load(self, entries: dict[int, dict[str, Any]], groups: list[dict]) -> None:
        load_fsdp2_entries(self, self._optimizer, entries)
        self.__dict__.pop("_placed", None)  # (a load may give the state new tensors)

    def placed(self, t: int, key: str, leaf: torch.Tensor, make: Any) -> Any:
        """``make()`` (state ``key`` of param ``t`` in the param's placement: a DTensor, or a
        ``ShardedTensor``), kept while the state's tensor is ``leaf``: the step updates a moment in
        place, so a checkpoint every N steps wraps each once (a DTensor costs 60 us to make)."""
        cache = self.__dict__.setdefault("_placed", {})
        kept = cache.get((t, key))
        if kept is None or kept[0] is not leaf:
            kept = cache[t, key] = (leaf, make())
        return kept[1]

    def whole_shapes(self, k: int, keep: tuple[int, ...], compute: Any) -> dict:
        """``compute()`` (the shapes of the state the rule starts for a set's whole params), kept
        per set: the plan fixes them, and torch's memory tracker reads ``optimizer.state`` after
        every step, where asking the rule again would allocate a whole model's state on meta."""
        cache = self.__dict__.setdefault("_whole_shapes", {})
        if (k, keep) not in cache:
            cache[k, keep] = compute()
        return cache[k, keep]

    def cut(self, t: int, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a tensor shaped like param ``t`` (what it steps of it: its rows,
        their run over the replicas; its heads' rows; the whole where it owns ``t``)."""
        if self.plan.owner[t] >= 0 or not whole.dim():
            return whole
        if self.plan.owner[t] == HEADS:
            start, length = self.plan.head_run(t, self.layout.rank)
            return whole.reshape(-1)[start:start + length].view(-1, *whole.shape[1:])
        start, length = self.plan.rows(t)[self.layout.rank]
        return self._part(t, whole.narrow(self.plan.dims[t], start, length).contiguous(), written=False)

    def _over_steppers(self, reduced: Any, device: torch.device) -> Any:
        """A reduction over every rank whose pieces the rules step: the shard group, then (a plan
        over the replicas, whose ranks step disjoint parts) the replicate group."""
        within = reduced(self.layout.group, device)
        if self.plan.replicas == 1:
            return within
        across = reduced(self.layout.replica_group, device)
        return lambda t: across(within(t))

    def step_group(self, k: int, idx: tuple[int, ...], params: Sequence[torch.Tensor],
                   grads: Sequence[torch.Tensor], run: Any) -> None:
        plan, layout = self.plan, self.layout
        ts = [layout.firsts[k] + i for i in idx]
        local = {t: p.to_local() for t, p in zip(ts, params)}
        local_grads = {t: _local(g, layout.metas[t].name) for t, g in zip(ts, grads)}
        wholes = to_owners(self._exchange_plan, layout.rank, layout.group, ts, local, local_grads)
        heads = to_head_steppers(plan, layout.rank, layout.group, ts, local, local_grads)
        keep, leaves, leaf_grads, pieces, written = [], [], [], {}, []
        for i, t in zip(idx, ts):
            if plan.owner[t] == HEADS:
                (leaf, grad), piece = heads[t], self._piece(t)
            elif plan.owner[t] < 0:
                leaf, grad, piece = self._part(t, local[t]), self._part(t, local_grads[t], False), self._piece(t)
            elif plan.owner[t] == self.me:
                (leaf, grad), piece = wholes[t], self._whole_piece(t)
            else:
                continue
            keep.append(i)
            leaves.append(self.master(t, leaf))
            leaf_grads.append(grad if self.master_dtype is None else grad.to(self.master_dtype))
            pieces[id(leaves[-1])] = piece
            if self.master_dtype is not None:
                written.append((leaf, leaves[-1]))
        with sharding.installed(dataclasses.replace(self._base, pieces=pieces)):
            run(tuple(keep), leaves, leaf_grads)
        for leaf, master in written:
            leaf.copy_(master)  # rounded to the param's dtype, which the exchanges then move
        back_from_owners(self._exchange_plan, layout.rank, layout.group, ts, {t: w[0] for t, w in wholes.items()},
                         local)
        back_from_head_steppers(plan, layout.rank, layout.group, ts, {t: h[0] for t, h in heads.items()}, local)
        if plan.replicas > 1:
            gather_replicas(plan, self.me, layout.replica_group, ts, local)
        self._stepped = True

    def master(self, t: int, leaf: torch.Tensor) -> torch.Tensor:
        """What the rule steps of param ``t`` on this rank: ``leaf`` (this rank's part, or the whole
        param it owns), or with ``master_dtype`` its master copy, started from ``leaf`` at first."""
        if self.master_dtype is None:
            return leaf
        master = self.masters.get(t)
        if master is None:
            master = self.masters[t] = leaf.detach().to(self.master_dtype, copy=True)
        elif not torch.equal(master.to(leaf.dtype), leaf):  # written outside the optimizer: one truth
            master.copy_(leaf)
            if not self._retaken and self._stepped:
                self._retaken = True
                warnings.warn(f"param {self.layout.metas[t].name!r} changed outside the optimizer since its "
                              f"{self.master_dtype} master was made (load_state_dict, nn.init, .data writes ...): its "
                              "master and those of any other param so changed are taken from the params again. "
                              "Said once; it is checked at every step.", stacklevel=5)
        return master

    def _part(self, t: int, local: torch.Tensor, written: bool = True) -> torch.Tensor:
        """What this rank steps of its local tensor of param ``t``: all of it at one replica, else
        its part of the flattened piece, a view where the step writes it (the param, in place)."""
        if self.plan.replicas == 1:
            return local
        if written and not local.is_contiguous():
            raise ValueError(f"param {self.layout.metas[t].name!r}'s local tensor is not contiguous on rank {self.me}: "
                             "its part of the step over the replicas cannot be written in place")
        start, length = self.plan.part(t, self.me)
        return local.reshape(-1)[start:start + length]

    @contextlib.contextmanager
    def starting(self, k: int, idx: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], list[torch.Tensor]]]:
        """The positions and tensors a step of group ``k``'s params at ``idx`` hands the rule on
        this rank (its pieces, and whole the params it owns, gathered: every rank calls this),
        with the step's sharding installed: to start their state outside a step (to load a
        checkpoint into) as a step would (low-bit state decided by each whole param)."""
        params = self.layout_params(k)
        keep, leaves, pieces = [], [], {}
        local = {self.layout.firsts[k] + i: params[i].detach().to_local() for i in idx}
        heads = to_head_steppers(self.plan, self.layout.rank, self.layout.group, list(local), local, None)
        for i in idx:
            t, p = self.layout.firsts[k] + i, params[i]
            whole = p.detach().full_tensor() if self.plan.owner[t] >= 0 else None
            if self.plan.owner[t] in (-1, HEADS, self.me):
                keep.append(i)
                mine = heads[t][0] if t in heads else self._part(t, local[t])
                leaves.append(self.master(t, mine if whole is None else whole))
                pieces[id(leaves[-1])] = self._piece(t) if whole is None else self._whole_piece(t)
        with sharding.installed(dataclasses.replace(self._base, pieces=pieces)):
            yield tuple(keep), leaves

    @property
    def mesh_group(self) -> Any:
        """The group of every rank of the mesh, which checkpoints are saved and loaded over: the
        1-D mesh's; HSDP's, the world, which the mesh must span (a ``ValueError`` otherwise)."""
        if self.mesh.ndim == 1:
            return self.layout.group
        import torch.distributed as dist

        if self.mesh.size() != dist.get_world_size():
            raise ValueError(f"the HSDP mesh {self.mesh} spans {self.mesh.size()} of the world's "
                             f"{dist.get_world_size()} ranks: its checkpoints are saved over the world; build the mesh "
                             "over every rank")
        return dist.group.WORLD

    def placements(self, t: int) -> tuple[Any, ...]:
        """Param ``t``'s placements on the mesh (FSDP2's ``Shard(d)``, after HSDP's ``Replicate()``)."""
        shard = Shard(self.plan.dims[t])
        return (Replicate(), shard) if self.mesh.ndim == 2 else (shard,)

    def layout_params(self, k: int) -> list[torch.Tensor]:
        return self._groups[k]["params"]

    def _piece(self, t: int) -> sharding.Pieces:
        """What this rank steps of param ``t`` (`_part`) as a piece of the whole: where it starts in
        the flattened param when it is one run of it (``Shard(0)``), and its quantization block."""
        plan = self.plan
        start = plan.start(t, self.layout.rank)
        at, length = plan.part(t, self.me)
        starts = () if start is None else (start + at,)
        return sharding.Pieces((t,), (length,), starts, plan.blocks[t])

    def _whole_piece(self, t: int) -> sharding.Pieces:
        return sharding.Pieces((t,), (self.layout.metas[t].numel,), (0,))

    def _check_pieces(self, params: list[torch.Tensor]) -> None:
        for t, p in enumerate(params):
            want = self.plan.local_shape(t, self.layout.rank)
            if tuple(p.to_local().shape) != want:
                raise ValueError(f"param {self.layout.metas[t].name!r}'s local tensor is {tuple(p.to_local().shape)} "
                                 f"on rank {self.layout.rank}, where torch.chunk's rows (FSDP2's) give {want}: "
                                 "zero.functional.Optimizer steps params as fully_shard cuts them")

    def _check_same_plan(self) -> None:
        """Every rank made this plan; else a ``ValueError`` naming the first param whose shape,
        dtype, dim, owner or block differs, and the ranks' values of it (compared within the shard
        group, then, over the replicas, across the replicate group)."""
        groups = [self.layout.group] + ([self.layout.replica_group] if self.plan.replicas > 1 else [])
        for group in groups if not comm.is_fake(self.layout.group) else ():  # (a simulation's ranks are one)
            self._check_same_plan_in(group)

    def _check_same_plan_in(self, group: Any) -> None:
        prints = comm.all_gather_object(self.plan.fingerprint, group)
        if len(set(prints)) == 1:
            return
        plan = self.plan
        rows = [(m.name, m.shape, m.dtype, plan.dims[i], plan.owner[i], plan.blocks[i])
                for i, m in enumerate(plan.metas)]
        everyone = comm.all_gather_object(rows, group)
        at = next((j for j in range(max(map(len, everyone))) if len({str(r[j:j + 1]) for r in everyone}) > 1), None)
        said = "" if at is None else f"; param {at} (name, shape, dtype, dim, owner, block) by rank: " + \
            ", ".join(f"{r}: {rows_r[at] if at < len(rows_r) else 'none'}" for r, rows_r in enumerate(everyone))
        raise ValueError(f"the ranks made different FSDP2 plans (their params or rules differ){said}")


def _mesh_ranks(mesh: Any) -> tuple[int, ...]:
    """The global rank at each place of ``mesh``, flattened (row-major). Read off the mesh's rank
    map, a tuple, where there is one: ``mesh.mesh`` makes a tensor, which under ``FakeTensorMode``
    (a simulated rank building its optimizer, or torch's memory tracker reading its state) is refused."""
    ranks = getattr(mesh, "_flatten_rank_map", None)
    if ranks is not None and len(ranks) == mesh.size():
        return tuple(int(r) for r in ranks)
    return tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())


def _local(grad: torch.Tensor, name: str) -> torch.Tensor:
    if not hasattr(grad, "to_local"):
        raise TypeError(f"param {name!r} is a DTensor but its gradient is a {type(grad).__name__}: FSDP2 gives "
                        "DTensor gradients; set p.grad to a DTensor of the param's placement")
    return grad.to_local()
