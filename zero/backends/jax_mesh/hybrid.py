"""Hybrid plans on a mesh: each whole param stepped on its owner device only, the rest flat.

A hybrid plan (`zero.plans.hybrid`) keeps the params a rule reads whole (Muon's matrices,
Adafactor's factored or rescaled ones) on one owner each and packs the rest into flat buffers.
On a mesh the flat buffers run as in `executor`; the whole params run under ``shard_map``, where
each device takes the branch of a ``lax.switch`` on its position that steps its own params only.
A branch sees the params' tree with every other leaf replaced by ``optax.MaskedNode`` (as
``optax.masked`` hands its inner rule a subtree), so names, partitions and dimension numbers
still see the tree they were written for, and keeps the transformation's state for that subtree.

That state differs in shape from rank to rank, while a mesh array shards evenly, so each rank's
state leaves are laid end to end in `Rows`: one row per dtype, padded to the longest rank's.
Device ``r``'s slice of a row buffer is then exactly rank ``r``'s state. The updated whole
params leave the branches in rows too and are gathered once per dtype.

GSPMD, given Muon's state sharded, runs the Newton-Schulz iterations on every device with
collectives between them; here each matrix's iterations run once, on one device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from zero.plans.plan import Plan

__all__ = ["HybridState", "Rows", "WholeParams", "masked"]


class HybridState(NamedTuple):
    """A hybrid plan's state on a mesh.

    Fields:
        flat: the transformation's state over the plan's flat buffers (as `executor.init` gives
            for a flat plan), sharded.
        whole: one row buffer per dtype (`Rows`), sharded: device ``r``'s slice holds the leaves
            of ``tx.init`` of rank ``r``'s whole params.
    """

    flat: Any
    whole: tuple[jax.Array, ...]


def masked(tree: Any, keep: Sequence[int]) -> Any:
    """``tree`` with every leaf whose position is not in ``keep`` replaced by ``optax.MaskedNode``."""
    leaves, treedef = jax.tree.flatten(tree)
    kept = set(keep)
    return treedef.unflatten([x if i in kept else optax.MaskedNode() for i, x in enumerate(leaves)])


@dataclass(frozen=True)
class Rows:
    """Where each rank's leaves sit in a set of row buffers, one per dtype.

    ``slots[r][k]`` is ``(dtype index, start, size)`` of rank ``r``'s ``k``-th leaf within its
    row; every row is ``width[d]`` long (the longest rank's, at least 1), so buffer ``d`` is
    ``world * width[d]`` elements and device ``r`` holds ``[r * width[d], (r + 1) * width[d])``.
    """

    world: int
    dtypes: tuple[str, ...]
    width: tuple[int, ...]
    slots: tuple[tuple[tuple[int, int, int], ...], ...]

    @classmethod
    def of(cls, per_rank: Sequence[Sequence[Any]]) -> Rows:
        """The rows of ``per_rank[r]`` (arrays or ``ShapeDtypeStruct`` s), in their order."""
        dtypes = sorted({np.dtype(x.dtype).name for leaves in per_rank for x in leaves}) or ["float32"]
        width, slots = [1] * len(dtypes), []
        for leaves in per_rank:
            used, mine = [0] * len(dtypes), []
            for x in leaves:
                d, n = dtypes.index(np.dtype(x.dtype).name), int(np.prod(x.shape, dtype=np.int64))
                mine.append((d, used[d], n))
                used[d] += n
            width = [max(w, u) for w, u in zip(width, used)]
            slots.append(tuple(mine))
        return cls(len(per_rank), tuple(dtypes), tuple(width), tuple(slots))

    def shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(jax.ShapeDtypeStruct((self.world * w,), jnp.dtype(d)) for d, w in zip(self.dtypes, self.width))

    def pack(self, rank: int, leaves: Sequence[jax.Array], xp: Any = jnp) -> tuple[jax.Array, ...]:
        """Rank ``rank``'s row of each dtype, its leaves back to back and zeros after."""
        parts: list[list] = [[] for _ in self.dtypes]
        for (d, _, _), x in zip(self.slots[rank], leaves):
            parts[d].append(xp.ravel(x).astype(jnp.dtype(self.dtypes[d])))
        rows = []
        for d, (dtype, width) in enumerate(zip(self.dtypes, self.width)):
            used = sum(n for dd, _, n in self.slots[rank] if dd == d)
            rows.append(xp.concatenate(parts[d] + [xp.zeros(width - used, jnp.dtype(dtype))]))
        return tuple(rows)

    def unpack(self, rank: int, rows: Sequence[jax.Array], like: Sequence[Any]) -> list[jax.Array]:
        """Rank ``rank``'s leaves read out of its ``rows``, shaped as ``like``."""
        return [rows[d][s:s + n].reshape(x.shape) for (d, s, n), x in zip(self.slots[rank], like)]

    def nbytes(self, rank: int) -> int:
        """Bytes of rank ``rank``'s own leaves (its row less the padding)."""
        return sum(n * np.dtype(self.dtypes[d]).itemsize for d, _, n in self.slots[rank])


class WholeParams:
    """The whole-param half of a hybrid plan's step on a mesh, for one transformation and tree.

    Built from the params' abstract values: the owned params of each rank (`Plan.partition`),
    the rows their updated values and their state travel in, and each rank's state tree.
    """

    def __init__(self, tx: optax.GradientTransformation, plan: Plan, params: Any, mesh: Any, axis: str):
        self.tx, self.mesh, self.axis = tx, mesh, axis
        whole = set(plan.whole)
        # in tree order: a masked tree hands its leaves to the rule, and back, in that order
        self.owned = [tuple(sorted(i for i in plan.partition.params_of(r) if i in whole))
                      for r in range(plan.world_size)]
        leaves = jax.tree.leaves(params)
        self.params = Rows.of([[leaves[i] for i in mine] for mine in self.owned])
        states = [jax.eval_shape(tx.init, masked(params, mine)) for mine in self.owned]
        self.state_defs = [jax.tree.structure(s) for s in states]
        self.state_like = [jax.tree.leaves(s) for s in states]
        self.state = Rows.of(self.state_like)

    def _sharded(self, local: Callable, n_out: int) -> Callable:
        spec = PartitionSpec(self.axis)
        return jax.shard_map(local, mesh=self.mesh, in_specs=PartitionSpec(), out_specs=(spec,) * n_out,
                             check_vma=False)

    def init(self, params: Any) -> tuple[jax.Array, ...]:
        """Each device's row of its own params' ``tx.init``, from replicated params."""

        def branch(r):
            return lambda params: self.state.pack(r, jax.tree.leaves(self.tx.init(masked(params, self.owned[r]))))

        def local(params):
            return jax.lax.switch(jax.lax.axis_index(self.axis), [branch(r) for r in range(len(self.owned))], params)

        return self._sharded(local, len(self.state.dtypes))(params)

    def step(self, grads: Any, rows: tuple[jax.Array, ...], params: Any) -> tuple[list, tuple[jax.Array, ...]]:
        """The new whole params (leaves, gathered) and each device's new state rows."""
        world, n_state = len(self.owned), len(self.state.dtypes)

        def branch(r):
            def run(grads, params, rows):
                state = self.state_defs[r].unflatten(self.state.unpack(r, rows, self.state_like[r]))
                mine = masked(params, self.owned[r])
                updates, state = self.tx.update(masked(grads, self.owned[r]), state, mine)
                stepped = jax.tree.leaves(optax.apply_updates(mine, updates))
                return self.params.pack(r, stepped) + self.state.pack(r, jax.tree.leaves(state))
            return run

        def local(grads, params, rows):
            return jax.lax.switch(jax.lax.axis_index(self.axis), [branch(r) for r in range(world)], grads, params,
                                  rows)

        spec = PartitionSpec(self.axis)
        out = jax.shard_map(local, mesh=self.mesh, in_specs=(PartitionSpec(), PartitionSpec(), spec),
                            out_specs=(spec,) * (len(self.params.dtypes) + n_state), check_vma=False)(
            grads, params, rows)
        param_rows, state_rows = out[:len(self.params.dtypes)], tuple(out[len(self.params.dtypes):])
        replicated = jax.sharding.NamedSharding(self.mesh, PartitionSpec())
        gathered = [jax.lax.with_sharding_constraint(b, replicated) for b in param_rows]  # one all-gather a dtype
        return self._cut(gathered, jax.tree.leaves(params)), state_rows

    def _cut(self, gathered: Sequence[jax.Array], leaves: list) -> list:
        """``leaves`` with each whole param read out of its owner's row of the gathered buffers."""
        out = list(leaves)
        for r, mine in enumerate(self.owned):
            rows = [g[r * w:(r + 1) * w] for g, w in zip(gathered, self.params.width)]
            for i, x in zip(mine, self.params.unpack(r, rows, [leaves[i] for i in mine])):
                out[i] = x
        return out

    def nbytes(self) -> tuple[int, ...]:
        """Each rank's own state bytes (its row, less padding)."""
        return tuple(self.state.nbytes(r) for r in range(len(self.owned)))
