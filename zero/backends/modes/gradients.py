"""`Gradients`: where a mode's gradients are, and what ``zero_grad``, ``no_sync``, ``Join`` and the
non-finite check mean for them. Every mode has one (``mode.gradients``), chosen with the mode.

It is handed the rank's `RankState` (what the rank holds), never the mode: it says what it holds
(`settled`, `pieces`), and the mode puts the gradients where it steps them. This base is DDP's:
the params' ``.grad`` hold the averaged gradients on every rank. `CopiedGradients` adds the
shard-sized tensors a flat mode copies DDP's pieces into; `ReducedGradients` reduces them
itself, in place of DDP (ZeRO-2), by a `zero.backends.grads.GradientSource`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from zero.backends import comm
from zero.backends.grads.source import GradientSource
from zero.backends.rank_state import RankState
from zero.functional.adapters.nonfinite import all_finite
from zero.plans.meta import ParamMeta

__all__ = ["Gradients", "CopiedGradients", "ReducedGradients", "no_accumulation"]

# each shard's mean gradient, and each owned whole param's (by param index) where the mode keeps them
Settled = tuple[list[torch.Tensor], dict[int, torch.Tensor]]


class Gradients:
    """DDP's gradients: the params' ``.grad`` hold the averaged gradients on every rank."""

    scaler_sees_grads = True  # the params' .grad are the gradients stepped, as a GradScaler reads them
    checks_local = False  # the gradients checked for NaN and inf are this rank's own, before their reduction
    outputs: list[torch.Tensor] | None = None  # the shards' gradient tensors, where a flat mode has shards

    def __init__(self, state: RankState):
        self.state = state

    def settled(self) -> Settled | None:
        """Every reduction waited for: each shard's mean gradient and each owned whole param's,
        or None where DDP's are on the params."""
        return None

    def current(self) -> Settled | None:
        """What `settled` gives, without ending anything a finished iteration left (None: DDP's)."""
        return None

    def end(self) -> None:
        """After a step (its gradients taken), or an error."""

    def start_pending(self) -> None:
        """Before the step's check-in: start the reductions backward left pending (only where the
        gradients are reduced here), so every rank issues the same collectives in order."""

    def zero_grad(self, default: Callable[[], None]) -> None:
        """``zero_grad``: torch's (``default``) unless the gradients are kept here."""
        default()

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward passes inside only accumulate: where the gradients are reduced here."""
        return no_accumulation()

    def check_join(self) -> None:
        """``NotImplementedError`` if a rank that ran out of inputs cannot shadow these gradients."""

    def held_tensors(self) -> list[torch.Tensor]:
        """The gradient tensors held here rather than on the params' ``.grad`` (their memory)."""
        return list(self.outputs or ())

    def pieces(self) -> list[tuple[int, torch.Tensor]]:
        """``(param, gradient piece)`` of each piece of a param this rank steps, averaged, as the
        step reads it: here from the params' ``.grad``."""
        out, params = [], self.state.params
        for i, start, end, whole in self.state.holdings.spans:
            grad = params[i].grad
            if grad is not None:
                out.append((i, grad if whole else grad.reshape(-1)[start:end]))
        return out

    def local_nonfinite(self) -> bool:
        """Whether the gradients this rank checks hold NaN or inf (one pass over them)."""
        return not all_finite([g for _, g in self.pieces()])

    def nonfinite_params(self) -> list[int]:
        """The params whose averaged gradients, in the pieces this rank steps, hold NaN or inf."""
        return sorted({i for i, g in self.pieces() if not all_finite([g])})


class CopiedGradients(Gradients):
    """DDP's gradients under a flat plan: the mode copies the pieces of the params' ``.grad`` that
    fall in each shard into a shard-sized tensor (``outputs``) and steps the shard with it."""

    def __init__(self, state: RankState, shards: list[torch.Tensor]):
        super().__init__(state)
        self.outputs = [torch.zeros_like(s) for s in shards]


class ReducedGradients(Gradients):
    """Gradients averaged here, in place of DDP, by a `GradientSource` during backward: the shards'
    reduce-scattered, and a hybrid plan's whole params' each summed into its owner, who keeps it
    (the other ranks drop theirs).

    Params start from rank 0's (as DDP's do). Until the first step, a DDP model around these
    params is a ``ValueError`` at its forward: it would all-reduce the gradients a second time.
    """

    scaler_sees_grads = False  # a rank holds only its shards' reduced gradients

    def __init__(self, state: RankState, metas: list[ParamMeta], flats: list[torch.Tensor],
                 reduce_dtype: torch.dtype | None = None, find_unused: bool = False,
                 reducer: comm.Reducer | None = None):
        super().__init__(state)
        params, group, plan = state.params, state.process_group, state.plan
        self.whole = plan.whole
        with torch.no_grad():  # start from rank 0's params, as DDP does
            for flat in flats:
                comm.broadcast_from(flat, 0, group)
            for p, m in zip(params, metas):
                if not m.requires_grad:
                    comm.broadcast_from(p.data, 0, group)
            for i in plan.whole:
                comm.broadcast_from(params[i].data, 0, group)
        self.source = GradientSource(params, metas, plan.flat, group, whole=plan.whole,
                                     owner=plan.partition.owner if plan.whole else (), rank=state.rank,
                                     reduce_dtype=reduce_dtype, find_unused=find_unused, reducer=reducer)
        self.ddp_watch = register_module_forward_pre_hook(_refuse_ddp({id(p) for p in params}))
        weakref.finalize(self, self.ddp_watch.remove)  # an optimizer dropped before stepping leaves no hook

    @property
    def outputs(self) -> list[torch.Tensor]:
        """This rank's shard of each buffer's mean gradient, where the source lands it."""
        return self.source.outputs

    def start_pending(self) -> None:
        self.source.start_pending()

    def settled(self) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """Every reduction of the iteration waited for (`GradientSource.settle`): the shards'
        means and the owned whole params' (clipped in place, or taken by the step)."""
        self.ddp_watch.remove()
        return self.source.settle()

    def current(self) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        return self.settled() if not self.source.idle else (self.source.outputs, self.source.kept)

    def end(self) -> None:
        """After a step that took the shards' gradients itself (pipelined), or an error."""
        self.source.end_iteration()

    def zero_grad(self, default: Callable[[], None]) -> None:
        """The shards' gradients are zeroed in place and the kept ones dropped (the params hold
        none); a hybrid plan's whole params' as torch zeroes them."""
        if self.whole:
            default()
        self.source.zero_grads()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate the whole gradients (as ``DDP.no_sync``); the
        first backward after it reduces the sum: less traffic, the whole gradient in memory."""
        with self.source.no_sync():
            yield

    def check_join(self) -> None:
        raise NotImplementedError("Join with reduce_scatter_grads=True: a joined rank would have to shadow "
                                  "the gradients' reductions too; use DDP + Join for uneven inputs")

    checks_local = True  # each rank checks its own gradients as their buckets are reduced

    def local_nonfinite(self) -> bool:
        return self.source.engine.local_nonfinite()

    def held_tensors(self) -> list[torch.Tensor]:
        """The shards' gradients and the owned whole params' means kept (every reduction waited for)."""
        outputs, kept = self.current()
        return [*outputs, *kept.values()]

    def pieces(self) -> list[tuple[int, torch.Tensor]]:
        """The reduced gradients, by the pieces of params in them (reductions in flight waited for)."""
        outputs, kept = self.current()
        held, out = self.state.holdings, []
        for h in held.held:
            t = held.tensors[h.local]
            if not t.whole:
                out.append((h.param, outputs[t.buffer][h.offset:h.offset + h.end - h.start]))
            elif h.param in kept:
                out.append((h.param, kept[h.param].reshape(-1)[h.start:h.end]))
        return out


@contextlib.contextmanager
def no_accumulation() -> Iterator[None]:
    """``no_sync`` where gradients are DDP's to reduce, not the optimizer's: an error saying so."""
    raise RuntimeError("no_sync() is for reduce_scatter_grads=True; with DDP use ddp_model.no_sync()")
    yield  # pragma: no cover


def _refuse_ddp(ids: set[int]) -> Callable:
    """A global forward pre-hook: ``ValueError`` when a DDP model over any of these params runs."""
    def hook(module: nn.Module, args: Any) -> None:
        if isinstance(module, DistributedDataParallel) and any(id(p) in ids for p in module.module.parameters()):
            raise ValueError("reduce_scatter_grads=True averages the gradients itself, but these params are also in a "
                             "DistributedDataParallel model, which would all-reduce them again (the gradients would "
                             "cross the network twice): run the bare model (ddp.module), or keep DDP and drop "
                             "reduce_scatter_grads")

    return hook
