"""`ZeroRedundancyOptimizer`: torch's ZeRO-1 optimizer, as the executor of a `zero.Plan`.

The wiring: params -> `zero.param_metas` -> a `zero.Plan` (given, or made from ``strategy``) ->
the mode that executes it (`zero.backends.modes`: whole params, flat shards, reduce-scattered
shards, DDP overlap) -> a local optimizer over what the mode gives this rank. A step checks that
every rank is in it, then hands over to the mode. The class keeps the mode, the local optimizer
and torch's optimizer protocol; every placement decision is the plan layer's, every execution
detail the mode's.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from zero.backends import comm
from zero.backends.local_optimizer import LocalStep, check_state_keys, is_functional, make_local_optimizer
from zero.backends.masters import Masters, Scaling, resolve_dtype
from zero.backends.modes import Mode, make_mode
from zero.backends.state_dict import check_compatible
from zero.backends.watch import Place, watch_of
from zero.functional.fast.chains import Path
from zero.plans.checks import checksum
from zero.plans.ddp_buckets import ddp_bucket_partition
from zero.plans.diff import plan_facts
from zero.plans.layout import FLAT_BUCKET_NUMEL
from zero.plans.meta import ParamMeta, param_groups, param_metas
from zero.plans.partition import check_rank
from zero.plans.plan import PLAN_STRATEGIES, Plan, check_plan, make_plan

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


class ZeroRedundancyOptimizer(Optimizer, Joinable):
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
            (``zero_grad`` zeroes them in place); accumulate micro-batches inside `no_sync`. Do not
            wrap the model in DDP as well: its first forward is then a ``ValueError``.
        sync_chunk_mb: with ``parameters_as_bucket_view=False`` only, the scratch each all-gather
            may use, in MiB (default 16).
        master_dtype: e.g. ``torch.float32`` with bf16 params: the local optimizer steps master copies
            in this dtype of what this rank owns (its state in it too), with the gradients cast up,
            and writes them back rounded, so the all-gather moves 16-bit values (`zero.backends.masters`).
            A plan given must be made with the same ``master_dtype`` (its bytes count the masters).
            ``None``: step the params in their own dtype.
        reduce_dtype: with ``reduce_scatter_grads`` only: accumulate and reduce-scatter the gradients
            in this dtype (FSDP2's name; e.g. ``torch.float32`` for bf16 params). Default: the params'.
        **defaults: hyperparameters for the local optimizer (``lr=...``).

    Attributes: ``plan`` (the `zero.Plan` executed), ``mode`` (the `zero.backends.modes.Mode`
    executing it), ``optim`` (the local optimizer), ``masters`` (its `zero.backends.masters.Masters`).

    Loss scaling: ``torch.amp.GradScaler`` hands ``step`` its scale and found-inf flag; the step
    unscales what it steps and skips on every rank together. With ``reduce_scatter_grads`` use
    `zero.backends.ShardedGradScaler`, whose scale follows that agreed flag.
    """

    def __init__(self, params: Iterable, optimizer_class: Any, process_group: Any = None,
                 parameters_as_bucket_view: bool | None = None, overlap_with_ddp: bool = False, *,
                 plan: Plan | None = None, strategy: str | None = None, sync_chunk_mb: float | None = None,
                 reduce_scatter_grads: bool = False, master_dtype: torch.dtype | str | None = None,
                 reduce_dtype: torch.dtype | str | None = None, **defaults: Any):
        _check_plan_arguments(plan, strategy)
        master_dtype = resolve_dtype(master_dtype, "master_dtype")
        reduce_dtype = resolve_dtype(reduce_dtype, "reduce_dtype")
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
        self._all_params = [p for g in self.param_groups for p in g["params"]]
        self._default_device = self._all_params[0].device
        metas = param_metas(self.param_groups)
        plan = plan if plan is not None else _default_plan(metas, self.world_size, strategy, master_dtype)
        check_plan(plan, metas, self.world_size)
        self.master_dtype = _master_dtype_of(plan, master_dtype)
        _warn_fp16(metas, self.master_dtype)
        self.mode: Mode = make_mode(self._all_params, metas, plan, self.rank, self.process_group,
                                    len(self.param_groups), optimizer_class=optimizer_class, defaults=defaults,
                                    overlap_with_ddp=bool(overlap_with_ddp), reduce_scatter_grads=reduce_scatter_grads,
                                    reduce_dtype=reduce_dtype,
                                    bucket_view=parameters_as_bucket_view,
                                    chunk_bytes=int((sync_chunk_mb or 16) * 2**20))
        self._optimizer_class, self._defaults = optimizer_class, defaults
        self._local = self._make_local(self.mode.local_groups(self.param_groups), per_param=bool(overlap_with_ddp))
        self._consolidated: list[dict] | None = None
        self._backwards = 0  # backward passes through these params: with steps, where this rank is
        self._watch_backwards()
        self._ready = True

    # -- the plan, its mode and the local optimizer ----------------------------------------------

    @property
    def plan(self) -> Plan:
        """The `zero.Plan` this optimizer executes (with overlap_with_ddp, DDP's buckets' ownership)."""
        return self.mode.plan

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
            return self.optim.path
        name = f"{type(self.optim).__module__}.{type(self.optim).__name__}.step"
        return [Path(name, 1, f"a torch.optim class: foreach={g.get('foreach')}, fused={g.get('fused')}, as given")
                for g in self.optim.param_groups]

    @property
    def optim(self) -> Optimizer:
        """The local optimizer: over the params (or flat shards) this rank steps."""
        return self._local.optim

    @property
    def masters(self) -> Masters:
        """This rank's master copies (``masters.nbytes()``: what the plan's ``master_bytes`` predicts)."""
        return self._local.masters

    def _make_local(self, groups: list[dict], per_param: bool) -> LocalStep:
        masters = Masters(self.master_dtype)
        optim = make_local_optimizer(self._optimizer_class, masters.wrap(groups, self._frozen()), self._defaults,
                                     per_param=per_param)
        return LocalStep(optim, self.param_groups, masters)

    def _attach_to_ddp(self, bucket_cap_mb: float, shard_buckets: bool) -> None:
        """For `hook_with_zero_step`: own params by DDP's buckets (planned before the first backward)
        and step them inside the hook, with a local optimizer built for that ownership."""
        metas = param_metas(self.param_groups)
        plan = self.plan.with_partition(ddp_bucket_partition(metas, self.world_size, bucket_cap_mb, shard_buckets))
        self._local = self.mode.attach(plan, metas, lambda groups: self._make_local(groups, per_param=True),
                                       self.param_groups)

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
        new_group = (shapes, _settings(param_group))
        facts = [("the new group's number of params", len(shapes))]
        facts += [(f"the new group's param {j} (shape, dtype, requires_grad)", s) for j, s in enumerate(shapes)]
        facts += [(f"the new group's {key}", value) for key, value in sorted(_settings(param_group).items())]
        self._check_in("add_param_group", checksum(new_group), lambda: facts)()
        self.mode.check_extendable()
        old = self.plan
        super().add_param_group(param_group)
        self._all_params.extend(param_group["params"])
        metas = param_metas(self.param_groups)
        plan = make_plan(metas, self.world_size, old.strategy, old.weight, old.optimizer, old.alignment)
        if plan.partition.owner[:len(old.partition.owner)] != old.partition.owner:
            raise ValueError(f"strategy {old.strategy!r} moves existing params when a group is added; "
                             "use 'sorted_greedy' or 'greedy' with add_param_group")
        self.mode.extend(plan, self._all_params, metas, len(self.param_groups))
        self._local.add_group(self.mode.local_groups(self.param_groups)[-1], self._frozen())
        self._local.pull()

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
        Join.notify_join_context(self)
        self._local.scaling = self._scaling()
        try:
            return self.mode.step(self._local, closure, kwargs, self._begin_step)
        finally:
            scaling, self._local.scaling = self._local.scaling, None
            self.agreed_found_inf = None if scaling is None else scaling.found_inf
            self._sharded_scaler = False  # set by ShardedGradScaler for its own step only

    def _scaling(self) -> Scaling | None:
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return None
        if not self.mode.scaler_sees_grads and not getattr(self, "_sharded_scaler", False):
            raise ValueError("torch.amp.GradScaler checks each rank's own gradients, but with "
                             "reduce_scatter_grads=True a rank steps the reduced shards of everyone's: the ranks' "
                             "loss scales would differ. Use zero.backends.ShardedGradScaler, whose scale follows the "
                             "step's agreed check")
        return Scaling(getattr(self, "grad_scale", None), found_inf)

    def _begin_step(self) -> Callable[[], None]:
        """What every mode that steps here does first: check the params, start the ranks' check-in,
        hand the groups' settings to the local optimizer. Returns the check-in's ``verify``."""
        if self.mode.trainability_changed():
            self.mode.retrain(param_metas(self.param_groups))
            self._local.masters.adopt(self.optim, self._frozen())
        self.mode.storage.check()
        verify = self._check_in("step")
        self._local.push()
        return verify

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; with ``reduce_scatter_grads`` the grads stay views of the flat gradient
        buffers, zeroed in place (a fresh grad would be copied into them by the next backward)."""
        self.mode.zero_grad(lambda: super(ZeroRedundancyOptimizer, self).zero_grad(set_to_none))

    def no_sync(self):
        """With ``reduce_scatter_grads``: backward passes inside only accumulate (as ``DDP.no_sync``);
        the first backward after it reduces the sum."""
        return self.mode.no_sync()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the state onto rank ``to`` (call on all ranks).

        Shards move as raw tensors, rank by rank, point to point to ``to``, and are kept in CPU
        memory there; no other rank receives anything.
        """
        comm_rank = check_rank(to, self.world_size, "to")
        self._check_in("consolidate_state_dict", to)()  # a rank that skipped a step fails here, by name
        self._local.push()
        mine = self._local.state_dict()
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
        return self.mode.to_global(self._consolidated, self.param_groups, self._local.per_element_keys())

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Load a global state dict (ours at any world size, torch's, or a plain optimizer's)."""
        check_compatible(saved, self._all_params, [len(g["params"]) for g in self.param_groups])
        check_state_keys(saved, self.optim)
        # The local optimizer's own load_state_dict places each state tensor where it keeps it.
        self._local.load_state_dict(self.mode.to_local(saved, self._local.per_element_keys()))

    # -- Join (uneven inputs) --------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Shadow the step's collectives on ranks that ran out of inputs (see ``torch...Join``)."""
        return self.mode.join_hook(self.step)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def _watch_backwards(self) -> None:
        """Count backward passes; one that starts with no step since the last meets the other
        ranks first (`zero.backends.watch`): a rank that skipped step() raises here, by name,
        before its gradients' all-reduce pairs with the others' step."""
        trainable = [p for p in self._all_params if p.requires_grad]
        if comm.group_size(self.process_group) == 1 or not trainable:
            return
        me = weakref.ref(self)

        def started(_grad: Any) -> None:
            opt = me()
            if opt is not None:
                opt._backward_started()

        handle = torch.autograd.graph.register_multi_grad_hook(trainable, started, mode="any")
        weakref.finalize(self, handle.remove)

    def _backward_started(self) -> None:
        done, self._backwards = self._backwards, self._backwards + 1
        if done <= self._local.steps:  # a step followed the last backward pass: the common case, nothing to check
            return
        joined = getattr(self, "_join_config", None) is not None and self._join_config.enable
        watch = watch_of(self.process_group)
        if watch is not None and not joined:  # accumulating, or a step was skipped
            watch.meet(Place("backward", self._local.steps, self._backwards))

    def _check_in(self, what: str, argument: int = 0, argument_facts: Callable[[], list] | None = None):
        """Start the check that every rank is in the same call on the same optimizer (see `comm.check_in`)."""
        groups = [(len(g["params"]), _settings(g)) for g in self.param_groups]
        fields = {"steps taken": self._local.steps,
                  "param groups (sizes and settings such as lr)": checksum(groups),
                  "plan (params, groups, placement)": int(self.plan.fingerprint[:15], 16),
                  "trainable params (requires_grad)": checksum(self.mode.trainable),
                  "the call's argument (to=, or the new group)": argument}
        facts = {"param groups (sizes and settings such as lr)": self._group_facts,
                 "plan (params, groups, placement)": lambda: plan_facts(self.plan),
                 "trainable params (requires_grad)": self._trainable_facts}
        if argument_facts is not None:
            facts["the call's argument (to=, or the new group)"] = argument_facts
        place = Place(what, self._local.steps, self._backwards)
        return comm.check_in(what, fields, self.process_group, self._comm_device(), facts, place)

    def _group_facts(self) -> list[tuple[str, Any]]:
        facts: list[tuple[str, Any]] = [("the number of param groups", len(self.param_groups))]
        for k, g in enumerate(self.param_groups):
            facts.append((f"param group {k}'s number of params", len(g["params"])))
            facts += [(f"param group {k}'s {key}", value) for key, value in sorted(_settings(g).items())]
        return facts

    def _trainable_facts(self) -> list[tuple[str, Any]]:
        names = [m.name for m in self.plan.metas]
        return [(f"param {i} ({name})'s requires_grad", flag)
                for i, (name, flag) in enumerate(zip(names, self.mode.trainable))]

    def _frozen(self) -> set[int]:
        return {id(p) for p in self._all_params if not p.requires_grad}

    def _comm_device(self) -> torch.device:
        return comm.device_for(self.process_group, self._default_device)


def _default_plan(metas: list[ParamMeta], world_size: int, strategy: str | None,
                  master_dtype: torch.dtype | None) -> Plan:
    master = None if master_dtype is None else str(master_dtype).removeprefix("torch.")
    if strategy == "flat":
        return make_plan(metas, world_size, "flat", bucket_numel=FLAT_BUCKET_NUMEL, master_dtype=master)
    return make_plan(metas, world_size, strategy or "sorted_greedy", master_dtype=master)


def _master_dtype_of(plan: Plan, master_dtype: torch.dtype | None) -> torch.dtype | None:
    """The master dtype the run steps in: the plan's (which counted the masters' bytes); the argument
    must say the same."""
    planned = resolve_dtype(plan.master_dtype, "plan.master_dtype")
    if master_dtype is not None and planned != master_dtype:
        raise ValueError(f"master_dtype={master_dtype} but the plan was made with master_dtype={plan.master_dtype!r}: "
                         f"make the plan with zero.make_plan(..., master_dtype={str(master_dtype)[6:]!r}), whose "
                         "per-rank bytes then count the masters, or drop the argument")
    return planned


def _warn_fp16(metas: list[ParamMeta], master_dtype: torch.dtype | None) -> None:
    fp16 = [m.name for m in metas if m.requires_grad and m.dtype == "float16"]
    if fp16:
        warnings.warn(f"{len(fp16)} trainable params are float16 (first: {fp16[0]}): their gradients overflow "
                      "without loss scaling, and the step then writes inf/nan silently. Drive step() with "
                      "torch.amp.GradScaler (zero.backends.ShardedGradScaler with reduce_scatter_grads=True)"
                      + ("" if master_dtype else ", and consider master_dtype=torch.float32"), stacklevel=3)


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


def _settings(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _cpu_copy(tree: Any) -> Any:
    return optree.tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x,
                           tree, none_is_leaf=True)
