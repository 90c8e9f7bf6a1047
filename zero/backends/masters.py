"""Master weights: the local optimizer steps higher-precision copies of what this rank steps.

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
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from zero.functional import sharding

__all__ = ["MASTER_KEY", "Masters", "Scaling", "resolve_dtype"]

logger = logging.getLogger(__name__)

MASTER_KEY = "master"  # the state dict key of a param's master copy


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

    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype
        self._pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(master) -> (master, its tensor)
        self._rules: tuple[sharding.Sharding, int, sharding.Sharding] | None = None  # (given, masters, keyed)

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
        return pairs

    @staticmethod
    @torch.no_grad()
    def write_back(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Round the stepped masters into their tensors (what the mode's sync then moves)."""
        if pairs:
            torch._foreach_copy_([s for _, s in pairs], [m for m, _ in pairs])

    @staticmethod
    def release(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for master, _ in pairs:
            master.grad = None

    def rules(self, rules: sharding.Sharding) -> sharding.Sharding:
        """``rules`` (keyed by the stepped tensors) keyed by their masters too, whole tensors in the
        master dtype: a global norm is then the one the masters' gradients have."""
        if not self._pairs:
            return rules
        # Held by reference, not id: a mode's rules rebuilt after retrain could reuse a freed id.
        if self._rules is None or self._rules[0] is not rules or self._rules[1] != len(self._pairs):
            pieces = dict(rules.pieces)
            pieces.update({k: rules.pieces[id(s)] for k, (_, s) in self._pairs.items() if id(s) in rules.pieces})
            dtypes = tuple(torch.promote_types(d, self.dtype) for d in rules.dtypes)
            self._rules = (rules, len(self._pairs), dataclasses.replace(rules, pieces=pieces, dtypes=dtypes))
        return self._rules[2]

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
