"""The attributes of torch's ``ZeroRedundancyOptimizer`` that code written against it reads.

torch's own tests set a joined rank's gradients through ``_all_params`` (in a ``JoinHook``), its
DDP hooks and users' scripts read ``global_rank``, ``initialized``, ``_param_to_rank``,
``_partition_parameters()`` and the index maps. `TorchNames` gives `ZeroRedundancyOptimizer`
those names, each read from the plan it executes (never a second record beside it). Where a
name's meaning does not exist under the plan (a flat plan splits params across ranks, so a param
has no one owner) reading it is a ``RuntimeError`` that says so, not a made-up answer.
"""

from __future__ import annotations

from typing import Any

import torch

from zero.backends import comm

__all__ = ["TorchNames", "TORCH_NAMES"]

# The names torch's class exposes that code in the wild reads (tests/backends/test_torch_names.py
# checks each against torch's class and ours).
TORCH_NAMES = ("optim", "param_groups", "state", "defaults", "process_group", "world_size", "rank", "global_rank",
               "parameters_as_bucket_view", "initialized", "_all_params", "_param_to_rank", "_partition_parameters",
               "_index_to_param", "_param_to_index", "_overlap_with_ddp")


class TorchNames:
    """torch's names over a `zero.backends.rank_state.RankState` (``self.rank_state``)."""

    rank_state: Any
    process_group: Any
    rank: int
    mode: Any

    @property
    def _all_params(self) -> tuple[torch.Tensor, ...]:
        """Every param, in ``param_groups`` order (torch's order): read-only, as a tuple."""
        return tuple(self.rank_state.params)

    @property
    def global_rank(self) -> int:
        """This rank's rank in the default group (``rank`` is within ``process_group``)."""
        return comm.global_rank(self.process_group, self.rank)

    @property
    def initialized(self) -> bool:
        """True once the constructor has finished (torch's flag; ``add_param_group`` reads it)."""
        return bool(getattr(self, "_ready", False))

    @property
    def _overlap_with_ddp(self) -> bool:
        """Whether the step runs inside DDP's comm hook (``overlap_with_ddp=True``)."""
        return bool(getattr(getattr(self, "mode", None), "overlaps_ddp", False))

    @property
    def _index_to_param(self) -> list[torch.Tensor]:
        return list(self.rank_state.params)

    @property
    def _param_to_index(self) -> dict[torch.Tensor, int]:
        return {p: i for i, p in enumerate(self.rank_state.params)}

    @property
    def _param_to_rank(self) -> dict[torch.Tensor, int]:
        """Each trainable param's owner (torch's map; frozen params have none)."""
        owner = self._owners("_param_to_rank")
        return {p: owner[i] for i, p in enumerate(self.rank_state.params) if owner[i] >= 0}

    def _partition_parameters(self, params_per_rank: Any = None) -> list[list[dict]]:
        """Per rank, the param groups it steps (each group's settings with that rank's params),
        as torch's method returns them; a partition of your own is the plan's job here."""
        if params_per_rank is not None:
            raise ValueError("zero's ZeroRedundancyOptimizer takes its partition from its plan: pass plan= (a "
                             "zero.Plan, e.g. zero.make_plan(..., strategy='contiguous')) instead of params_per_rank")
        owner = self._owners("_partition_parameters()")
        state, out = self.rank_state, []
        for r in range(state.world_size):
            groups, first = [], 0
            for g in state.param_groups:
                mine = [p for j, p in enumerate(g["params"]) if owner[first + j] == r]
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": mine})
                first += len(g["params"])
            out.append(groups)
        return out

    def _owners(self, name: str) -> tuple[int, ...]:
        plan = self.rank_state.plan
        if plan.partition is None or plan.flat is not None and not plan.hybrid:
            raise RuntimeError(f"{name} maps each param to the one rank that steps it, but this optimizer executes "
                               f"a {plan.strategy!r} plan, which splits params across ranks: read opt.plan.flat (or "
                               "opt.rank_state.holdings) for what each rank holds")
        if plan.hybrid:
            raise RuntimeError(f"{name} maps each param to one rank, but this hybrid plan keeps only "
                               f"{len(plan.whole)} params whole (opt.plan.partition.owner, -1 for the rest) and "
                               "splits the rest across ranks (opt.plan.flat)")
        return plan.partition.owner
