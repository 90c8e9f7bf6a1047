"""Whole tensors for the params an owner steps (`zero.plans.fsdp2`): every rank's piece of each
param and its gradient to the owner, and each rank's piece of the updated param back, in one
exchange (an all-to-all of uneven chunks) per direction per dtype; whole heads for the per-head
params FSDP2 cut inside heads (`to_head_steppers`, `back_from_head_steppers`: only the rows of the
cut heads move, to and from the rank that steps each); and, for a plan over HSDP's replicas, each
replica's updated parts to the others, in one all-gather per dtype."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zero.backends import comm
from zero.plans.fsdp2 import HEADS, Fsdp2Plan

__all__ = ["to_owners", "back_from_owners", "to_head_steppers", "back_from_head_steppers", "gather_replicas"]


def to_owners(plan: Fsdp2Plan, rank: int, group: Any, ts: Sequence[int], params: dict[int, torch.Tensor],
              grads: dict[int, torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """For each param ``t`` of ``ts`` this rank owns: the whole param and gradient, from every
    rank's pieces (``params[t]``, ``grads[t]``: this rank's local tensors of every ``t``)."""
    out = {}
    for these in _by_dtype(plan, ts).values():
        chunks = [torch.cat([x.reshape(-1) for t in these if plan.owner[t] == o for x in (params[t], grads[t])]
                            or [params[these[0]].new_empty(0)]) for o in range(plan.world_size)]
        mine = [t for t in these if plan.owner[t] == rank]
        splits = [sum(2 * plan.local_numel(t, r) for t in mine) for r in range(plan.world_size)]
        got = torch.empty(sum(splits), dtype=chunks[0].dtype, device=chunks[0].device)
        comm.exchange(got, torch.cat(chunks), splits, [c.numel() for c in chunks], group)
        out.update(_assemble(plan, mine, got.split(splits)))
    return out


def back_from_owners(plan: Fsdp2Plan, rank: int, group: Any, ts: Sequence[int],
                     wholes: dict[int, torch.Tensor], params: dict[int, torch.Tensor]) -> None:
    """Each rank's piece of every updated whole param of ``ts`` from its owner into ``params[t]``
    (this rank's local tensors); ``wholes``: the params this rank owns, stepped."""
    for these in _by_dtype(plan, ts).values():
        mine = [t for t in these if plan.owner[t] == rank]
        none = params[these[0]].new_empty(0)
        chunks = [torch.cat([_piece(plan, t, wholes[t], r).reshape(-1) for t in mine] or [none])
                  for r in range(plan.world_size)]
        splits = [sum(plan.local_numel(t, rank) for t in these if plan.owner[t] == o) for o in range(plan.world_size)]
        got = torch.empty(sum(splits), dtype=chunks[0].dtype, device=chunks[0].device)
        comm.exchange(got, torch.cat(chunks), splits, [c.numel() for c in chunks], group)
        pieces = iter(got.split(splits))
        for o in range(plan.world_size):
            flat, at = next(pieces), 0
            for t in (t for t in these if plan.owner[t] == o):
                n = plan.local_numel(t, rank)
                params[t].copy_(flat[at:at + n].view(params[t].shape))
                at += n


def to_head_steppers(plan: Fsdp2Plan, rank: int, group: Any, ts: Sequence[int], params: dict[int, torch.Tensor],
                     grads: dict[int, torch.Tensor] | None) -> dict[int, tuple[torch.Tensor, ...]]:
    """For each param ``t`` of ``ts`` stepped by heads (`zero.plans.fsdp2.HEADS`): the whole heads
    this rank steps (`Fsdp2Plan.head_run`), shaped ``(k * d, ...)``, and their gradient (none
    when ``grads`` is None), from this rank's rows and the rows of those heads the ranks beside it
    hold (`Fsdp2Plan.head_moves`), in one exchange per dtype."""
    out: dict[int, tuple[torch.Tensor, ...]] = {}
    sources = [params] if grads is None else [params, grads]
    for these in _heads_by_dtype(plan, ts).values():
        flat = {t: [x[t].reshape(-1) for x in sources] for t in these}
        sent, came = _moves(plan, rank, these)
        runs = {t: [f.new_empty(plan.head_run(t, rank)[1]) for f in flat[t]] for t in these}
        for t in these:  # this rank's own rows of its heads
            at, in_run, own = _own(plan, t, rank)
            for run, f in zip(runs[t], flat[t]):
                run[in_run:in_run + own] = f[at:at + own]
        none = params[these[0]].new_empty(0)
        chunks = [torch.cat([f[at - plan.start(t, rank):][:n] for t, at, n in sent[o] for f in flat[t]] or [none])
                  for o in range(plan.world_size)]
        splits = [len(sources) * sum(n for _, _, n in came[o]) for o in range(plan.world_size)]
        got = torch.empty(sum(splits), dtype=chunks[0].dtype, device=chunks[0].device)
        comm.exchange(got, torch.cat(chunks), splits, [c.numel() for c in chunks], group)
        for o, chunk in zip(range(plan.world_size), got.split(splits)):
            at = 0
            for t, start, n in came[o]:
                for run in runs[t]:
                    run[start - plan.head_run(t, rank)[0]:][:n] = chunk[at:at + n]
                    at += n
        out.update({t: tuple(r.view(-1, *plan.metas[t].shape[1:]) for r in runs[t]) for t in these})
    return out


def back_from_head_steppers(plan: Fsdp2Plan, rank: int, group: Any, ts: Sequence[int],
                            runs: dict[int, torch.Tensor], params: dict[int, torch.Tensor]) -> None:
    """The stepped heads ``runs`` (this rank's, as `to_head_steppers` gave them) into the rows of
    ``params`` (this rank's local tensors) that hold them: here, and on the ranks they came from."""
    for these in _heads_by_dtype(plan, ts).values():
        local = {t: _writable(plan, t, params[t]) for t in these}
        for t in these:
            at, in_run, own = _own(plan, t, rank)
            local[t][at:at + own] = runs[t].reshape(-1)[in_run:in_run + own]
        sent, came = _moves(plan, rank, these)  # what came to this rank goes back, what it sent returns
        none = params[these[0]].new_empty(0)
        chunks = [torch.cat([runs[t].reshape(-1)[at - plan.head_run(t, rank)[0]:][:n] for t, at, n in came[o]]
                            or [none]) for o in range(plan.world_size)]
        splits = [sum(n for _, _, n in sent[o]) for o in range(plan.world_size)]
        got = torch.empty(sum(splits), dtype=chunks[0].dtype, device=chunks[0].device)
        comm.exchange(got, torch.cat(chunks), splits, [c.numel() for c in chunks], group)
        for o, chunk in zip(range(plan.world_size), got.split(splits)):
            at = 0
            for t, start, n in sent[o]:
                local[t][start - plan.start(t, rank):][:n] = chunk[at:at + n]
                at += n


def _own(plan: Fsdp2Plan, t: int, rank: int) -> tuple[int, int, int]:
    """The elements of this rank's heads of param ``t`` it holds itself (the rest come from the
    ranks beside it): where they start in its local piece and in its heads' run, and how many."""
    at, n = plan.part(t, rank)  # the run's start in the piece: before it, or inside
    first = max(at, 0)
    return first, first - at, max(0, min(at + n, plan.local_numel(t, rank)) - first)


def _moves(plan: Fsdp2Plan, rank: int, these: Sequence[int]) -> tuple[list[list], list[list]]:
    """Per other rank ``o``: the ``(param, start, length)`` runs this rank holds and ``o`` steps
    (``sent[o]``), and those ``o`` holds and this rank steps (``came[o]``), in param order."""
    sent: list[list] = [[] for _ in range(plan.world_size)]
    came: list[list] = [[] for _ in range(plan.world_size)]
    for t in these:
        for holder, stepper, start, n in plan.head_moves(t):
            if holder == rank:
                sent[stepper].append((t, start, n))
            elif stepper == rank:
                came[holder].append((t, start, n))
    return sent, came


def _writable(plan: Fsdp2Plan, t: int, local: torch.Tensor) -> torch.Tensor:
    if not local.is_contiguous():
        raise ValueError(f"param {plan.metas[t].name!r}'s local tensor is not contiguous: the rows of its heads "
                         "stepped on other ranks cannot be written back in place")
    return local.view(-1)


def _heads_by_dtype(plan: Fsdp2Plan, ts: Sequence[int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for t in ts:
        if plan.owner[t] == HEADS:
            out.setdefault(plan.metas[t].dtype, []).append(t)
    return out


def _by_dtype(plan: Fsdp2Plan, ts: Sequence[int], every: bool = False) -> dict[str, list[int]]:
    """``ts``'s params stepped whole (``every``: all of them), by dtype."""
    out: dict[str, list[int]] = {}
    for t in ts:
        if every or plan.owner[t] >= 0:
            out.setdefault(plan.metas[t].dtype, []).append(t)
    return out


def _assemble(plan: Fsdp2Plan, mine: list[int], received: Sequence[torch.Tensor]
              ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Whole params and gradients from each rank's chunk (per owned param: its param piece,
    then its gradient piece), pieces joined along the dim FSDP2 cut."""
    parts: dict[int, list[list[torch.Tensor]]] = {t: [[], []] for t in mine}
    for r, flat in enumerate(received):
        at = 0
        for t in mine:
            n, shape = plan.local_numel(t, r), plan.local_shape(t, r)
            for k in range(2):
                parts[t][k].append(flat[at:at + n].view(shape))
                at += n
    return {t: tuple(torch.cat(p, dim=plan.dims[t]) if plan.metas[t].shape else p[0].clone() for p in parts[t])
            for t in mine}


def _piece(plan: Fsdp2Plan, t: int, whole: torch.Tensor, rank: int) -> torch.Tensor:
    if not plan.metas[t].shape:
        return whole
    start, length = plan.rows(t)[rank]
    return whole.narrow(plan.dims[t], start, length)


def gather_replicas(plan: Fsdp2Plan, rank: int, group: Any, ts: Sequence[int], params: dict[int, torch.Tensor]) -> None:
    """Every replica's updated parts of the pieces ``params`` (this rank's local tensors of the
    params ``ts``) into the others': the parts of the params stepped in parts by one all-gather
    per dtype and bucket (`Fsdp2Plan.gather_buckets`), each replica's part in its `Fsdp2Plan.slot`;
    each piece a replica's owner sent back by a broadcast from that replica."""
    shard = rank % plan.world_size
    for these in _by_dtype(plan, ts, every=True).values():
        for bucket in plan.gather_buckets(these, rank):
            _gather_bucket(plan, rank, group, bucket, {t: params[t].view(-1) for t in bucket})
        for t in (t for t in these if plan.owner[t] >= 0 and plan.local_numel(t, shard)):
            comm.broadcast_from(params[t], plan.owner[t] // plan.world_size, group)


def _gather_bucket(plan: Fsdp2Plan, rank: int, group: Any, bucket: list[int], flat: dict[int, torch.Tensor]) -> None:
    slots = [plan.slot(t, rank) for t in bucket]
    send = flat[bucket[0]].new_zeros(sum(slots))
    at = 0
    for t, slot in zip(bucket, slots):
        a, n = plan.part(t, rank)
        send[at:at + n] = flat[t][a:a + n]
        at += slot
    out = send.new_empty(plan.replicas * send.numel())
    comm.all_gather_into(out, send, group).wait()
    grid, at = out.view(plan.replicas, send.numel()), 0
    for t, slot in zip(bucket, slots):  # the replicas' slots of a param, in order, are its piece padded
        flat[t].copy_(grid[:, at:at + slot].reshape(-1)[:flat[t].numel()])
        at += slot
