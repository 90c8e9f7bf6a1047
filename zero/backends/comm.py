"""Collectives as free functions: the only place that calls ``torch.distributed`` directly.

Each function takes the process group explicitly and works on gloo (CPU) and NCCL (CUDA). All of
them block on the group's own timeout, so a peer that died or skipped a call surfaces as an error
from torch.distributed instead of a hang.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed import DistStoreError

from zero.backends.watch import Place, watch_of

__all__ = ["resolve_group", "group_rank", "group_size", "global_rank", "in_group", "device_for", "summed", "wait_for",
           "all_gather_rows", "broadcast_from",
           "all_reduce_sum", "reduce_scatter_sum", "check_in", "new_subgroup", "send_tree", "recv_tree"]

# torch 2.13 renamed all_gather_into_tensor; keep working on the 2.x releases before it.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


def group_rank(group: Any) -> int:
    return dist.get_rank(group)


def group_size(group: Any) -> int:
    return dist.get_world_size(group)


def global_rank(group: Any, rank: int) -> int:
    """The default-group rank of ``rank`` in ``group`` (what point-to-point calls address)."""
    return dist.get_global_rank(group, rank) if group is not dist.group.WORLD else rank


def in_group(group: Any) -> bool:
    return dist.get_rank(group) >= 0  # -1 on processes outside the group


def device_for(group: Any, device: torch.device) -> torch.device:
    """Where tensors for collectives on ``group`` live: ``device`` under NCCL, the CPU under gloo."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def summed(group: Any, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """``reduce(t)``: ``t`` summed over ``group``'s ranks (a collective), returned on the CPU."""
    comm_device = device_for(group, device)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.to(comm_device)
        all_reduce_sum(t, group)
        return t.cpu()

    return reduce


def all_reduce_sum(tensor: torch.Tensor, group: Any) -> None:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def reduce_scatter_sum(output: torch.Tensor, rows: torch.Tensor, group: Any) -> Any:
    """Start summing ``rows`` (``[world_size * n]``) over the ranks, rank ``r`` receiving elements
    ``r * n:(r + 1) * n`` of the sum in ``output``; returns the work to ``wait()`` on."""
    return _REDUCE_SCATTER(output, rows, op=dist.ReduceOp.SUM, group=group, async_op=True)


def reduce_sum_to(tensor: torch.Tensor, owner: int, group: Any) -> Any:
    """Start summing ``tensor`` over the ranks into group rank ``owner``'s (the others' are left
    undefined); returns the work to ``wait()`` on."""
    return dist.reduce(tensor, dst=global_rank(group, owner), op=dist.ReduceOp.SUM, group=group, async_op=True)


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
    if dist.get_backend(group) == "gloo" and rows.numel() > _GLOO_STAGING:
        works = [dist.broadcast(rows[r], src=global_rank(group, r), group=group, async_op=async_op)
                 for r in range(rows.shape[0])]
    else:
        works = [_ALL_GATHER(rows.view(-1), rows[rank], group=group, async_op=async_op)]
    return works if async_op else []


_GLOO_STAGING = 1 << 16


def broadcast_from(tensor: torch.Tensor, owner: int, group: Any, async_op: bool = False) -> Any:
    """In place: ``tensor`` on group rank ``owner`` overwrites it on every other rank (``async_op``:
    returns the work to wait on)."""
    return dist.broadcast(tensor, src=global_rank(group, owner), group=group, async_op=async_op)


Facts = Sequence[tuple[str, Any]]  # (label, value) pairs, e.g. ("param group 0's lr", 0.001)


def wait_for(work: Any, group: Any, what: str) -> None:
    """Wait on ``work``, one of zero's collectives; if it fails, say which rank stopped answering."""
    try:
        work.wait()
    except RuntimeError as e:
        raise _failed(e, group, what) from e


def _failed(error: RuntimeError, group: Any, what: str) -> RuntimeError:
    """A failed collective, with the ranks whose heartbeat stopped (`zero.backends.watch`) named."""
    watch = watch_of(group)
    try:
        silent = watch.silent() if watch is not None else None
    except (RuntimeError, DistStoreError):
        silent = None
    who = (f"rank {', '.join(map(str, silent))} did not answer" if silent else
           "the rendezvous store is unreachable too (with env:// or tcp:// it lives on rank 0)" if silent is None
           else "every rank still answers")
    return RuntimeError(f"rank {group_rank(group)} (of {group_size(group)}) waited for {what} and the collective "
                        f"failed; {who}: it has stopped or left the process group ({error})")


def check_in(what: str, fields: Mapping[str, int], group: Any, device: torch.device,
             facts: Mapping[str, Callable[[], Facts]] | None = None, place: Place | None = None) -> Callable[[], None]:
    """Start checking that all ranks are in the same call ``what`` with equal ``fields``; returns ``verify``.

    ``fields`` names the ints every rank must agree on (steps taken, checksums of the params and
    of the param groups ...); every call passes the same number of them. ``verify()`` waits, then
    raises ``ValueError`` on every rank if some rank differs, naming that rank and what differs.
    A field that is a checksum has a ``facts`` function listing what it sums up as labelled values:
    only when the checksums differ do the ranks exchange those, and the error names the first
    label whose values differ and both values, never the checksum.
    The collective has the same size on every rank, so ranks that diverged (one adds a param
    group while another steps, or one skipped a step) meet here and get a clear error instead of
    pairing collectives of different sizes, which gloo answers by aborting the process or
    hanging. Started before a local step and verified after it, its latency hides behind the
    step's compute. A rank that never joins (it skipped the call, or stopped) is named in bounded
    time from ``place`` (where this rank is: `zero.backends.watch`), not after the group's timeout.
    """
    rank, size = group_rank(group), group_size(group)
    watch = watch_of(group) if place is not None else None
    values = [_CALLS[what], *fields.values()]
    rows = torch.tensor([values] * size, dtype=torch.int64, device=device)  # others' rows are overwritten
    work = _ALL_GATHER(rows.view(-1), rows[rank], group=group, async_op=True)

    def verify() -> None:
        if watch is not None:
            watch.wait(work.is_completed, place)
        try:
            work.wait()
        except RuntimeError as e:
            raise _failed(e, group, f"the other ranks in {what}") from e
        got = rows.tolist()
        column = next((j for j in range(len(values)) if any(row[j] != got[0][j] for row in got)), None)
        if column is None:
            return
        odd = next(r for r, row in enumerate(got) if row[column] != got[rank][column])
        if column == 0:
            names = {v: k for k, v in _CALLS.items()}
            raise ValueError(f"rank {rank} is in {what} but rank {odd} is in {names.get(got[odd][0], 'another call')}: "
                             f"every rank must make the same calls ({', '.join(_CALLS)}) in the same order")
        name = list(fields)[column - 1]
        describe = (facts or {}).get(name)
        if describe is None:
            detail = f"{got[rank][column]} here, {got[odd][column]} on rank {odd}"
        else:  # every rank found the same column: they all exchange that field's facts
            everyone = _all_gather_object(list(describe()), group)
            odd = next((r for r, theirs in enumerate(everyone) if theirs != everyone[rank]), odd)
            detail = _first_difference(everyone[rank], everyone[odd], odd)
        raise ValueError(f"rank {rank} and rank {odd} differ in {name} at {what} ({detail}): every rank must "
                         "build the same optimizer and make the same calls")

    return verify


def _all_gather_object(obj: Any, group: Any) -> list[Any]:
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _first_difference(mine: Facts, theirs: Facts, odd: int) -> str:
    """``param group 0's lr is 0.001 here and 0.002 on rank 1``: the first fact that differs."""
    for (label, a), (other, b) in zip(mine, theirs):
        if label != other:
            return f"{label} here where rank {odd} has {other}"
        if a != b:
            return f"{label} is {a!r} here and {b!r} on rank {odd}"
    if len(mine) != len(theirs):
        extra, where = (mine[len(theirs)][0], "here only") if len(mine) > len(theirs) else \
            (theirs[len(mine)][0], f"on rank {odd} only")
        return f"{extra} exists {where}"
    return "their details agree as exchanged"


_CALLS: dict[str, int] = {"step": 1, "add_param_group": 2, "consolidate_state_dict": 3}
class _TensorSlot:
    """Stands in for a tensor in a pickled skeleton: its position in the flat payload."""

    __slots__ = ("dtype", "shape", "offset")

    def __init__(self, dtype: torch.dtype, shape: torch.Size, offset: int):
        self.dtype, self.shape, self.offset = dtype, tuple(shape), offset


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
