"""`ZeroRedundancyOptimizer`: torch's ZeRO-1 optimizer, as the executor of a `zero.Plan`.

The wiring: params -> `zero.param_metas` -> a `zero.Plan` (given, or made from ``strategy``) ->
the rank's `RankState` (what the plan gives this rank, and the local optimizer over it) and the
mode that executes the plan (`zero.backends.modes`: whole params, flat shards, reduce-scattered
shards, DDP overlap). A step checks that every rank is in it (`zero.backends.consistency`), then
hands over to the mode; the state formats read the rank state (`zero.backends.checkpoint`). The
class keeps torch's optimizer protocol; every placement decision is the plan layer's, every
execution detail the mode's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from zero.backends import clipping, comm
from zero.backends.checkpoint import consolidated
from zero.backends.consistency import OptimizerChecks, settings
from zero.backends.local_optimizer import is_functional, make_local_optimizer
from zero.backends.modes import Mode, make_mode
from zero.backends.modes.base import local_groups
from zero.backends.options import (
    check_blocks,
    check_plan_arguments,
    check_sync_options,
    check_torch_settings,
    default_plan,
    normalise_params,
)
from zero.backends.precision import Masters, planned_master_dtype, resolve_dtype, scaling_of, warn_fp16
from zero.backends.rank_state import RankState
from zero.backends.torch_names import TorchNames
from zero.backends.zero_executor import ZeroExecutor
from zero.functional.adapters.face import OptimizerFace
from zero.functional.adapters.nonfinite import NonFinite
from zero.functional.kernels.chains import Path
from zero.plans.checks import checksum
from zero.plans.meta import param_groups, param_metas
from zero.plans.partition import check_rank
from zero.plans.plan import Plan, check_plan, make_plan

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(TorchNames, OptimizerFace, Joinable):
    """Shard any optimizer's state across a process group (ZeRO stage 1); a drop-in for torch's.

    Each rank keeps the full model but steps, and holds state for, only what the plan gives it:
    whole params (torch's way), or with a flat plan an equal slice of every flat buffer of params.
    The updated params are then all-gathered, one collective per (device, dtype) (per flat
    buffer) rather than one broadcast per param. Params of several dtypes and devices may be mixed.

    Args:
        params: tensors, (name, tensor) pairs, param-group dicts (each group keeps its own
            hyperparameters), or an ``nn.Module`` (its named params, one group).
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
            buffers sized from the model (`zero.plans.layout.default_bucket_numel`: at most
            ``bucket_cap_mb`` MiB, and small enough that ZeRO-2's buckets in flight never hold
            more than ZeRO-1's whole gradients would).
        bucket_cap_mb: with ``strategy="flat"``: the flat buffers' (ZeRO-2's buckets') largest
            size in MiB (DDP's name and default, 25); the model's size may make them smaller.
        split_heads: with ``strategy="flat"``: the matrices the rule steps head by head (per-head
            Muon, ``MuonDimensionNumbers(heads=H)``) are cut at head edges into head buffers, each
            rank stepping an equal share of their heads where they lie (`zero.make_plan`'s
            ``split_heads``), instead of each kept whole on an owner.
        reduce_scatter_grads: average the gradients here, in place of DDP (flat plans only; ZeRO-2):
            each rank receives only its shards' gradients, by one reduce-scatter per flat buffer
            (the plan's ``bucket_numel``) that starts during backward, so an iteration moves 2x the
            model (DDP + ZeRO: 3x), and keeps only them and a few buckets (the params hold no
            ``.grad``). Each backward reduces and the shards accumulate; inside `no_sync` the whole
            gradient accumulates instead. Params are broadcast from rank 0 at construction, as
            DDP does. Do not wrap the model in DDP as well: its first forward is then a ``ValueError``.
        sync_chunk_mb: with ``parameters_as_bucket_view=False`` only, the scratch each all-gather
            may use, in MiB (default 16).
        master_dtype: e.g. ``torch.float32`` with bf16 params: the local optimizer steps master copies
            in this dtype of what this rank owns (its state in it too), with the gradients cast up,
            and writes them back rounded, so the all-gather moves 16-bit values (`zero.backends.precision`).
            A plan given must be made with the same ``master_dtype`` (its bytes count the masters).
            ``None``: step the params in their own dtype.
        reduce_dtype: with ``reduce_scatter_grads`` only: accumulate and reduce-scatter the gradients
            in this dtype (FSDP2's name; e.g. ``torch.float32`` for bf16 params). Default: the params'.
        nonfinite: what a step does with gradients that hold NaN or inf (`zero.backends.nonfinite`):
            ``"warn"`` (the default) steps and warns, ``"skip"`` skips the step on every rank together
            and warns, ``"raise"`` raises ``FloatingPointError`` before anything is stepped; each names
            the step, the params and the ranks where the values appeared. Checked at no collective of
            its own; a step a ``GradScaler`` drives is the scaler's to skip.
        find_unused_parameters: with ``reduce_scatter_grads`` only (DDP's name and meaning): a param
            an iteration's backward does not reach (conditional compute, experts) counts as zeros in
            the reductions, which then start when the step (or the next backward) comes; the result
            equals ``DDP(find_unused_parameters=True)`` + the same optimizer. One extra all-reduce
            per iteration finds the params no rank reached: a whole param keeps no gradient (its
            owner skips it, as torch does); one in a flat shard steps with a zero gradient (a
            warning names it). Off: such a param is a ``ValueError`` naming it.
        reducer: with ``reduce_scatter_grads`` only: how each bucket's gradients become this rank's
            shard of their mean, a `zero.backends.comm.Reducer`: by default `MeanReducer` (one
            reduce-scatter, then the mean); `zero.backends.Int8Reducer` sends int8 codes, one scale
            per block (ZeRO++'s qgZ), a quarter of the bytes. The plan's footprint takes the same
            reducer (`zero.plans.footprint.footprint(plan, rank, reducer=...)`).
        **defaults: hyperparameters for the local optimizer (``lr=...``).

    Attributes: ``plan`` (the `zero.Plan` executed), ``rank_state`` (the `RankState`: what this
    rank holds, the local optimizer ``optim`` and its ``masters``), ``mode`` (the
    `zero.backends.modes.Mode` executing the plan); and torch's names that code written against its
    class reads (``_all_params``, ``global_rank``, ``_param_to_rank`` ...: `zero.backends.torch_names`).

    Loss scaling: ``torch.amp.GradScaler`` hands ``step`` its scale and found-inf flag; the step
    unscales what it steps and skips on every rank together. With ``reduce_scatter_grads`` use
    `zero.backends.ShardedGradScaler`, whose scale follows that agreed flag.
    """

    def __new__(cls, params: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Over FSDP2's DTensor params, the optimizer that shards the state over HSDP's replicas too
        (`zero.backends.fsdp2.ReplicaShardedOptimizer`, which ``isinstance(opt,
        ZeroRedundancyOptimizer)`` holds for); over plain params, this class."""
        if cls is not ZeroRedundancyOptimizer:
            return super().__new__(cls)
        read = list(params) if isinstance(params, Iterator) else params  # a generator: read here, once
        from torch.distributed.tensor import DTensor

        groups = param_groups(read)
        if any(isinstance(p, DTensor) for g in groups for p in g["params"]):
            from zero.backends.fsdp2.replicas import ReplicaShardedOptimizer, named_groups

            ZeroRedundancyOptimizer.register(ReplicaShardedOptimizer)
            positional = dict(zip(("optimizer_class", "process_group", "parameters_as_bucket_view",
                                   "overlap_with_ddp"), args))
            # not an instance of this class: Python runs no __init__ on it
            return ReplicaShardedOptimizer(named_groups(groups), **positional, **kwargs)
        self = super().__new__(cls)
        self.__dict__["_params_read"] = read
        return self

    def __init__(self, params: Iterable, optimizer_class: Any, process_group: Any = None,
                 parameters_as_bucket_view: bool | None = None, overlap_with_ddp: bool = False, *,
                 plan: Plan | None = None, strategy: str | None = None, sync_chunk_mb: float | None = None,
                 reduce_scatter_grads: bool = False, master_dtype: torch.dtype | str | None = None,
                 reduce_dtype: torch.dtype | str | None = None, find_unused_parameters: bool = False,
                 nonfinite: str = "warn", bucket_cap_mb: float | None = None, reducer: comm.Reducer | None = None,
                 split_heads: bool = False, **defaults: Any):
        check_plan_arguments(plan, strategy, bucket_cap_mb, split_heads)
        self.nonfinite = NonFinite(nonfinite, overlap_with_ddp=bool(overlap_with_ddp))
        master_dtype = resolve_dtype(master_dtype, "master_dtype")
        reduce_dtype = resolve_dtype(reduce_dtype, "reduce_dtype")
        self.process_group = comm.resolve_group(process_group, "ZeroRedundancyOptimizer")
        check_sync_options(sync_chunk_mb, parameters_as_bucket_view)
        params = normalise_params(self.__dict__.pop("_params_read", params))
        self._ready = False
        # A torch class's keyword defaults are group settings; a zero.functional factory's are its
        # own arguments (learning_rate ...): its groups get their settings from the local optimizer.
        torch_class = isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)
        if torch_class:
            check_torch_settings(optimizer_class, defaults, params)
        OptimizerFace.__init__(self, params, defaults if torch_class else {})
        Joinable.__init__(self)
        self.world_size = comm.group_size(self.process_group)
        self.rank = comm.group_rank(self.process_group)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        metas = param_metas(self.param_groups)
        plan = plan if plan is not None else default_plan(metas, self.world_size, strategy, master_dtype,
                                                          optimizer_class, defaults, bucket_cap_mb, split_heads)
        check_plan(plan, metas, self.world_size)
        check_blocks(plan, metas, optimizer_class, defaults)
        self.master_dtype = planned_master_dtype(plan.master_dtype, master_dtype)
        warn_fp16(metas, self.master_dtype)
        self.rank_state = RankState([p for g in self.param_groups for p in g["params"]], self.param_groups, plan,
                                    self.rank, self.process_group, _local_optimizer(optimizer_class, defaults),
                                    self.master_dtype)
        self.mode: Mode = make_mode(self.rank_state, metas, optimizer_class=optimizer_class, defaults=defaults,
                                    overlap_with_ddp=bool(overlap_with_ddp), reduce_scatter_grads=reduce_scatter_grads,
                                    reduce_dtype=reduce_dtype, bucket_view=parameters_as_bucket_view,
                                    find_unused_parameters=bool(find_unused_parameters), reducer=reducer,
                                    chunk_bytes=int((sync_chunk_mb or 16) * 2**20))
        self.rank_state.build(local_groups(self.rank_state, self.mode.tensor), per_param=bool(overlap_with_ddp))
        me = weakref.ref(self)
        self.checks = OptimizerChecks(self.rank_state, lambda mode=self.mode: mode.trainable, lambda: _joined(me()))
        self.checks.watch_backwards()
        self.executor = ZeroExecutor(self.rank_state, self.mode, self.checks)
        self._consolidated: list[dict] | None = None  # every rank's state, on the rank it was consolidated to
        self._consolidated_to: int | None = None  # that rank, until the next step or load
        self._ready = True

    # -- the plan, what this rank holds, and its local step --------------------------------------

    @property
    def plan(self) -> Plan:
        """The `zero.Plan` this optimizer executes (with overlap_with_ddp, DDP's buckets' ownership)."""
        return self.rank_state.plan

    @property
    def partition(self):
        """The `zero.Partition` this optimizer executes (owner of each param, in ``param_groups``
        order); None under a flat plan, whose placement is ``plan.flat``; under a hybrid plan,
        the owners of the params it keeps whole (-1 for the rest, in ``plan.flat``)."""
        return self.plan.partition

    @property
    def path(self) -> list:
        """Per param group, what this rank's local step runs (`zero.functional.explain`): the
        kernel and its calls for a transformation; a ``torch.optim`` class steps itself, with the
        ``foreach=`` / ``fused=`` it was given passed through (torch's defaults otherwise, so the
        step stays bit-exact with torch's ZeroRedundancyOptimizer)."""
        if is_functional(self.optim):
            trainable = self.rank_state.trainable_locals()  # shards and masters have no requires_grad
            return self.optim.explain_groups(trainable.__contains__)
        name = f"{type(self.optim).__module__}.{type(self.optim).__name__}.step"
        return [Path(name, 1, f"a torch.optim class: foreach={g.get('foreach')}, fused={g.get('fused')}, as given")
                for g in self.optim.param_groups]

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for gradients (or updates) with NaN or inf: by ``nonfinite="skip"``, and by
        an ``apply_if_finite`` in a `zero.functional` rule (each also warned of)."""
        local = self.optim.skipped_steps if is_functional(self.optim) else 0
        return self.nonfinite.skipped + local

    @property
    def optim(self) -> Optimizer:
        """The local optimizer: over the params (or flat shards) this rank steps."""
        return self.rank_state.optim

    @property
    def masters(self) -> Masters:
        """This rank's master copies (``masters.nbytes()``: what the plan's ``master_bytes`` predicts)."""
        return self.rank_state.masters

    # -- torch.optim.Optimizer protocol ----------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (a collective): old params keep their owners and state.

        The plan is made again with its own strategy and settings for the params with the new
        group; a strategy that would move existing params, and any flat plan, is a ``ValueError``.
        """
        if not self._ready:
            return super().add_param_group(param_group)
        param_group = normalise_params([param_group])[0]  # type and sparsity errors, before any collective
        shapes = [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in param_group["params"]]
        facts = [("the new group's number of params", len(shapes))]
        facts += [(f"the new group's param {j} (shape, dtype, requires_grad)", s) for j, s in enumerate(shapes)]
        facts += [(f"the new group's {key}", value) for key, value in sorted(settings(param_group).items())]
        self.checks.check_in("add_param_group", checksum((shapes, settings(param_group))), lambda: facts)()
        self.mode.check_extendable()
        old = self.plan
        super().add_param_group(param_group)
        self.rank_state.params.extend(param_group["params"])
        metas = param_metas(self.param_groups)
        plan = make_plan(metas, self.world_size, old.strategy, old.weight, old.optimizer, old.alignment)
        if plan.partition.owner[:len(old.partition.owner)] != old.partition.owner:
            raise ValueError(f"strategy {old.strategy!r} moves existing params when a group is added; "
                             "use 'sorted_greedy' or 'greedy' with add_param_group")
        self.rank_state.replan(plan)
        self.mode.extend(metas)
        self.rank_state.add_group(local_groups(self.rank_state, self.mode.tensor)[-1])

    # torch.amp.GradScaler hands the step its scale and found-inf flag (``grad_scale``, ``found_inf``)
    # instead of unscaling the params' grads itself: the step unscales what it steps (the shards'
    # reduced gradients, the masters') and skips on every rank together.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step what this rank holds with the local optimizer, then all-gather every updated param.

        Driven by ``torch.amp.GradScaler.step`` (or `zero.backends.ShardedGradScaler`'s), the
        gradients are unscaled here and a step with a non-finite gradient on any rank is skipped
        on every rank (one all-reduce of the flag)."""
        if not self.training:
            raise ValueError("step() between optimizer.eval() and optimizer.train(): the params hold the schedule-free "
                             "average x, and a step must start from the gradient point y; call optimizer.train() first")
        Join.notify_join_context(self)
        state = self.rank_state
        scaling = scaling_of(self, self.mode.gradients.scaler_sees_grads, state.scaler_follows_agreement)
        self._consolidated = self._consolidated_to = None
        with state.scaled(scaling):
            return self.mode.step(closure, kwargs, self._begin_step)

    def eval(self) -> None:
        """Schedule-free rules: the evaluation params into every rank's params (each rank swaps what
        it steps, its masters rounded in, then the step's sync); a no-op for other rules, and for a
        ``torch.optim`` class without ``eval``. A collective: every rank calls it."""
        self._swap_mode("eval")

    def train(self, mode: bool = True) -> None:
        """Back to the params the rule steps at, after `eval` (``train(False)`` is `eval`)."""
        self._swap_mode("train" if mode else "eval")

    _evaluating = False  # between eval() and train(), when the local optimizer had params to swap

    @property
    def training(self) -> bool:
        return not self._evaluating

    def mark_evaluating(self, evaluating: bool) -> None:
        """A state dict saved in eval mode was loaded: this rank's local optimizer goes back to eval
        mode too, so ``train()`` swaps the saved average back to the gradient point."""
        if evaluating and is_functional(self.optim) and self.optim.has_swap():
            self.optim.mark_evaluating(True)
            self._evaluating = True
        elif not evaluating:
            self._evaluating = False
            if is_functional(self.optim):
                self.optim.mark_evaluating(False)

    @torch.no_grad()
    def _swap_mode(self, to: str) -> None:
        local, evaluating = self.optim, to == "eval"
        swap = getattr(local, to, None)
        if swap is None or evaluating == self._evaluating:
            return
        if is_functional(local) and not local.has_swap():  # (the rule's, alike on every rank)
            return
        swap()  # (schedulefree's torch classes swap their own params: the same contract)
        state = self.rank_state
        state.masters.write_back(state.masters.every_pair())
        self.mode.sync_params()
        self._evaluating = evaluating

    def state_key(self) -> Any:
        # the steps every rank agreed to take: under overlap_with_ddp the step runs inside backward
        return self.state_version, self.rank_state.steps

    def _begin_step(self) -> Callable[[], None]:
        """What every mode that steps here does first: check the params, then the start every zero
        optimizer shares (`zero.functional.adapters.face.OptimizerFace.begin_step`: the ranks'
        check-in, the non-finite policy), then hand the groups' settings to the local optimizer.
        Returns what runs after the local step."""
        state = self.rank_state
        if self.mode.trainability_changed():
            self.mode.retrain(param_metas(self.param_groups))
            state.adopt_unfrozen()
        self.mode.storage.check()
        self.mode.gradients.start_pending()  # find_unused_parameters: what backward left pending, before the check-in
        state.skipping, after = self.begin_step(self.executor, state.steps + 1, scaled=state.scaling is not None)
        state.push()
        return after

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; with ``reduce_scatter_grads`` the shards' gradients are zeroed in place (the
        params hold none)."""
        self.mode.gradients.zero_grad(lambda: super(ZeroRedundancyOptimizer, self).zero_grad(set_to_none))

    def no_sync(self):
        """With ``reduce_scatter_grads``: backward passes inside only accumulate the whole gradients
        (as ``DDP.no_sync``); the first backward after it reduces the sum. Without it each backward
        reduces and only the shards accumulate (ZeRO-2's memory)."""
        return self.mode.gradients.no_sync()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip the gradients this optimizer steps by their total norm, as
        ``torch.nn.utils.clip_grad_norm_`` (same arguments; returns the total norm, the same on
        every rank). Call it on every rank, after the last backward, before ``step``.

        With ``reduce_scatter_grads`` the params hold no ``.grad``: it clips the shards' averaged
        gradients, with one all-reduce for the norm, and equals DDP + torch's call. (torch's own
        call on all the params does the same; on part of them it is a ``ValueError``.) Otherwise
        it is torch's call on the params' gradients (DDP's, averaged). With a loss scale, unscale
        first (``scaler.unscale_(opt)``), as with torch."""
        return clipping.clip_grad_norm_(self.mode, max_norm, norm_type, error_if_nonfinite, foreach)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the state onto rank ``to`` (call on all ranks); its
        `state_dict` then returns the whole state, as torch's does, until the next step or load.

        Shards move as raw tensors, rank by rank, point to point to ``to``, and are kept in CPU
        memory there; no other rank receives anything.
        """
        check_rank(to, self.world_size, "to")
        self.checks.check_in("consolidate_state_dict", to)()  # a rank that skipped a step fails here, by name
        self._consolidated = None
        self._consolidated = consolidated.gather(self.rank_state, to)
        self._consolidated_to = to

    def state_dict(self) -> dict[str, Any]:
        """After `consolidate_state_dict` (on its rank ``to``): the global state, as a plain
        ``torch.optim`` optimizer over all params would save it, which loads into one at any world
        size. Otherwise this rank's part, in torch's form (`zero.functional.adapters.face`): what
        torch's ``get_state_dict`` and DCP save and reshard, each rank its pieces."""
        if self._consolidated_to is not None and self._consolidated is None:
            raise RuntimeError(f"the optimizer state was consolidated on rank {self._consolidated_to}, not on rank "
                               f"{self.rank}: call state_dict() there (or consolidate_state_dict(to={self.rank}) on "
                               "all ranks)")
        if self._consolidated is None:
            return super().state_dict()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = consolidated.to_global(self.rank_state, self._consolidated)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_torch_state_dict(self, saved: dict[str, Any]) -> None:
        """A global state dict (ours at any world size, torch's, or a plain optimizer's), or this
        rank's part in torch's form (`state_dict` without consolidating; torch's ``set_state_dict``)."""
        self._consolidated = self._consolidated_to = None
        if consolidated.is_global(saved):
            consolidated.load(self.rank_state, saved, self.check_settings)
        else:
            super().load_torch_state_dict(saved)

    # -- Join (uneven inputs) --------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Shadow the step's collectives on ranks that ran out of inputs (see ``torch...Join``)."""
        return self.mode.join_hook(self.step)

    @property
    def join_device(self) -> torch.device:
        return self.rank_state.device

    @property
    def join_process_group(self) -> Any:
        return self.process_group


def _joined(opt: ZeroRedundancyOptimizer | None) -> bool:
    """Whether ``opt`` steps inside ``Join`` (torch's Joinable keeps the flag)."""
    config = getattr(opt, "_join_config", None)
    return config is not None and config.enable


def _local_optimizer(optimizer_class: Any, defaults: dict) -> Callable[[list[dict], bool], Optimizer]:
    """How the rank state builds its local optimizer over its groups (see `make_local_optimizer`)."""
    return lambda groups, per_param: make_local_optimizer(optimizer_class, groups, defaults, per_param=per_param)

