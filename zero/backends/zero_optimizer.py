"""`ZeroRedundancyOptimizer`: torch's ZeRO-1 optimizer, as the executor of a `zero.Plan`.

Construction: params -> `zero.param_metas` -> a `zero.Plan` (given, or made from ``strategy``) ->
a local optimizer over what the plan gives this rank -> the sync that writes every replica.
Whole-param plans: the owned params, synced by `ParamSync` (`zero.bucket_views`). Flat plans:
one 1-D shard per flat buffer, synced by `FlatShards`. A step runs the local optimizer, then the
sync. The class keeps only the plan, the local optimizer and the sync buffers; every placement
decision is the plan layer's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from zero.backends import comm
from zero.backends.flat import FlatShards, flat_to_global, flat_to_local
from zero.backends.grad_shards import ReduceScatterSteps
from zero.backends.local_optimizer import (
    check_shardable,
    check_state_keys,
    copy_hyperparams,
    is_functional,
    local_groups,
    make_local_optimizer,
    per_element_keys,
)
from zero.backends.overlap import OverlapSteps
from zero.backends.state_dict import check_compatible, to_global, to_local
from zero.backends.sync import ParamSync
from zero.functional import sharding
from zero.plans.checks import checksum
from zero.plans.layout import FLAT_BUCKET_NUMEL, bucket_views
from zero.plans.meta import ParamMeta, param_groups, param_metas
from zero.plans.partition import check_rank
from zero.plans.plan import PLAN_STRATEGIES, Plan, check_plan, make_plan
from zero.plans.shards import local_indices

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


class ZeroRedundancyOptimizer(OverlapSteps, ReduceScatterSteps, Optimizer, Joinable):
    """Shard any optimizer's state across a process group (ZeRO stage 1); a drop-in for torch's.

    Each rank keeps the full model but steps, and holds state for, only what the plan gives it:
    whole params (torch's way), or with a flat plan an equal slice of every flat buffer of params.
    The updated params are then all-gathered, one collective per (device, dtype) (per flat
    buffer) rather than one broadcast per param. Params of several dtypes and devices may be mixed.

    Args:
        params: tensors or param-group dicts (each group keeps its own hyperparameters).
        optimizer_class: a ``torch.optim.Optimizer`` class, a `zero.functional` transformation,
            or a `zero.functional` factory such as ``zero.functional.adam``.
        process_group: the group to shard over (default: the world).
        parameters_as_bucket_view: where the params' storage lives, so that the all-gather after
            a step writes them in place. ``None`` (the default, and the fastest): params become
            views into the rows that are all-gathered, unless those rows would pad by more than
            ``zero.backends.sync.PAD_LIMIT``; then params of 1 MiB or more are broadcast straight
            into their own storage instead; ``True``: every param is a view into its owner's
            row (torch's bucket view); ``False``: params keep their own storage and small ones
            are copied through scratch rows of at most ``sync_chunk_mb``. Flat plans always
            keep params as views into their flat buffers.
        overlap_with_ddp: step inside DDP's comm hook, bucket by bucket, while backward runs:
            register ``zero.backends.hook_with_zero_step(allreduce_hook, ddp, optimizer)`` (or the
            interleaved one) on the DDP model, whose buckets then decide ownership; ``step()`` in
            the loop is a no-op. Whole-param plans only.
        plan: the `zero.Plan` to execute, made by `zero.make_plan` for exactly these params
            (``zero.param_metas(params)``) and this world size, on every rank alike.
        strategy: shorthand for ``plan=zero.make_plan(zero.param_metas(params), world_size,
            strategy)``; ``"sorted_greedy"`` (torch's) when neither is given. ``"flat"`` shards
            elements (DeepSpeed's ZeRO-1): balanced to the element, for element-wise rules, in
            buffers of at most ``zero.plans.layout.FLAT_BUCKET_NUMEL`` elements.
        reduce_scatter_grads: average the gradients here, in place of DDP (flat plans only): each
            rank receives only its shards' gradients, by one reduce-scatter per flat buffer that
            starts during backward, so an iteration moves 2x the model (DDP + ZeRO: 3x). Params
            are broadcast from rank 0 at construction, as DDP does; grads live in flat buffers
            (``zero_grad`` zeroes them in place); accumulate micro-batches inside `no_sync`.
        sync_chunk_mb: with ``parameters_as_bucket_view=False`` only, the scratch each all-gather
            may use, in MiB (default 16).
        **defaults: hyperparameters for the local optimizer (``lr=...``).
    """

    def __init__(self, params: Iterable, optimizer_class: Any, process_group: Any = None,
                 parameters_as_bucket_view: bool | None = None, overlap_with_ddp: bool = False, *,
                 plan: Plan | None = None, strategy: str | None = None, sync_chunk_mb: float | None = None,
                 reduce_scatter_grads: bool = False, **defaults: Any):
        _check_plan_arguments(plan, strategy)
        self.process_group = comm.resolve_group(process_group, "ZeroRedundancyOptimizer")
        _check_sync_options(sync_chunk_mb, parameters_as_bucket_view)
        params = _normalise_params(params)
        self._ready = False
        # A torch class's keyword defaults are group settings; a zero.functional factory's are its
        # own arguments (learning_rate ...): its groups get their settings from the local optimizer.
        torch_class = isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)
        Optimizer.__init__(self, params, defaults if torch_class else {})
        Joinable.__init__(self)
        self.world_size = comm.group_size(self.process_group)
        self.rank = comm.group_rank(self.process_group)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._chunk_bytes = int((sync_chunk_mb or 16) * 2**20)
        self._all_params = [p for g in self.param_groups for p in g["params"]]
        self._default_device = self._all_params[0].device
        self._metas = param_metas(self.param_groups)
        self.plan = plan if plan is not None else _default_plan(self._metas, self.world_size, strategy)
        check_plan(self.plan, self._metas, self.world_size)
        self._overlap, self._attached = bool(overlap_with_ddp), False
        if self.plan.flat is not None:
            check_shardable(optimizer_class)
            if self._overlap:
                raise ValueError("overlap_with_ddp=True steps whole params as DDP's buckets arrive: use a "
                                 "whole-param plan (flat plans reduce-scatter instead: reduce_scatter_grads=True)")
        elif reduce_scatter_grads:
            raise ValueError("reduce_scatter_grads=True needs a flat plan (strategy='flat'): whole-param plans "
                             "leave every rank the full gradients, as DDP does")
        self._sync: ParamSync | FlatShards | None = None
        self._build_sync()
        self._grad_shards = self._reduce_scatter_grads() if reduce_scatter_grads else None
        self._optimizer_class, self._defaults = optimizer_class, defaults
        self.optim = make_local_optimizer(optimizer_class, self._local_groups(), defaults, per_param=self._overlap)
        self._pull_hyperparams()
        self._consolidated: list[dict] | None = None
        self._steps = 0
        self._ready = True

    # -- the plan and its execution --------------------------------------------------------------

    @property
    def partition(self):
        """The `zero.Partition` this optimizer executes (owner of each param, in ``param_groups``
        order); None under a flat plan, whose placement is ``plan.flat``."""
        return self.plan.partition

    def _local_groups(self) -> list[dict]:
        if self.plan.flat is not None:
            return self._sync.local_groups(self.param_groups)
        if self._overlap:  # stepped inside backward: the local optimizer's params (and their .grad)
            # are stand-ins sharing the params' storage, so DDP's and autograd's grads stay untouched
            self._stand_ins = {i: self._all_params[i].detach() for i in self.plan.partition.params_of(self.rank)}
            return local_groups(self.param_groups, self._indices[self.rank],
                                [self._stand_ins.get(i, p) for i, p in enumerate(self._all_params)])
        return local_groups(self.param_groups, self._indices[self.rank], self._all_params)

    # The outer param_groups are the truth users and lr schedulers write; the local optimizer's
    # groups copy them before it reads them (push), and hand back the settings it fills in when
    # it is built or loaded (pull).
    def _push_hyperparams(self) -> None:
        copy_hyperparams(self.param_groups, self.optim.param_groups)

    def _pull_hyperparams(self) -> None:
        copy_hyperparams(self.optim.param_groups, self.param_groups)

    def _build_sync(self) -> None:
        """(Re)build the sync for the current trainable params (they may change between steps)."""
        self._metas = param_metas(self.param_groups)
        self._requires_grad = [m.requires_grad for m in self._metas]
        self._trainable = checksum(self._requires_grad)
        if self.plan.flat is not None:
            if self._sync is not None:
                raise ValueError("params were frozen or unfrozen after building a flat plan's optimizer; a flat "
                                 "plan packs the trainable params at construction: build the optimizer again "
                                 "(moving its state_dict), or use a whole-param plan")
            self._sync = FlatShards(self._all_params, self._metas, self.plan.flat, self.rank, self.process_group)
            self._rules = self._sharding()
            return
        if self._sync is not None:
            self._sync.release()
        self._indices = local_indices(self._metas, self.plan.partition, len(self.param_groups))
        layout = bucket_views(self._metas, self.plan.partition)
        self._sync = ParamSync(self._all_params, layout, self.rank, self.process_group,
                               self.parameters_as_bucket_view, self._chunk_bytes)
        self._rules = self._sharding()

    def _trainability_changed(self) -> bool:
        """Whether a param was frozen or unfrozen since the sync was built (read every step)."""
        return [p.requires_grad for p in self._all_params] != self._requires_grad

    def _sharding(self) -> sharding.Sharding:
        """The pieces of whole params this rank's local params are, for rules over whole tensors
        (made with the sync, which decides what the local params are)."""
        def reduce(t: torch.Tensor) -> torch.Tensor:
            t = t.to(self._comm_device())
            comm.all_reduce_sum(t, self.process_group)
            return t.cpu()

        if self.plan.flat is not None:
            return self._sync.sharding(reduce)
        pieces = {id(p): sharding.Pieces((i,), (p.numel(),))
                  for i, p in enumerate(self._all_params) if self.plan.partition.owner[i] == self.rank}
        return sharding.Sharding(pieces, tuple(p.dtype for p in self._all_params), reduce,
                                 numels=tuple(p.numel() for p in self._all_params))

    # -- torch.optim.Optimizer protocol ----------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (a collective): old params keep their owners and state.

        The plan is made again with its own strategy and settings for the params with the new
        group; a strategy that would move existing params, and any flat plan, is a ``ValueError``.
        """
        if not self._ready:
            return super().add_param_group(param_group)
        param_group = _normalise_params([param_group])[0]  # type and sparsity errors, before any collective
        shapes = [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in param_group["params"]]
        new_group = (shapes, {k: v for k, v in param_group.items() if k != "params"})
        self._check_in("add_param_group", checksum(new_group))()
        if self.plan.flat is not None:
            raise ValueError("add_param_group cannot extend a flat plan (its buffers would be packed again): "
                             "build the optimizer with every group, or use a whole-param plan")
        old_owner = self.plan.partition.owner
        super().add_param_group(param_group)
        self._all_params.extend(param_group["params"])
        p = self.plan
        self.plan = make_plan(param_metas(self.param_groups), self.world_size, p.strategy, p.weight, p.optimizer,
                              p.alignment)
        if self.plan.partition.owner[:len(old_owner)] != old_owner:
            raise ValueError(f"strategy {p.strategy!r} moves existing params when a group is added; "
                             "use 'sorted_greedy' or 'greedy' with add_param_group")
        self._build_sync()
        self.optim.add_param_group(self._local_groups()[-1])
        self._pull_hyperparams()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step what this rank holds with the local optimizer, then all-gather every updated param."""
        Join.notify_join_context(self)
        if self._overlap:
            return self._overlapped_step(closure)
        if self._trainability_changed():
            logger.info("trainable params changed; rebuilding the sync buckets")
            self._build_sync()
        self._sync.watch.check()
        verify = self._check_in("step")
        self._push_hyperparams()
        if self._grad_shards is not None and not is_functional(self.optim) and closure is None and not kwargs:
            self._step_pipelined(verify)
            self._steps += 1
            return None
        loss = self._step_local(closure, **kwargs)
        verify()  # before any param moves: ranks that diverged get a ValueError, not mismatched collectives
        self._steps += 1
        self._sync.sync()
        return loss

    def _step_local(self, closure: Callable[[], float] | None, **kwargs: Any) -> float | None:
        loss = None
        if self.plan.flat is not None:  # the shards' gradients are copies: take them after the closure ran
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            closure = None
            if self._grad_shards is None:
                self._sync.load_grads()
            else:
                self._grad_shards.finish(self.world_size)
                self._sync.use_reduced_grads()
        rules = sharding.installed(self._rules) if is_functional(self.optim) else contextlib.nullcontext()
        try:
            with rules:
                if closure is None:
                    out = self.optim.step(**kwargs)
                else:
                    with torch.enable_grad():
                        out = self.optim.step(closure=closure, **kwargs)
            return loss if loss is not None else out
        finally:
            if self.plan.flat is not None:
                self._sync.clear_grads()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the state onto rank ``to`` (call on all ranks).

        Shards move as raw tensors, rank by rank, point to point to ``to``, and are kept in CPU
        memory there; no other rank receives anything.
        """
        comm_rank = check_rank(to, self.world_size, "to")
        self._check_in("consolidate_state_dict", to)()  # a rank that skipped a step fails here, by name
        self._push_hyperparams()
        mine = self.optim.state_dict()
        device = self._comm_device()
        self._consolidated = None
        if self.rank != comm_rank:
            comm.send_tree(mine, comm_rank, self.process_group, device)
            return
        shards = []
        for r in range(self.world_size):
            shards.append(_cpu_copy(mine) if r == self.rank else comm.recv_tree(r, self.process_group, device))
        self._consolidated = shards

    def state_dict(self) -> dict[str, Any]:
        """The global state, as a plain ``torch.optim`` optimizer over all params would save it.

        Only on the rank that last received `consolidate_state_dict`.
        """
        if self._consolidated is None:
            raise RuntimeError(f"the optimizer state has not been consolidated on rank {self.rank}: call "
                               f"consolidate_state_dict(to={self.rank}) on all ranks before state_dict()")
        if self.plan.flat is None:
            return to_global(self._consolidated, self._indices, self.param_groups, self.plan.partition.owner)
        return flat_to_global(self._consolidated, self.plan, self.param_groups, per_element_keys(self.optim))

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Load a global state dict (ours at any world size, torch's, or a plain optimizer's)."""
        check_compatible(saved, self._all_params, [len(g["params"]) for g in self.param_groups])
        check_state_keys(saved, self.optim)
        if self.plan.flat is None:
            mine = to_local(saved, self._indices[self.rank], self.rank, self.plan.partition.owner)
        else:
            mine = flat_to_local(saved, self.plan, self.rank, per_element_keys(self.optim))
        self.optim.load_state_dict(mine)  # torch's own rules place each state tensor on its device
        self._pull_hyperparams()

    # -- Join (uneven inputs) --------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Shadow the step's collectives on ranks that ran out of inputs (see ``torch...Join``)."""
        if self._overlap:  # the comm hook steps and syncs while DDP's join hook shadows the all-reduces
            return JoinHook()
        if self._grad_shards is not None:
            raise NotImplementedError("Join with reduce_scatter_grads=True: a joined rank would have to shadow "
                                      "the gradients' reduce-scatters too; use DDP + Join for uneven inputs")
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def _check_in(self, what: str, argument: int = 0):
        """Start the check that every rank is in the same call on the same optimizer (see `comm.check_in`)."""
        groups = [(len(g["params"]), {k: v for k, v in g.items() if k != "params"}) for g in self.param_groups]
        fields = {"steps taken": self._steps, "param groups (sizes and settings such as lr)": checksum(groups),
                  "plan (its fingerprint: params, groups, placement)": int(self.plan.fingerprint[:15], 16),
                  "trainable params (requires_grad)": self._trainable,
                  "the call's argument (to=, or the new group)": argument}
        return comm.check_in(what, fields, self.process_group, self._comm_device())

    def _comm_device(self) -> torch.device:
        if dist.get_backend(self.process_group) == "nccl":
            return self._default_device
        return torch.device("cpu")


class _ZeroJoinHook(JoinHook):
    def __init__(self, zero: ZeroRedundancyOptimizer):
        self.zero = zero

    def main_hook(self) -> None:
        # A joined rank still owns params: step them with the (shadowed, all-reduced) gradients
        # and take part in the all-gather, as the ranks with inputs do.
        self.zero.step()


def _default_plan(metas: list[ParamMeta], world_size: int, strategy: str | None) -> Plan:
    if strategy == "flat":
        return make_plan(metas, world_size, "flat", bucket_numel=FLAT_BUCKET_NUMEL)
    return make_plan(metas, world_size, strategy or "sorted_greedy")


def _check_plan_arguments(plan: Any, strategy: Any) -> None:
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a zero.Plan (from zero.make_plan or Plan.from_json), got {type(plan).__name__}")
    if plan is not None and strategy is not None:
        raise ValueError(f"pass plan= or strategy=, not both (the plan's strategy is {plan.strategy!r})")
    if strategy is not None and strategy not in PLAN_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {PLAN_STRATEGIES}")


def _check_sync_options(sync_chunk_mb: Any, bucket_view: Any) -> None:
    if bucket_view is not None and not isinstance(bucket_view, bool):
        raise TypeError(f"parameters_as_bucket_view must be None, True or False, got {bucket_view!r}")
    if sync_chunk_mb is None:
        return
    if isinstance(sync_chunk_mb, bool) or not isinstance(sync_chunk_mb, (int, float)) or sync_chunk_mb <= 0:
        raise ValueError(f"sync_chunk_mb must be a positive number, got {sync_chunk_mb!r}")
    if bucket_view is not False:
        raise ValueError(f"sync_chunk_mb={sync_chunk_mb} sizes the scratch rows of parameters_as_bucket_view=False; "
                         f"with parameters_as_bucket_view={bucket_view} the params are the rows and there is no "
                         "scratch: drop sync_chunk_mb, or pass parameters_as_bucket_view=False")


def _normalise_params(params: Any) -> list[dict]:
    """Params as a list of group dicts (generators read once), checked by position first."""
    groups = param_groups(params)
    if not groups or not any(g["params"] for g in groups):
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    metas = param_metas(groups)  # non-tensors, sparse and repeated params fail here, by position
    flat = [p for g in groups for p in g["params"]]
    for m, p in zip(metas, flat):
        if p.requires_grad and not p.is_contiguous():
            raise ValueError(f"params[{m.name}] (shape {tuple(p.shape)}) is not contiguous; "
                             "pass contiguous parameters")
    return groups


def _cpu_copy(tree: Any) -> Any:
    return optree.tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x,
                           tree, none_is_leaf=True)
