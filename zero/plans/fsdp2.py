"""Plans for FSDP2's layout: what each rank holds of params ``fully_shard`` cut for it, which
params a rule steps whole on an owner, and what moves to and from the owners.

FSDP2 decides where params live: each rank keeps rows ``torch.chunk`` gives it along one dim
(``Shard(0)``, or the dim a ``shard_placement_fn`` picks), the last ranks fewer or none. A rule
steps a rank's piece of most params where it lies (element-wise work, sums over the pieces). A
param the rule needs whole (Muon's matrices, factored moments, low-bit blocks FSDP2 cuts between
ranks) is stepped by one owner: every rank sends the owner its piece of the param and its
gradient, the owner steps the whole tensor and sends each rank its piece back, in one exchange
per direction per dtype. Owners are balanced by the rule's step cost (`zero.plans.costs`), so no
rank holds every matrix.

A per-head param (per-head Muon: ``H`` heads of ``d`` rows along dim 0) is stepped where its rows
lie when FSDP2's rows fall on head edges. Where they do not (``owner`` `HEADS`), each rank steps
the whole heads whose anchor row it holds (`head_run`; the anchor is one row of each head, moved
from param to param so that every layer's heads are not stepped on the same ranks): the rows of
those heads that other ranks hold come to it, with their gradients, and go back stepped
(`head_moves`), so only the rows of the heads FSDP2 cut between ranks move, never a whole matrix
to one owner.

HSDP (``fully_shard`` on a 2-D mesh of ``replicas x shards``) keeps every replica's ranks holding
the same pieces. A plan with ``replicas > 1`` shards the step over the replicas too (ZeRO-1 over
the replicate dim): mesh rank ``r * shards + s`` steps ``part`` of shard ``s``'s piece of each
element-wise param (a run of it, cut at the param's low-bit blocks), and owns whole params across
all ranks, so each matrix is stepped once in the mesh, not once per replica; one all-gather over
each replicate group then gives every replica the updated pieces (``gather_bytes``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zero.plans.costs import RuleCost, cost_of
from zero.plans.meta import ParamMeta, itemsize
from zero.plans.partition import check_metas, check_world_size, partition

__all__ = ["Fsdp2Plan", "make_fsdp2_plan", "chunk_rows", "GATHER_BUCKET_BYTES", "HEADS"]

GATHER_BUCKET_BYTES = 64 * 2**20  # the most of a rank's pieces one all-gather over the replicas carries
HEADS = -2  # `Fsdp2Plan.owner` of a per-head param whose rows FSDP2 cut inside heads: stepped by whole heads


@functools.cache  # a plan at 1,024 ranks asks it for every param and rank
def chunk_rows(size: int, world_size: int) -> tuple[tuple[int, int], ...]:
    """``(start, length)`` of each rank's rows of a dim of ``size`` as ``torch.chunk`` cuts it
    (FSDP2's rule): chunks of ``ceil(size / W)``, the last ranks shorter or empty."""
    chunk = -(-size // world_size) if size else 0
    return tuple((min(r * chunk, size), max(0, min(chunk, size - r * chunk))) for r in range(world_size))


@dataclass(frozen=True)
class Fsdp2Plan:
    """Per param: the dim FSDP2 shards (``dims``), whether an owner steps it whole (``owner``:
    the mesh rank, -1 where each rank steps its own piece, `HEADS` where each rank steps the whole
    heads whose anchor row it holds), and the block its low-bit state is quantized in, or a
    per-head param's elements a head (``blocks``, 0 for none). ``world_size`` is the ranks one
    replica shards over; ``replicas`` the replicas the step is sharded over too (1: each replica
    steps alone).
    Methods that take a ``rank`` for a piece (``rows``, ``local_shape``, ``start``) take the shard
    rank; those of what a rank steps and holds (``part``, ``state_bytes``, ``owned``) the mesh
    rank ``replica * world_size + shard``. Everything else is read from these."""

    metas: tuple[ParamMeta, ...]
    world_size: int
    optimizer: str
    dims: tuple[int, ...]
    owner: tuple[int, ...]
    blocks: tuple[int, ...]
    replicas: int = 1
    fingerprint: str = ""

    @property
    def ranks(self) -> int:
        """Every rank of the mesh the step is sharded over: ``replicas * world_size``."""
        return self.replicas * self.world_size

    def part(self, i: int, rank: int) -> tuple[int, int]:
        """``(start, length)`` of the elements of its shard's piece of param ``i`` that mesh rank
        ``rank`` steps (the whole piece at one replica); for a param an owner steps whole, the
        pieces of the owner's replica (they come back to it from the owner). An element-wise
        param's piece is cut over the replicas at whole low-bit blocks."""
        shard, replica = rank % self.world_size, rank // self.world_size
        n = self.local_numel(i, shard)
        if self.owner[i] == HEADS:  # its heads' run, which may start before its piece and end past it
            start, length = self.head_run(i, shard)
            return start - self.start(i, shard), length
        if self.owner[i] >= 0:
            return (0, n) if self.owner[i] // self.world_size == replica else (0, 0)
        unit = self.blocks[i] or 1
        first, count = chunk_rows(-(-n // unit), self.replicas)[replica]
        start = min(first * unit, n)
        return start, min(n, (first + count) * unit) - start

    def within(self, replica: int) -> Fsdp2Plan:
        """The plan of one replica's exchange with its owners: the whole params owned by its ranks,
        by shard rank; every other param -1 (stepped in pieces, or by another replica's owner)."""
        if self.replicas == 1:
            return self
        w = self.world_size
        owner = tuple(o % w if o >= 0 and o // w == replica else -1 for o in self.owner)
        return dataclasses.replace(self, owner=owner, replicas=1)

    def rows(self, i: int) -> tuple[tuple[int, int], ...]:
        """Each rank's ``(start, length)`` along param ``i``'s sharded dim."""
        shape = self.metas[i].shape
        return chunk_rows(shape[self.dims[i]] if shape else 1, self.world_size)

    def local_shape(self, i: int, rank: int) -> tuple[int, ...]:
        shape, dim = self.metas[i].shape, self.dims[i]
        return shape[:dim] + (self.rows(i)[rank][1],) + shape[dim + 1:] if shape else ()

    def local_numel(self, i: int, rank: int) -> int:
        return math.prod(self.local_shape(i, rank))

    def start(self, i: int, rank: int) -> int | None:
        """Where rank's piece of param ``i`` starts in the flattened param; None when the piece
        is not one run of the flattened param (a dim past the first with more than one row)."""
        shape, dim = self.metas[i].shape, self.dims[i]
        if any(s > 1 for s in shape[:dim]):
            return None
        return self.rows(i)[rank][0] * math.prod(shape[dim + 1:])

    def runs_cut_at(self, i: int, k: int) -> bool:
        """Whether every rank's piece of param ``i`` is one run of the flattened param that starts
        and ends at a multiple of ``k`` elements: a low-bit block of ``k`` then lies whole on one
        rank, and a state with one element per ``k`` of the param's cuts at whole elements."""
        return all(self.start(i, r) is not None and self.start(i, r) % k == 0 and self.local_numel(i, r) % k == 0
                   for r in range(self.world_size))

    def head_run(self, i: int, rank: int) -> tuple[int, int]:
        """``(start, length)`` in the flattened param ``i`` (an `HEADS` one) of the whole heads
        whose anchor row (`head_anchor`) rank ``rank`` holds: what it steps. It may start before
        its rows and run past their end, by less than a head each way."""
        shape, block = self.metas[i].shape, self.blocks[i]
        per_row = math.prod(shape[1:])
        d, anchor = block // per_row, self.head_anchor(i)
        first, n = self.rows(i)[rank]
        lo = max(0, -(-(first - anchor) // d))
        hi = max(lo, -(-(first + n - anchor) // d)) if n else lo
        return lo * d * per_row, (hi - lo) * d * per_row

    def head_anchor(self, i: int) -> int:
        """The row within each head of param ``i`` whose holder steps the head: the same for every
        head of a param, moved by a rank's rows from param to param (by its index), so that the
        heads of a model's layers, cut alike, are not all stepped on the same ranks."""
        rows = self.rows(i)[0][1]
        return (i * rows) % (self.blocks[i] // math.prod(self.metas[i].shape[1:]))

    def head_moves(self, i: int) -> tuple[tuple[int, int, int, int], ...]:
        """``(holder, stepper, start, length)``: the runs of the flattened param ``i`` (an `HEADS`
        one) that rank ``holder`` holds and rank ``stepper`` steps, ``holder != stepper``: what
        travels to the steppers (with its gradient) and back, in holder order. A rank's rows
        outside its own heads are at most two runs, the ends of the heads its rows start and end
        inside."""
        shape, block = self.metas[i].shape, self.blocks[i]
        per_row = math.prod(shape[1:])
        return _head_moves(shape[0], per_row, block // per_row, self.world_size, self.head_anchor(i))

    @property
    def by_heads(self) -> tuple[int, ...]:
        """The params each rank steps by the whole heads whose anchor row it holds."""
        return tuple(i for i, o in enumerate(self.owner) if o == HEADS)

    @property
    def whole(self) -> tuple[int, ...]:
        """The params an owner steps whole."""
        return tuple(i for i, o in enumerate(self.owner) if o >= 0)

    def owned(self, rank: int) -> tuple[int, ...]:
        return tuple(i for i, o in enumerate(self.owner) if o == rank)

    def exchange_bytes(self, rank: int) -> dict[str, tuple[int, int]]:
        """Per dtype, the bytes mesh rank ``rank`` sends to the owners of its replica (its pieces of
        their params and gradients; its rows of heads another rank steps, with their gradients)
        and sends back as an owner (each other rank's piece of its updated params; the rows of
        its heads others hold): traffic within a replica."""
        w, shard = self.world_size, rank % self.world_size
        out: dict[str, list[int]] = {}
        for i in self.whole:
            meta, owner = self.metas[i], self.owner[i]
            size = itemsize(meta.dtype)
            row = out.setdefault(meta.dtype, [0, 0])
            if owner // w != rank // w:
                continue
            if owner != rank:
                row[0] += 2 * self.local_numel(i, shard) * size
            else:
                row[1] += sum(self.local_numel(i, r) for r in range(w) if r != shard) * size
        for i in self.by_heads:
            size, row = itemsize(self.metas[i].dtype), out.setdefault(self.metas[i].dtype, [0, 0])
            for h, s, _, n in self.head_moves(i):
                row[0] += 2 * n * size if h == shard else 0
                row[1] += n * size if s == shard else 0
        return {k: (v[0], v[1]) for k, v in out.items()}

    def slot(self, i: int, rank: int) -> int:
        """Elements each replica's part of param ``i`` takes in the all-gather over the replicas
        (of mesh rank ``rank``'s shard): the longest part, so the parts gathered are the piece, in
        order, padded at its end."""
        n, unit = self.local_numel(i, rank % self.world_size), self.blocks[i] or 1
        units = -(-n // unit)
        return -(-units // self.replicas) * unit

    def gather_buckets(self, ts: Sequence[int], rank: int) -> list[list[int]]:
        """The all-gathers over ``rank``'s replicate group that bring the other replicas' parts of
        the params of ``ts`` stepped in parts (one group's, one dtype's, in order): consecutive
        runs of them whose pieces here hold at most `GATHER_BUCKET_BYTES` (a larger param alone),
        so the step's buffers stay that size rather than the whole shard's. (A param an owner
        steps whole is broadcast from the owner's replica instead.)"""
        shard, out, size = rank % self.world_size, [], 0
        for t in (t for t in ts if self.owner[t] < 0):
            n = self.local_numel(t, shard) * itemsize(self.metas[t].dtype)
            if not out or size + n > GATHER_BUCKET_BYTES:
                out.append([])
                size = 0
            out[-1].append(t)
            size += n
        return out

    def gather_bytes(self, rank: int) -> dict[str, int]:
        """Per dtype, the bytes of the collectives over ``rank``'s replicate group that give every
        replica the updated pieces, as `zero.backends.comm` records them: each `gather_buckets`
        bucket's all-gather (its output: every replica's `slot` of each param), and each whole
        param's broadcast from its owner's replica (its piece). Traffic across replicas; empty at
        one replica."""
        if self.replicas == 1:
            return {}
        shard, out = rank % self.world_size, {}
        for group, dtype in dict.fromkeys((m.group, m.dtype) for m in self.metas if m.requires_grad):
            these = [i for i, m in enumerate(self.metas) if m.requires_grad and (m.group, m.dtype) == (group, dtype)]
            slots = sum(self.replicas * self.slot(i, rank) for b in self.gather_buckets(these, rank) for i in b)
            whole = sum(self.local_numel(i, shard) for i in these if self.owner[i] >= 0)
            out[dtype] = out.get(dtype, 0) + (slots + whole) * itemsize(dtype)
        return out

    def state_bytes(self, rank: int) -> int:
        """Bytes of optimizer state mesh rank ``rank`` holds: its parts' and its owned params' whole."""
        spec, total = cost_of(self.optimizer), 0
        for i, meta in enumerate(self.metas):
            if not meta.requires_grad:
                continue
            size = itemsize(meta.dtype)
            if self.owner[i] == rank:
                total += spec.state_bytes(meta, size)
            elif self.owner[i] in (-1, HEADS):
                total += spec.shard_state_bytes(self.part(i, rank)[1], size, self.blocks[i])
        return total

    def table(self) -> str:
        """One line per rank: elements stepped, params owned whole, state bytes and exchange bytes."""
        mesh = f"{self.world_size} ranks"
        if self.replicas > 1:
            mesh = f"{self.replicas} replicas x {mesh}"
        lines = [f"FSDP2 plan: {len(self.metas)} params over {mesh}, {self.optimizer}, "
                 f"{len(self.whole)} stepped whole by an owner"
                 + (f", {len(self.by_heads)} by whole heads" if self.by_heads else "")
                 + f" (fingerprint {self.fingerprint})",
                 f"{'rank':>4} {'elements':>12} {'owned':>6} {'state bytes':>14} {'to owners':>12} {'back':>12}"
                 + (f" {'replicas':>12}" if self.replicas > 1 else "")]
        for r in range(self.ranks):
            moved = self.exchange_bytes(r).values()
            across = f" {sum(self.gather_bytes(r).values()):>12}" if self.replicas > 1 else ""
            lines.append(f"{r:>4} {sum(self.part(i, r)[1] for i in range(len(self.metas))):>12} "
                         f"{len(self.owned(r)):>6} {self.state_bytes(r):>14} {sum(m[0] for m in moved):>12} "
                         f"{sum(m[1] for m in moved):>12}{across}")
        return "\n".join(lines)


def make_fsdp2_plan(metas: Sequence[ParamMeta], world_size: int, optimizer: str | RuleCost = "adam", *,
                    dims: Mapping[str, int] | None = None, whole: Sequence[str] | None = None,
                    blocks: Mapping[str, int] | None = None, weight: str = "step_flops",
                    replicas: int = 1) -> Fsdp2Plan:
    """The plan of a rule over FSDP2's params on a mesh of ``world_size`` ranks per replica, its
    step sharded over ``replicas`` replicas too (HSDP's replicate dim; 1: FSDP2's 1-D mesh, or
    each replica stepping alone).

    ``dims``: the dim FSDP2 shards each param on, by name (default 0); ``whole``: the names of
    the params the rule needs whole (default: what ``optimizer``'s cost model says);
    ``blocks``: the block each param's low-bit state is quantized in, by name (default: the cost
    model's; a per-head param's: a head's elements, as ``plan_for`` gives them). An owner steps
    the params the rule needs whole, and the low-bit params whose blocks FSDP2 cuts between ranks;
    owners balance ``weight`` (`zero.plans.accounting.weights`). Per-head params whose heads FSDP2
    cuts between ranks are stepped by whole heads (`HEADS`) rather than by an owner.
    """
    metas = tuple(check_metas(metas))
    check_world_size(world_size)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive int, got {replicas!r}")
    spec = cost_of(optimizer)
    dims = dict(dims or {})
    unknown = set(dims) - {m.name for m in metas}
    if unknown:
        raise ValueError(f"dims names params that are not in the plan: {sorted(unknown)}")
    dim_of = tuple(_check_dim(m, dims.get(m.name, 0)) for m in metas)
    blocks = _blocks(metas, spec, blocks)
    draft = Fsdp2Plan(metas, world_size, str(optimizer).lower(), dim_of, (-1,) * len(metas), blocks, replicas)
    keep = _resolve(draft, spec, whole)
    aligned, heads = _by_heads(draft, spec, keep, whole)
    keep = tuple(i for i in keep if i not in aligned + heads)
    owner = [-1] * len(metas)
    if keep:
        part = partition([metas[i] for i in keep], world_size * replicas, "sorted_greedy", weight, spec)
        for i, r in zip(keep, part.owner):
            owner[i] = r
    for i in heads:
        owner[i] = HEADS
    blocks = tuple(0 if owner[i] >= 0 else b for i, b in enumerate(blocks))
    plan = dataclasses.replace(draft, owner=tuple(owner), blocks=blocks)
    return dataclasses.replace(plan, fingerprint=_fingerprint(plan))


def _blocks(metas: tuple[ParamMeta, ...], spec: RuleCost, given: Mapping[str, int] | None) -> tuple[int, ...]:
    if given is None:
        return tuple(spec.block_for(m) or spec.head_block(m) for m in metas)
    unknown = set(given) - {m.name for m in metas}
    if unknown:
        raise ValueError(f"blocks names params that are not in the plan: {sorted(unknown)}")
    return tuple(int(given.get(m.name, 0)) if m.requires_grad else 0 for m in metas)


def _check_dim(meta: ParamMeta, dim: int) -> int:
    if not isinstance(dim, int) or not 0 <= dim < max(1, len(meta.shape)):
        raise ValueError(f"param {meta.name!r} of shape {meta.shape} cannot be sharded on dim {dim!r}")
    return dim


def _resolve(plan: Fsdp2Plan, spec: RuleCost, whole: Sequence[str] | None) -> tuple[int, ...]:
    metas = plan.metas
    if whole is not None:
        if isinstance(whole, str):
            raise TypeError(f"whole must be a list of param names, got the str {whole!r}")
        index = {m.name: i for i, m in enumerate(metas)}
        missing = [n for n in whole if n not in index]
        if missing:
            raise ValueError(f"whole names params that are not in the plan: {missing}")
        needs = {index[n] for n in whole}
    else:
        needs = {i for i, m in enumerate(metas) if spec.whole(m)}
    return tuple(i for i, m in enumerate(metas) if m.requires_grad and
                 (i in needs or (plan.blocks[i] and not plan.runs_cut_at(i, plan.blocks[i]))))


@functools.cache  # asked at every step, for every per-head param
def _head_moves(rows: int, per_row: int, d: int, world_size: int, anchor: int) -> tuple[tuple[int, int, int, int], ...]:
    cut, out = chunk_rows(rows, world_size), []
    chunk = cut[0][1]  # torch.chunk's rows: chunks of the first rank's length
    for holder, (first, n) in enumerate(cut):
        if not n:
            continue
        lo = max(0, -(-(first - anchor) // d)) * d  # its own heads' rows, as `Fsdp2Plan.head_run`
        hi = max(lo, -(-(first + n - anchor) // d) * d)
        for a, b in ((first, min(lo, first + n)), (max(hi, first), first + n)):  # before and after them
            if a < b:
                stepper = (a // d * d + anchor) // chunk  # the holder of that head's anchor row
                out.append((holder, stepper, a * per_row, (b - a) * per_row))
    return tuple(out)


def _by_heads(plan: Fsdp2Plan, spec: RuleCost, keep: Sequence[int], named: Sequence[str] | None
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Of the params ``keep`` (to step whole), the per-head ones (``blocks`` a head's elements,
    `RuleCost.head_block`) along dim 0, which whole heads suffice for, unless ``named`` whole:
    those whose rows FSDP2 cuts at head edges (stepped in place), and, at one replica, those it
    cuts inside heads (stepped by whole heads, `HEADS`). (Over HSDP's replicas an owner steps the
    latter whole, each head once in the mesh.)"""
    aligned, cut = [], []
    for i in keep:
        meta, block = plan.metas[i], plan.blocks[i]
        if not block or block != spec.head_block(meta) or plan.dims[i] != 0 or meta.name in (named or ()):
            continue
        if plan.runs_cut_at(i, block):
            aligned.append(i)
        elif plan.replicas == 1:
            cut.append(i)
    return tuple(aligned), tuple(cut)


def _fingerprint(plan: Fsdp2Plan) -> str:
    payload = [[m.name, list(m.shape), m.dtype, m.requires_grad] for m in plan.metas]
    text = json.dumps([payload, plan.world_size, plan.optimizer, plan.dims, plan.owner, plan.blocks]
                      + ([plan.replicas] if plan.replicas > 1 else []))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
