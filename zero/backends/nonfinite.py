"""Gradients that hold NaN or inf: found where they appear, named, and warned of, skipped or raised.

One NaN in one param's gradient on one rank reaches every param of every rank within a step (the
reduction spreads it to every rank, Adam's moments keep it). `ZeroRedundancyOptimizer(...,
nonfinite=)` says what a step does then:

- ``"warn"`` (the default): step as usual, and warn, once per step that has them;
- ``"skip"``: skip the step on every rank together (no param, moment or count moves), and warn;
- ``"raise"``: raise ``FloatingPointError`` on every rank, before anything is stepped.

Each names the step, the params (by name) and the ranks where the values appeared: where zero
reduces the gradients itself (``reduce_scatter_grads=True``) each rank checks its own gradients
before the reduction, so the ranks named are the ones that made them; under DDP the gradients a
rank gets are already averaged over every rank, so the ranks named are the ones whose part of the
model holds them. The check costs one pass over the gradients a rank checks (its own, or its part
after DDP) and no collective of its own: each rank's flag rides in the step's check-in
(`zero.backends.consistency`). Only when some rank flags do the ranks exchange the params' names.
A step driven by a loss scaler (``torch.amp.GradScaler``) is the scaler's to skip: not checked here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zero.backends import comm

__all__ = ["POLICIES", "NonFinite", "all_finite", "l1_norm", "message", "where"]

POLICIES = ("warn", "skip", "raise")


def l1_norm(x: torch.Tensor) -> torch.Tensor:
    """``sum |x|``: NaN or inf exactly when ``x`` holds one (16-bit values summed in float32, so
    that a sum of finite ones does not overflow)."""
    return torch.linalg.vector_norm(x, 1, dtype=torch.float32 if x.dtype in _SIXTEEN else None)


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite (one pass over them, one sync)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    norms = [n for dtype, ts in by_dtype.items()
             for n in torch._foreach_norm(ts, 1, dtype=torch.float32 if dtype in _SIXTEEN else None)]
    return bool(torch.isfinite(torch.stack([n.double().cpu() for n in norms]).sum()))


_SIXTEEN = (torch.float16, torch.bfloat16)


class NonFinite:
    """A sharded optimizer's handling of non-finite gradients (see the module)."""

    def __init__(self, policy: Any, overlap_with_ddp: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"nonfinite must be one of {POLICIES}, got {policy!r}")
        if policy == "skip" and overlap_with_ddp:
            raise ValueError("nonfinite='skip' cannot be honoured with overlap_with_ddp=True: each DDP bucket is "
                             "stepped inside backward as it arrives, before a later one can be checked; use "
                             "nonfinite='raise' (raised at the end of backward) or overlap_with_ddp=False")
        self.policy = policy
        self.skipped = 0  # steps skipped for them (``"skip"``)

    def verifying(self, verify: Callable[[], list[list[int]]], mode: Any, state: Any) -> Callable[[], None]:
        """The check-in's ``verify`` for a step: with ``"warn"`` left to run after the local step
        (its latency hidden behind it), warning then; with ``"skip"`` and ``"raise"`` run now,
        before anything is stepped (``state.skipping`` then says whether to step)."""
        step, local = state.steps + 1, mode.gradients.checks_local
        state.skipping = False
        if self.policy == "warn":
            def then() -> None:
                self.settle(verify(), mode, step, local)
            return then
        state.skipping = self.settle(verify(), mode, step, local)
        return lambda: None

    def flag(self, mode: Any, scaled: bool) -> int:
        """This rank's flag for the check-in: 1 when the gradients it checks hold NaN or inf."""
        # the scaler's to skip; a simulated rank's values are not there
        if scaled or comm.is_fake(mode.state.process_group):
            return 0
        return int(mode.gradients.local_nonfinite())

    def settle(self, flags: Sequence[Sequence[int]], mode: Any, step: int, local: bool) -> bool:
        """Every rank's flags (from the check-in): ``False`` when none flagged; otherwise the ranks
        exchange the params' names, then warn (``True`` for ``"skip"``: skip the step) or raise.
        Call on every rank alike."""
        ranks = [r for r, row in enumerate(flags) if row and row[0]]
        if not ranks:
            return False
        mine = mode.gradients.nonfinite_params()
        everyone = comm.all_gather_object(mine, mode.state.process_group)
        names = [mode.plan.metas[i].name for i in sorted({i for got in everyone for i in got})]
        return self.report(message(step, names, where(ranks, local), self.policy))

    def report(self, text: str) -> bool:
        """Raise, or warn (then ``True`` for ``"skip"``)."""
        if self.policy == "raise":
            raise FloatingPointError(text)
        warnings.warn(text, RuntimeWarning, stacklevel=2)
        self.skipped += self.policy == "skip"
        return self.policy == "skip"


def message(step: int, names: list[str], where: str, policy: str) -> str:
    """What a warning or an error says of a step with non-finite gradients (see `NonFinite`)."""
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") if names else \
        "(none of them by itself: values that overflowed only when summed over the ranks)"
    then = {"warn": "stepped anyway (nonfinite='warn'; 'skip' skips such a step on every rank, 'raise' raises)",
            "skip": "the step is skipped on every rank (nonfinite='skip')",
            "raise": "nothing was stepped (nonfinite='raise')"}[policy]
    return f"step {step}: gradients with NaN or inf in {shown}, {where}: {then}"


def where(ranks: list[int] | None, local: bool) -> str:
    listed = ", ".join(map(str, ranks or ()))
    if local:
        return f"first seen in the gradients of rank {listed}, before their reduction"
    after = "found after DDP's all-reduce (every rank then holds them: the rank that made them cannot be told)"
    return after if ranks is None else f"{after} in the part of the model rank {listed} steps"
