"""What a JAX mesh holds executing a plan: its arrays are sharded evenly, so a plan's uneven
rows are padded to the busiest rank's on every device (`mesh_state_bytes`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zero.plans.accounting import state_bytes
from zero.plans.costs import cost_of

if TYPE_CHECKING:
    from zero.plans.plan_fields import PlanFields as Plan  # the fields are all this module reads

__all__ = ["mesh_state_bytes"]


def mesh_state_bytes(plan: Plan) -> tuple[int, ...]:
    """The optimizer state each device of a JAX mesh holds executing ``plan``
    (`zero.backends.jax_mesh`), padding included. A mesh shards arrays evenly: a flat
    buffer's slice is its padded shard, and the rows of whole params (one per dtype) are each
    as long as the busiest rank's, on every device. ``plan.ranks[r].state_bytes`` counts rank
    ``r``'s own, as torch ranks hold it. Per-param scalars (torch's ``step``) are left out:
    Optax keeps one count, replicated. For an element-wise rule this is what
    `zero.backends.jax_mesh.state_bytes` measures; under a hybrid plan the rule's own scalars
    ride in the rows too (`zero.backends.jax_mesh.device_bytes` counts them from the rule)."""
    spec = cost_of(plan.optimizer)

    def own(i: int) -> int:
        m = plan.metas[i]
        return state_bytes(m, spec, plan.master_dtype) - spec.scalar_bytes if m.requires_grad else 0

    flat = 0
    for b in plan.flat.buffers if plan.flat is not None else ():
        flat += b.padded_numel // plan.world_size * (own(b.params[0]) // plan.metas[b.params[0]].numel)
    whole = plan.whole if plan.flat is not None else range(len(plan.metas))
    rows: dict[str, list[int]] = {}
    for i in whole:
        rows.setdefault(plan.metas[i].dtype, [0] * plan.world_size)[plan.partition.owner[i]] += own(i)
    return (flat + sum(max(r) for r in rows.values()),) * plan.world_size
