"""Precision: master weights, loss scaling, and the dtypes a run steps and reduces in.

**Master weights.** The local optimizer steps higher-precision copies of what this rank steps.

With ``master_dtype=torch.float32`` and bf16 params, each tensor the local optimizer would step
(an owned param, a flat shard, a DDP-overlap stand-in) is replaced by an fp32 copy, its master,
made once. The optimizer's state is then created in fp32 too. Each step casts the gradients up
into the masters' ``.grad``, steps the masters, and writes them back rounded to the param dtype
into the tensors the mode syncs, so the all-gather moves 16-bit values. A tensor already in the
master dtype is stepped as it is (no copy).

Masters travel in the optimizer's state dict under `MASTER_KEY`, shaped as the param (whole
plans) or as the shard (locally), so consolidation and resharding carry them like any per-element
state. A state dict without them (torch's, or saved without masters) starts the masters from the
params.

**Loss scaling.** ``torch.amp.GradScaler`` hands the step its scale and found-inf flag; the step
unscales what it steps and agrees with every rank whether to skip (`Scaling`). With gradients
reduce-scattered a rank sees only its shards' reduced gradients, so the scaler must follow that
agreed flag: `ShardedGradScaler` does (fairscale's ``ShardedGradScaler`` is the anchor).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from zero.functional import sharding
from zero.functional.adapters.state_names import MASTER_KEY  # the state dict key of a param's master copy
from zero.plans.meta import ParamMeta

__all__ = ["MASTER_KEY", "Masters", "Scaling", "ShardedGradScaler", "resolve_dtype", "planned_master_dtype",
           "warn_fp16", "scaling_of"]

logger = logging.getLogger(__name__)



def resolve_dtype(value: Any, name: str) -> torch.dtype | None:
    """``None``, a float ``torch.dtype`` or its name (``"float32"``) as a dtype; else a clear error."""
    if value is None:
        return None
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name} must be a float dtype such as torch.float32, got {value!r}")
        value = dtype
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype such as torch.float32, got {type(value).__name__} {value!r}")
    if not value.is_floating_point:
        raise ValueError(f"{name} must be a float dtype such as torch.float32, got {value}")
    return value


class Masters:
    """The masters of one local optimizer: ``master -> stepped`` for every tensor narrower than ``dtype``."""

    def __init__(self, dtype: torch.dtype | None, check: bool = True):
        self.dtype, self.check = dtype, check  # check: whether tensors changed outside (see _retake_changed)
        self._pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(master) -> (master, its tensor)
        self._keyed: tuple[sharding.Sharding, int, sharding.Sharding] | None = None  # (given, masters, keyed)
        self._warned = False

    def wrap(self, groups: list[dict], frozen: set[int]) -> list[dict]:
        """The groups with each tensor replaced by its master (made here, from the tensor's values),
        but the ``frozen`` ones (by ``id``): the plan counts no master for a frozen param."""
        return [{**g, "params": [self._master(p, frozen) for p in g["params"]]} for g in groups]

    def adopt(self, optim: torch.optim.Optimizer, frozen: set[int]) -> None:
        """Give a master to each param unfrozen since it was wrapped (it has no state yet)."""
        for group in optim.param_groups:
            group["params"] = [self._master(p, frozen) if self.stepped(p) is None and not optim.state.get(p) else p
                               for p in group["params"]]

    def _master(self, t: torch.Tensor, frozen: set[int]) -> torch.Tensor:
        if self.dtype is None or t.dtype == self.dtype or id(t) in frozen:
            return t
        master = t.detach().to(self.dtype, copy=True)
        self._pairs[id(master)] = (master, t)
        return master

    def stepped(self, master: torch.Tensor) -> torch.Tensor | None:
        """The tensor ``master`` is the master of (None: it is stepped itself)."""
        pair = self._pairs.get(id(master))
        return None if pair is None else pair[1]

    def grads_in(self, optim: torch.optim.Optimizer,
                 wide: dict[int, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Give each master its tensor's gradient, cast up (or its gradient in ``wide``, by
        ``id(tensor)``, kept in the master dtype); the (master, stepped) pairs that got one."""
        pairs = []
        for master in _params(optim):
            stepped = self.stepped(master)
            if stepped is None:
                continue
            grad = wide.get(id(stepped), stepped.grad)
            master.grad = None if grad is None else grad.to(self.dtype)
            if grad is not None:
                pairs.append((master, stepped))
        if self.check:
            self._retake_changed(pairs)
        return pairs

    @torch.no_grad()
    def _retake_changed(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A tensor no longer equal to its master rounded to its dtype was changed outside the
        optimizer since the master was made or last written back (``model.load_state_dict`` of
        pretrained weights after building the optimizer, ``torch.nn.init``, ``p.data.copy_``):
        its master is taken from it again, so the step starts from what the model holds instead
        of writing the old values back over it. Compared exactly, every step, on what this rank
        steps (a cast and a compare: ``.data`` writes bypass autograd's version counters)."""
        changed = [(m, s) for m, s in pairs if not torch.equal(m.to(s.dtype), s)]
        if not changed:
            return
        torch._foreach_copy_([m for m, _ in changed], [s for _, s in changed])
        if not self._warned:
            self._warned = True
            warnings.warn(f"{len(changed)} of the params this rank steps changed outside the optimizer since "
                          f"their {self.dtype} masters were made (load_state_dict, nn.init, .data writes ...): "
                          "the masters are taken from them again. Said once; it is done at every step.",
                          stacklevel=4)

    @staticmethod
    @torch.no_grad()
    def write_back(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Round the stepped masters into their tensors (what the mode's sync then moves)."""
        if pairs:
            torch._foreach_copy_([s for _, s in pairs], [m for m, _ in pairs])

    def every_pair(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every (master, stepped) pair, to round every master into its tensor (``write_back``)
        after a change outside a step (`ZeroRedundancyOptimizer.eval`)."""
        return list(self._pairs.values())

    @staticmethod
    def release(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for master, _ in pairs:
            master.grad = None

    def keyed(self, given: sharding.Sharding) -> sharding.Sharding:
        """``given`` (keyed by the stepped tensors) keyed by their masters too, whole tensors in the
        master dtype: a global norm is then the one the masters' gradients have."""
        if not self._pairs:
            return given
        # Held by reference, not id: a mode's sharding rebuilt after retrain could reuse a freed id.
        if self._keyed is None or self._keyed[0] is not given or self._keyed[1] != len(self._pairs):
            pieces = dict(given.pieces)
            pieces.update({k: given.pieces[id(s)] for k, (_, s) in self._pairs.items() if id(s) in given.pieces})
            dtypes = tuple(torch.promote_types(d, self.dtype) for d in given.dtypes)
            self._keyed = (given, len(self._pairs), dataclasses.replace(given, pieces=pieces, dtypes=dtypes))
        return self._keyed[2]

    def nbytes(self) -> int:
        """Bytes of master copies held (what the plan's ``master_bytes`` predicts)."""
        return sum(m.nbytes for m, _ in self._pairs.values())

    # -- state dicts -----------------------------------------------------------------------------

    def add_to(self, sd: dict, optim: torch.optim.Optimizer, always: bool) -> dict:
        """``sd`` (the local optimizer's ``state_dict()``) with each master under `MASTER_KEY` of its
        param's state: where the param has state, or for every master when ``always``."""
        if not self._pairs:
            return sd
        state = dict(sd["state"])
        for j, p in enumerate(_params(optim)):
            if self.stepped(p) is not None and (always or j in state):
                state[j] = {**state.get(j, {}), MASTER_KEY: p}
        return {**sd, "state": state}

    @torch.no_grad()
    def take_from(self, local: dict, optim: torch.optim.Optimizer) -> dict:
        """Load the masters out of a local state dict; return it without them.

        A master with no saved copy starts again from its param (a checkpoint saved without
        masters); a saved copy where this run steps the param itself is dropped, with a warning.
        """
        state = {}
        dropped = 0
        for j, st in local["state"].items():
            state[j] = {k: v for k, v in st.items() if k != MASTER_KEY}
            dropped += MASTER_KEY in st
        for j, p in enumerate(_params(optim)):
            stepped = self.stepped(p)
            saved = local["state"].get(j, {}).get(MASTER_KEY)
            if stepped is not None:
                p.copy_(saved if saved is not None else stepped)
                dropped -= saved is not None
        if dropped:
            logger.warning("the state dict holds master copies of %d params that this optimizer steps without "
                           "masters (no master_dtype, or params already in it): they are not loaded", dropped)
        return {**local, "state": {j: st for j, st in state.items() if st}}


class Scaling:
    """A loss scale's part in one step (``torch.amp.GradScaler`` drives the optimizer with
    ``grad_scale`` and ``found_inf``): unscale the gradients the local optimizer steps, check them,
    and agree with every rank whether to skip.

    The check is over the gradients this rank steps (after their reduction, cast to the masters),
    so under ``reduce_scatter_grads`` a non-finite value in one rank's shard only is seen; one
    all-reduce of the flag makes every rank skip together. ``found_inf`` is the agreed flag after.
    """

    def __init__(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor):
        self.grad_scale, self.scaler_found_inf = grad_scale, found_inf
        self.found_inf: torch.Tensor | None = None

    @torch.no_grad()
    def unscale_and_agree(self, grads: list[torch.Tensor], reduce, device: torch.device) -> bool:
        """Unscale ``grads`` in place; True when every rank's gradients are finite (a collective)."""
        found = torch.zeros((), device=device)
        inv = torch.ones((), device=device) if self.grad_scale is None else \
            self.grad_scale.double().reciprocal().float().to(device)
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for (dev, _), same in by_kind.items():
            here = torch.zeros((), device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(same, here, inv.to(dev))
            found += here.to(device)
        found += torch.as_tensor(self.scaler_found_inf, dtype=found.dtype).to(device)
        self.found_inf = (reduce(found.reshape(1)) > 0).float().reshape(())
        return not bool(self.found_inf)


def _params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optim.param_groups for p in g["params"]]


def planned_master_dtype(plan_master_dtype: str | None, master_dtype: torch.dtype | None) -> torch.dtype | None:
    """The master dtype a run steps in: the plan's (which counted the masters' bytes); the
    ``master_dtype`` argument, when given, must say the same."""
    planned = resolve_dtype(plan_master_dtype, "plan.master_dtype")
    if master_dtype is not None and planned != master_dtype:
        raise ValueError(f"master_dtype={master_dtype} but the plan was made with master_dtype={plan_master_dtype!r}: "
                         f"make the plan with zero.make_plan(..., master_dtype={str(master_dtype)[6:]!r}), whose "
                         "per-rank bytes then count the masters, or drop the argument")
    return planned


def warn_fp16(metas: Sequence[ParamMeta], master_dtype: torch.dtype | None) -> None:
    """Warn when trainable params are float16: without loss scaling their gradients overflow."""
    fp16 = [m.name for m in metas if m.requires_grad and m.dtype == "float16"]
    if fp16:
        warnings.warn(f"{len(fp16)} trainable params are float16 (first: {fp16[0]}): their gradients overflow "
                      "without loss scaling, and the step then writes inf/nan silently. Drive step() with "
                      "torch.amp.GradScaler (zero.backends.ShardedGradScaler with reduce_scatter_grads=True)"
                      + ("" if master_dtype else ", and consider master_dtype=torch.float32"), stacklevel=3)


def scaling_of(optimizer: torch.optim.Optimizer, scaler_sees_grads: bool, agreed: bool) -> Scaling | None:
    """The loss scale's part in this step: what ``torch.amp.GradScaler`` set on ``optimizer``
    (``grad_scale``, ``found_inf``), or None without a scaler. ``scaler_sees_grads``: the params'
    ``.grad`` are the gradients stepped (else a scaler must follow the step's agreed check:
    ``agreed``, set by `ShardedGradScaler`)."""
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is None:
        return None
    if not scaler_sees_grads and not agreed:
        raise ValueError("torch.amp.GradScaler checks each rank's own gradients, but with "
                         "reduce_scatter_grads=True a rank steps the reduced shards of everyone's: the ranks' "
                         "loss scales would differ. Use zero.backends.ShardedGradScaler, whose scale follows the "
                         "step's agreed check")
    return Scaling(getattr(optimizer, "grad_scale", None), found_inf)


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose loss scale agrees across the ranks of a sharded optimizer
    whose gradients are reduce-scattered; use it as torch's.

    torch's scaler decides whether a step overflowed from the gradients it sees on its own rank.
    With ``reduce_scatter_grads=True`` those are the rank's unreduced gradients, and an overflow
    may show only in another rank's shard of the sum: the ranks would grow and back off their
    scales apart. The optimizer's step already checks the reduced gradients it steps and agrees
    with every rank (one all-reduce of the flag); this scaler takes that agreed flag for its
    update. An optimizer without a ``rank_state`` (not zero's) gets torch's behaviour.
    """

    _unscaling = False  # inside unscale_: the gradients are unscaled now (to clip), not checked by the step

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """As torch's. With ``reduce_scatter_grads`` it unscales the averaged gradients the rank
        steps (waiting for their reductions), so that ``optimizer.clip_grad_norm_`` clips them."""
        self._unscaling = True
        try:
            super().unscale_(optimizer)
        finally:
            self._unscaling = False

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        if not _reduce_scattered(optimizer):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not self._unscaling:  # the step unscales and checks the reduced gradients; some may be in flight now
            return {found_inf.device: found_inf}
        found: dict[torch.device, torch.Tensor] = {}
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for _, g in optimizer.mode.held_grads():
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for (dev, _), grads in by_kind.items():
            flag = found.setdefault(dev, torch.zeros((), device=dev))
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(dev))
        return found or {found_inf.device: found_inf}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        state = getattr(optimizer, "rank_state", None)  # zero's sharded optimizers have one
        if state is None or not self.is_enabled():
            return super().step(optimizer, *args, **kwargs)
        with state.scaler_agrees():
            out = super().step(optimizer, *args, **kwargs)
        if state.agreed_found_inf is not None:  # the update that follows reads these
            for found in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                found.copy_(state.agreed_found_inf)
        return out


def _reduce_scattered(optimizer: torch.optim.Optimizer) -> bool:
    mode = getattr(optimizer, "mode", None) if hasattr(optimizer, "rank_state") else None
    return mode is not None and not mode.gradients.scaler_sees_grads

