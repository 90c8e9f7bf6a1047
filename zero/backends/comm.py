"""Collectives as free functions, each taking the process group explicitly, on gloo (CPU) and
NCCL (CUDA). With `zero.backends.consistency` (which checks that every rank makes the same
calls and names a rank that stops) the only place that calls ``torch.distributed`` directly.

The asynchronous ones return works to wait on with `zero.backends.consistency.wait_for`, which
names the rank that stopped answering when a collective fails, instead of torch's words alone.
"""

from __future__ import annotations

import contextlib
import math
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import optree
import torch
import torch.distributed as dist

from zero.plans.accounting import bus_bytes

__all__ = ["Collective", "recording", "resolve_group", "is_fake", "group_rank", "group_size", "global_rank",
           "all_gather_object", "in_group", "device_for", "summed", "maxed", "all_gather_rows", "all_gather_into",
           "broadcast_from", "all_reduce_sum", "all_reduce_max", "reduce_scatter_sum", "reduce_sum_to", "all_to_all",
           "exchange", "new_subgroup", "twin_group", "send_tree", "recv_tree", "Reducer", "MeanReducer"]

# torch 2.13 renamed all_gather_into_tensor; keep working on the 2.x releases before it.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Collective:
    """One collective this rank made: the `zero.backends.comm` function (``kind``), the dtype and
    bytes of the tensor it handed in, and the group's size."""

    kind: str
    dtype: str
    group_size: int
    bytes: int

    @property
    def bus_bytes(self) -> int:
        """What this rank sends (= receives) in it, as nccl-tests count (`zero.plans.accounting.bus_bytes`)."""
        return bus_bytes(self.kind, self.bytes, self.group_size)


_RECORDINGS: list[list[Collective]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[Collective]]:
    """Every collective zero makes inside the block, in order (the list fills as they are made)."""
    made: list[Collective] = []
    _RECORDINGS.append(made)
    try:
        yield made
    finally:
        _RECORDINGS.remove(made)


def _record(kind: str, tensor: torch.Tensor, group: Any) -> None:
    if _RECORDINGS:
        made = Collective(kind, str(tensor.dtype).removeprefix("torch."), group_size(group),
                          tensor.numel() * tensor.element_size())
        for recorded in _RECORDINGS:
            recorded.append(made)


def resolve_group(process_group: Any, who: str) -> Any:
    """``process_group``, or the default group for None; a clear error before init_process_group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{who} needs torch.distributed.init_process_group() first")
    if process_group is None:
        return dist.group.WORLD
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{who}: process_group must be a torch.distributed ProcessGroup (e.g. from "
                        f"dist.new_group) or None for the default group, got {process_group!r}")
    return process_group


def is_fake(group: Any) -> bool:
    """Whether ``group`` is torch's fake process group (``init_process_group("fake", ...)``): one
    rank of a large job simulated in one process, its collectives doing nothing. Checks that read
    data (which fake tensors have none of) step aside under it, and only under it."""
    return dist.get_backend(group) == "fake"


def group_rank(group: Any) -> int:
    return dist.get_rank(group)


def group_size(group: Any) -> int:
    return dist.get_world_size(group)


def global_rank(group: Any, rank: int) -> int:
    """The default-group rank of ``rank`` in ``group`` (what point-to-point calls address)."""
    return dist.get_global_rank(group, rank) if group is not dist.group.WORLD else rank


def broadcast_object(obj: Any, group: Any) -> Any:
    """Group rank 0's ``obj`` (picklable) on every rank of ``group``."""
    box = [obj]
    dist.broadcast_object_list(box, src=global_rank(group, 0), group=group)
    return box[0]


def all_gather_object(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj``, in group-rank order (pickled; for what a rare path exchanges)."""
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def in_group(group: Any) -> bool:
    return dist.get_rank(group) >= 0  # -1 on processes outside the group


def device_for(group: Any, device: torch.device) -> torch.device:
    """Where tensors for collectives on ``group`` live: ``device`` under NCCL, the CPU under gloo."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def summed(group: Any, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """``reduce(t)``: ``t`` summed over ``group``'s ranks (a collective), returned on the CPU."""
    return _reduced(lambda t, g: all_reduce_sum(t, g), group, device)  # looked up per call (tests count calls)


def maxed(group: Any, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """``reduce(t)``: the ranks' element-wise maximum of ``t`` (a collective), returned on the CPU."""
    return _reduced(lambda t, g: all_reduce_max(t, g), group, device)


def _reduced(collective: Callable[[torch.Tensor, Any], None], group: Any, device: torch.device) -> Callable:
    comm_device = device_for(group, device)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.to(comm_device)
        collective(t, group)
        return t.cpu()

    return reduce


def all_reduce_sum(tensor: torch.Tensor, group: Any) -> None:
    _record("all_reduce_sum", tensor, group)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def all_reduce_max(tensor: torch.Tensor, group: Any) -> None:
    _record("all_reduce_max", tensor, group)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def reduce_scatter_sum(output: torch.Tensor, rows: torch.Tensor, group: Any) -> Any:
    """Start summing ``rows`` (``[world_size * n]``) over the ranks, rank ``r`` receiving elements
    ``r * n:(r + 1) * n`` of the sum in ``output``; returns the work to ``wait()`` on."""
    _record("reduce_scatter_sum", rows, group)
    return _REDUCE_SCATTER(output, rows, op=dist.ReduceOp.SUM, group=group, async_op=True)


def reduce_sum_to(tensor: torch.Tensor, owner: int, group: Any) -> Any:
    """Start summing ``tensor`` over the ranks into group rank ``owner``'s (the others' are left
    undefined); returns the work to ``wait()`` on."""
    _record("reduce_sum_to", tensor, group)
    return dist.reduce(tensor, dst=global_rank(group, owner), op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_to_all(output: torch.Tensor, chunks: torch.Tensor, group: Any) -> Any:
    """Start sending chunk ``r`` of ``chunks`` (``[world_size * n]``) to group rank ``r``, receiving
    each rank's chunk for this rank into ``output`` in rank order; returns the work to ``wait()`` on."""
    _record("all_to_all", chunks, group)
    return dist.all_to_all_single(output, chunks, group=group, async_op=True)


def exchange(output: torch.Tensor, chunks: torch.Tensor, out_splits: list[int], in_splits: list[int],
             group: Any) -> None:
    """Send ``in_splits[r]`` elements of ``chunks`` (in rank order) to group rank ``r`` and receive
    ``out_splits[r]`` from each into ``output``: an all-to-all of uneven chunks. Recorded as the
    bytes this rank sends to the others (its own chunk stays here)."""
    if _RECORDINGS:
        me = group_rank(group)
        sent = (sum(in_splits) - in_splits[me]) * chunks.element_size()
        made = Collective("exchange", str(chunks.dtype).removeprefix("torch."), group_size(group), sent)
        for recorded in _RECORDINGS:
            recorded.append(made)
    dist.all_to_all_single(output, chunks, out_splits, in_splits, group=group)


class Reducer:
    """How a bucket of gradients becomes this rank's shard of their mean over the ranks (ZeRO-2's
    reduce-scatter). The gradient source calls ``start`` when a bucket is complete, waits on what it
    returns (``wait()``, through `zero.backends.consistency.wait_for`), then ``finish``:

    - ``start(into, bucket, group)``: start reducing ``bucket`` (``[world_size * n]`` elements, in
      the order of the ranks' shards) so that ``into`` (``[n]``) can hold this rank's shard;
    - ``finish(pending, into, out, world)``: after the wait, the mean: written into ``out`` when
      ``into is out`` (the shard's first reduction since it was zeroed), else added into ``out``;
    - ``spec``: its name in the plan (`zero.plans.reduction`), whose ``reduction_collectives``
      say the ``(kind, bytes)`` of each collective ``start`` makes, as the recorder records them:
      what the plan's footprint counts (`footprint(plan, rank, reducer=...)` takes either).

    `MeanReducer` is the plain sum-then-mean; `zero.backends.int8_reducer.Int8Reducer` sends int8
    codes. Pass one as ``ZeroRedundancyOptimizer(..., reduce_scatter_grads=True, reducer=...)``.
    """

    def start(self, into: torch.Tensor, bucket: torch.Tensor, group: Any) -> Any:
        raise NotImplementedError

    def finish(self, pending: Any, into: torch.Tensor, out: torch.Tensor, world: int) -> None:
        raise NotImplementedError

    spec: str = ""


class MeanReducer(Reducer):
    """One reduce-scatter of the bucket in its own dtype, summed, then divided by the ranks."""

    spec = "mean"

    def start(self, into: torch.Tensor, bucket: torch.Tensor, group: Any) -> Any:
        return reduce_scatter_sum(into, bucket, group)

    def finish(self, pending: Any, into: torch.Tensor, out: torch.Tensor, world: int) -> None:
        if into is out:
            out.div_(world)
        else:
            out.add_(into, alpha=1 / world)


def new_subgroup(parent: Any, blocks: tuple[tuple[int, ...], ...]) -> Any:
    """The block of ``parent``'s ranks this process is in, as a new group.

    Every block becomes a group (``new_group`` must be called by every process of the default
    group, members or not, in the same order), as ``torch.distributed.new_subgroups`` does.
    """
    me = group_rank(parent)
    mine = None
    for block in blocks:
        group = dist.new_group([global_rank(parent, r) for r in block])
        if me in block:
            mine = group
    return mine


def all_gather_rows(rows: torch.Tensor, rank: int, group: Any, async_op: bool = False) -> list[Any]:
    """In place: every rank's ``rows[rank]`` ends up in ``rows[r]`` of every other rank.

    ``rows`` is a contiguous ``[world_size, n]`` tensor. NCCL all-gathers in place. Gloo's
    all-gather stages the whole output in a temporary as large as ``rows``, so above
    ``_GLOO_STAGING`` elements it broadcasts each row from its owner instead (in place, no
    temporary; the same bytes on the wire). ``async_op``: return the works to ``wait()`` on.
    """
    _record("all_gather_rows", rows, group)
    if dist.get_backend(group) == "gloo" and rows.numel() > _GLOO_STAGING:
        works = [dist.broadcast(rows[r], src=global_rank(group, r), group=group, async_op=async_op)
                 for r in range(rows.shape[0])]
    else:
        works = [_ALL_GATHER(rows.view(-1), rows[rank], group=group, async_op=async_op)]
    return works if async_op else []


_GLOO_STAGING = 1 << 16


def all_gather_into(output: torch.Tensor, mine: torch.Tensor, group: Any) -> Any:
    """Start gathering every rank's ``mine`` into ``output`` (``[world_size * n]``, rank order);
    returns the work to wait on."""
    _record("all_gather_into", output, group)
    return _ALL_GATHER(output, mine, group=group, async_op=True)


def broadcast_from(tensor: torch.Tensor, owner: int, group: Any, async_op: bool = False) -> Any:
    """In place: ``tensor`` on group rank ``owner`` overwrites it on every other rank (``async_op``:
    returns the work to wait on)."""
    _record("broadcast_from", tensor, group)
    return dist.broadcast(tensor, src=global_rank(group, owner), group=group, async_op=async_op)


class _TensorSlot:
    """Stands in for a tensor in a pickled skeleton: its position in the flat payload."""

    __slots__ = ("dtype", "shape", "offset")

    def __init__(self, dtype: torch.dtype, shape: torch.Size, offset: int):
        self.dtype, self.shape, self.offset = dtype, tuple(shape), offset


_TWINS: dict[tuple, Any] = {}


def twin_group(group: Any) -> Any:
    """A gloo group of ``group``'s ranks, made on first use (a collective then), for collectives on
    another thread: a background save's run while training's run on ``group``, and two threads
    must not share one group's order of collectives."""
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (ranks, id(dist.distributed_c10d._get_default_store()))  # a new init_process_group brings a new store
    if key not in _TWINS:
        _TWINS[key] = dist.new_group(list(ranks), backend="gloo")
    return _TWINS[key]


def send_tree(tree: Any, dst: int, group: Any, device: torch.device) -> None:
    """Send a pytree with tensor leaves to ``dst``: a pickled skeleton, then one flat tensor per dtype.

    Tensors travel as raw bytes, not pickles, and only to ``dst``; other ranks take no part.
    """
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    skeleton_leaves = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            group_list = by_dtype.setdefault(leaf.dtype, [])
            offset = sum(t.numel() for t in group_list)
            group_list.append(leaf.detach())
            skeleton_leaves.append(_TensorSlot(leaf.dtype, leaf.shape, offset))
        else:
            skeleton_leaves.append(leaf)
    header = pickle.dumps((spec, skeleton_leaves, [(d, sum(t.numel() for t in ts)) for d, ts in by_dtype.items()]))
    peer = global_rank(group, dst)
    _send_bytes(header, peer, group, device)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1).to(device) for t in ts])
        dist.send(flat, dst=peer, group=group)


def recv_tree(src: int, group: Any, device: torch.device) -> Any:
    """Receive what `send_tree` sent from ``src``; tensors land on the CPU, one dtype at a time."""
    peer = global_rank(group, src)
    spec, skeleton_leaves, payloads = pickle.loads(_recv_bytes(peer, group, device))
    flats = {}
    for dtype, numel in payloads:
        buf = torch.empty(numel, dtype=dtype, device=device)
        dist.recv(buf, src=peer, group=group)
        flats[dtype] = buf.cpu()  # one shard's payload in flight at a time, then host memory
    # Views into the per-dtype buffer: no second copy of the shard.
    leaves = [flats[x.dtype][x.offset:x.offset + math.prod(x.shape)].view(x.shape)
              if isinstance(x, _TensorSlot) else x for x in skeleton_leaves]
    return optree.tree_unflatten(spec, leaves)


def _send_bytes(data: bytes, peer: int, group: Any, device: torch.device) -> None:
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), dst=peer, group=group)
    dist.send(payload, dst=peer, group=group)


def _recv_bytes(peer: int, group: Any, device: torch.device) -> bytes:
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, src=peer, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, src=peer, group=group)
    return payload.cpu().numpy().tobytes()
