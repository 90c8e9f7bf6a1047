"""Hybrid plans: a flat plan that keeps some params whole, each on one owner.

Element-level shards suit element-wise rules. A rule that reads a whole tensor at once
(Muon's Newton-Schulz, Adafactor's factored moments, SM3's covers) cannot step a piece of one,
so a hybrid plan gives each such param to one rank whole (balanced by the plan's weight, as a
whole-param plan would) and packs the rest into flat buffers as a flat plan would. Each rank
then steps its whole params and its shards with one local optimizer, and both are synced.

A hybrid rather than gathering each such tensor to a compute owner and scattering its update
back: the factored rules keep state per tensor (a row and a column mean), which has no element
pieces to leave on the ranks that hold the tensor's shards.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from zero.plans.accounting import Weight, weights
from zero.plans.cost import RankCost, flat_costs, partition_costs
from zero.plans.costs import RuleCost
from zero.plans.layout import FlatLayout, flat_layout
from zero.plans.meta import ParamMeta
from zero.plans.partition import Partition, partition

__all__ = ["Whole", "resolve_whole", "split_by_heads", "hybrid_placement", "flat_part"]

Whole = Collection[str] | Callable[[ParamMeta], bool] | None


def resolve_whole(metas: Sequence[ParamMeta], whole: Whole, spec: RuleCost) -> tuple[int, ...]:
    """The indices of the trainable params to keep whole: ``whole`` names them or is a test of a
    `ParamMeta`; ``None``: what the optimizer needs whole (Muon's matrices), else none.

    Which params a rule needs whole can depend on more than metadata (Muon's dimension numbers
    route by name), so the step checks it: a rule handed pieces of a tensor it needs whole is a
    ``ValueError`` naming the param (`zero.functional.sharding.whole_tensors`)."""
    if whole is None:
        return tuple(i for i, m in enumerate(metas) if spec.whole(m))
    if callable(whole):
        return tuple(i for i, m in enumerate(metas) if m.requires_grad and _test(whole, m))
    return tuple(_named(metas, whole))


def split_by_heads(metas: Sequence[ParamMeta], keep: tuple[int, ...], spec: RuleCost
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``keep`` parted into the params kept whole and those cut at head edges instead: the ones
    the rule steps head by head along their first axis (`RuleCost.head_block`: per-head Muon;
    8-bit Muon's codes lie in blocks of whole matrices, so it has none)."""
    cut = tuple(i for i in keep if spec.head_block(metas[i]) and not spec.block_for(metas[i]))
    taken = set(cut)
    return tuple(i for i in keep if i not in taken), cut


def _test(whole: Callable[[ParamMeta], bool], meta: ParamMeta) -> bool:
    answer = whole(meta)
    if not isinstance(answer, bool):
        raise TypeError(f"whole({meta.name!r}) returned a {type(answer).__name__}; it must return a bool")
    return answer


def _named(metas: Sequence[ParamMeta], names: Collection[str]) -> list[int]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"whole must be param names (a list of str), a function of a ParamMeta or None, got {names!r}")
    index: dict[str, int] = {}
    for i, m in enumerate(metas):
        if m.name in index:
            raise ValueError(f"two params are named {m.name!r}: whole= cannot pick by name; pass a function")
        index[m.name] = i
    unknown = [n for n in names if n not in index]
    if unknown:
        raise ValueError(f"whole names params {unknown} that the model does not have")
    frozen = [n for n in names if not metas[index[n]].requires_grad]
    if frozen:
        raise ValueError(f"whole names frozen params {frozen}: nothing steps them")
    return sorted(index[n] for n in set(names))


def _only(metas: Sequence[ParamMeta], indices: Collection[int], keep: bool) -> list[ParamMeta]:
    """``metas`` with the params outside (``keep=True``) or inside (False) ``indices`` frozen."""
    return [m if (i in indices) == keep or not m.requires_grad else m._replace(requires_grad=False)
            for i, m in enumerate(metas)]


def hybrid_placement(metas: Sequence[ParamMeta], keep: tuple[int, ...], world_size: int, weight: Weight,
                     spec: RuleCost, alignment: int, bucket_numel: int | None, master_dtype: str | None,
                     cut: tuple[int, ...] = ()) -> tuple[Partition, FlatLayout, tuple[RankCost, ...], float, float]:
    """The whole params' partition (``"balanced"`` by ``weight``; owner -1 for the others), the
    flat layout of the rest, each rank's costs summed over both, and the mean and best possible
    load (loads in ``weight``'s unit: a flat shard counts its elements, or its bytes for
    ``"state_bytes"``). The params in ``cut`` go to head buffers (`zero.plans.layout.flat_layout`'s
    ``head_of``), each rank holding whole heads of them; under ``"step_flops"`` a rank's load
    counts its heads' share of their work."""
    chosen = set(keep)
    sub = [metas[i] for i in keep]
    part = partition(sub, world_size, "balanced", weight, spec, master_dtype=master_dtype)
    owner = [-1] * len(metas)
    for k, i in enumerate(keep):
        owner[i] = part.owner[k]
    order = tuple(tuple(keep[k] for k in o) for o in part.order)
    part = Partition(world_size, part.strategy, part.weight, tuple(owner), order, part.loads)
    flat, flat_ranks, head_loads = flat_part(_only(metas, chosen, keep=False), world_size, weight, spec, alignment,
                                             bucket_numel, master_dtype, cut, metas)
    whole_ranks = partition_costs(_only(metas, chosen, keep=True), part, spec, master_dtype)
    ranks = tuple(_merged(f, w, w.load + _flat_load(f, weight) + h)
                  for f, w, h in zip(flat_ranks, whole_ranks, head_loads))
    mean = sum(r.load for r in ranks) / world_size
    return part, flat, ranks, mean, max(max(weights(sub, weight, spec, master_dtype)), mean)


def flat_part(metas: Sequence[ParamMeta], world_size: int, weight: Weight, spec: RuleCost, alignment: int,
              bucket_numel: int | None, master_dtype: str | None, cut: tuple[int, ...] = (),
              every: Sequence[ParamMeta] | None = None) -> tuple[FlatLayout, tuple[RankCost, ...], list[int]]:
    """The flat layout of ``metas``' trainable params (those in ``cut`` in head buffers), each
    rank's costs of it (over ``every`` param, the frozen ones too) and what each rank's whole
    heads add to its load (`_head_loads`)."""
    heads = {id(metas[i]) for i in cut}
    flat = flat_layout(metas, world_size, alignment, bucket_numel, spec.block_for,
                       (lambda m: spec.head_block(m) if id(m) in heads else 0) if heads else None)
    every = metas if every is None else every
    return flat, flat_costs(every, flat, spec, master_dtype), _head_loads(every, flat, weight, spec, master_dtype)


def _head_loads(metas: Sequence[ParamMeta], flat: FlatLayout, weight: Weight, spec: RuleCost,
                master_dtype: str | None) -> list[int]:
    """Under ``"step_flops"``, what each rank's whole heads add to its load beyond their elements
    (a flat shard's load): their share of their params' work (each head of a param costs alike)."""
    out = [0] * flat.world_size
    if weight != "step_flops":
        return out
    for b in flat.buffers:
        if b.head:
            ws = weights([metas[i] for i in b.params], weight, spec, master_dtype)
            for w, i, segs in zip(ws, b.params, b.segments):
                for s in segs:
                    out[s.rank] += w * (s.end - s.start) // metas[i].numel - (s.end - s.start)
    return out


def _flat_load(rank: RankCost, weight: Weight) -> int:
    return rank.state_bytes + rank.master_bytes if weight == "state_bytes" else rank.load


def _merged(f: RankCost, w: RankCost, load: int) -> RankCost:
    """One rank's costs: its flat shards' (``f``, which counts the replicated params and grads)
    and its whole params' (``w``)."""
    add = lambda a, b: (a[0] + b[0], a[1] + b[1])
    return RankCost(f.rank, f.params + w.params, f.numel + w.numel, load, f.param_bytes, f.grad_bytes,
                    f.state_bytes + w.state_bytes, f.padding_bytes, add(f.broadcast_bytes, w.broadcast_bytes),
                    add(f.all_gather_bytes, w.all_gather_bytes), f.master_bytes + w.master_bytes,
                    f.grad_shard_bytes + w.grad_shard_bytes)
