"""`ZeroExecutor`: where a `ZeroRedundancyOptimizer`'s state lives, for torch's contract.

The face (`zero.functional.adapters.face.OptimizerFace`) keeps torch's ``state``,
``state_dict`` and ``load_state_dict`` and starts each step (the ranks' check-in, the policy on
NaN and inf); this answers its questions for a ZeRO rank: the check-in over the process group
(`zero.backends.consistency.OptimizerChecks`), the gradients the rank's mode checks, and what it holds, as the pieces
`zero.backends.checkpoint.dcp_pieces` makes of its `RankState`: the whole state of a param it
owns, a ``ShardedTensor`` of the elements a flat plan gives it, masters under ``"master"``, and
nothing for a param another rank holds. Loading takes the same pieces back, or whole tensors of a
param's shape, which each rank cuts as its plan says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from zero.backends import comm
from zero.backends.checkpoint.dcp_pieces import functional_entries, load_functional, load_torch, torch_entries
from zero.backends.consistency import OptimizerChecks
from zero.backends.local_optimizer import is_functional
from zero.backends.nonfinite import where
from zero.backends.rank_state import RankState

__all__ = ["ZeroExecutor"]


class ZeroExecutor:
    """One ZeRO rank: its state (its `RankState`) as torch's per-param entries, and the step's
    guard (`zero.functional.adapters.nonfinite.StepGuard`) over its mode and checks."""

    def __init__(self, state: RankState, mode: Any, checks: OptimizerChecks):
        self.state, self.mode, self.checks = state, mode, checks

    # -- the step's guard --------------------------------------------------------------------

    def local_nonfinite(self) -> bool:
        # (a simulated rank's values are not there)
        return not comm.is_fake(self.state.process_group) and bool(self.mode.gradients.local_nonfinite())

    def check_in(self, flag: int) -> Callable[[], list[list[int]]]:
        return self.checks.check_in("step", carried=(flag,))  # each rank's flag rides in the check-in

    def flagged_names(self) -> list[str]:
        everyone = comm.all_gather_object(self.mode.gradients.nonfinite_params(), self.state.process_group)
        return [self.state.plan.metas[i].name for i in sorted({i for got in everyone for i in got})]

    def where(self, ranks: list[int]) -> str:
        return where(ranks, self.mode.gradients.checks_local)

    # -- the state ---------------------------------------------------------------------------

    @property
    def layout_key(self) -> str:
        plan = self.state.plan
        return f"rank {self.state.rank} of ZeRO plan {plan.fingerprint[:16]} ({plan.world_size} ranks)"

    def entries(self, saving: bool = True) -> Iterator[tuple[int, str, Any]]:
        state = self.state
        if state.optim is None:  # overlap_with_ddp before DDP's buckets are known: no state anywhere yet
            raise ValueError("the optimizer state does not exist yet: with overlap_with_ddp it is made when DDP's "
                             "buckets are known (its first backward pass); read or save it after a step")
        state.push()
        listed = functional_entries if is_functional(state.optim) else torch_entries
        for held, key, value in listed(state, saving):
            yield held.param, key, value

    def load(self, entries: dict[int, dict[str, Any]], groups: list[dict]) -> None:
        state = self.state
        names = self.labels()
        sd = {"state": {names[i]: st for i, st in entries.items()},
              "param_groups": [{**g, "params": []} for g in groups]}
        (load_functional if is_functional(state.optim) else load_torch)(state, names, sd)

    def labels(self) -> list[str]:
        """Each param as messages (and the loaders' keys) name it: by name, else by position."""
        out = []
        for g in self.state.param_groups:
            names = g.get("param_names")
            out += list(names) if names else [f"param {len(out) + j}" for j in range(len(g["params"]))]
        return out if len(set(out)) == len(out) else [f"param {i} ({n})" for i, n in enumerate(out)]
