"""The protocol every rule's cost model answers (`RuleCost`), and the element-wise family."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zero.plans.meta import ParamMeta

__all__ = ["RuleCost", "Elementwise", "heads_by_name", "heads_of"]


@dataclass(frozen=True)
class RuleCost:
    """What a rule costs per parameter, as the plans ask it: the state it keeps (`state_bytes`,
    `shard_state_bytes`, `moved_bytes`), the work of its step (`step_flops`), whether a param must
    be stepped whole (`whole`), and the block its state is quantized in (`block_for`).

    Read by the executor's footprint too: the temporaries torch's for-loop step makes at once, in
    tensors the size of the one it steps (``step_temps``: Adam's ``exp_avg_sq.sqrt()`` and its
    quotient, a coupled decay's ``grad.add(param)``), those of the tensor before it still alive
    (``step_temps_held``: Adam's ``denom``, until reassigned), and the most elements a step takes
    of a tensor at a time (``step_chunk``, 0: all; its temporaries then in float32); under torch's foreach step,
    where zero runs it, ``foreach_temps`` of every tensor one call steps.

    A rule that sums over the whole model each step (Prodigy) says how many all-reduces that takes
    when sharded (``step_reductions``): a few scalars each, never a gathered tensor.

    This base is the element-wise family: ``slots`` param-shaped state tensors in the state's dtype
    and ``scalar_bytes`` of per-parameter scalars (Adam's float32 ``step``), every param stepped
    element by element, nothing quantized.
    """

    slots: int
    scalar_bytes: int = 0
    step_temps: int = 2
    step_temps_held: int = 1
    step_chunk: int = 0
    # the temporaries torch's foreach step makes at once, in tensors the size of each tensor one
    # call steps (Adam's ``_foreach_sqrt``: 1); None: zero never runs the rule's foreach step
    # (`zero.plans.local_step.takes_foreach` says where it does)
    foreach_temps: int | None = None
    # all-reduces of a few scalars one step makes when its params are sharded, for sums over the
    # whole model (Prodigy's two sums ride in one: 1); element-wise rules make none
    step_reductions: int = 0

    keeps_whole = False  # whether the family steps some params whole (a plan then keeps them whole)

    def slots_for(self, meta: ParamMeta) -> int:
        """Param-shaped state tensors ``meta`` holds when trainable."""
        return self.slots

    def state_bytes(self, meta: ParamMeta, itemsize: int) -> int:
        """Bytes of state of trainable param ``meta``, its tensors at ``itemsize`` bytes an element."""
        return self.slots_for(meta) * meta.numel * itemsize + self.scalar_bytes

    def shard_state_bytes(self, numel: int, itemsize: int, block: int = 0) -> int:
        """Bytes of state of a flat shard of ``numel`` elements (one set of tensors per shard),
        cut at blocks of ``block`` (0: no quantized state)."""
        return self.slots * numel * itemsize + self.scalar_bytes

    def moved_bytes(self, meta: ParamMeta, count: int, itemsize: int) -> int:
        """Bytes of state that travel with ``count`` elements of ``meta`` moving between ranks."""
        return count * self.slots_for(meta) * itemsize

    def step_flops(self, meta: ParamMeta) -> int:
        """Floating-point operations of one step of ``meta`` (0 when frozen): its elements."""
        return meta.numel if meta.requires_grad else 0

    def whole(self, meta: ParamMeta) -> bool:
        """Whether ``meta`` must be stepped whole (never in a flat shard's pieces)."""
        return False

    def block_for(self, meta: ParamMeta) -> int:
        """The quantization block of ``meta``'s state, 0 when it keeps full precision."""
        return 0

    def head_block(self, meta: ParamMeta) -> int:
        """The elements of one head of ``meta`` when the rule steps it head by head along its
        first axis (per-head Muon), so that whole heads of it can be stepped apart; else 0."""
        return 0


Elementwise = RuleCost  # the family's name in the registry


def heads_by_name(heads: object) -> tuple[tuple[str, int], ...]:
    """A cost's ``heads`` setting as the frozen models keep it: ``{"layers.0.wq": 32}`` as a user
    writes it, or the pairs themselves, sorted."""
    return tuple(sorted(heads.items())) if isinstance(heads, Mapping) else tuple(heads)


def heads_of(heads: tuple[tuple[str, int], ...], meta: ParamMeta) -> int:
    """The heads ``heads`` gives param ``meta`` (by name, in any case: a plan keeps its optimizer's
    name lowercased), 1 for a param it does not name."""
    return {k.lower(): h for k, h in heads}.get(meta.name.lower(), 1)
