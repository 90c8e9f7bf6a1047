"""Low-bit state in blocks no plan changes: which leaves a blockwise-quantized rule quantizes
(`quantized`, checked against the plan's cuts) and the probe that asks a rule its blocks
(`block_sizes`, on meta tensors)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import torch

from zero.functional.sharding.context import SHARDING, Sharding, current, name_of

__all__ = ["quantized", "block_sizes"]


_BLOCKS: ContextVar[dict[int, tuple[int, int]] | None] = ContextVar("zero_block_probe", default=None)  # see block_sizes


def quantized(leaves: Sequence[torch.Tensor], block: int, quantizes: Callable[[int], bool], what: str,
              bits: int = 8) -> list[bool]:
    """Per leaf, whether a rule that keeps state quantized in blocks of ``block`` elements (in
    each whole tensor's own element order) quantizes that leaf's: ``quantizes(numel)`` of the
    *whole* tensor it is, or holds pieces of, so that no plan changes which state a param gets.

    A leaf holding pieces (a flat plan's shard) can be quantized only if the plan cut its buffer
    at block edges (`Pieces.block`, from ``zero.make_plan(..., optimizer="adamw8bit")``): each
    block then lies whole in one leaf, and the leaf's blocks are its tensors' blocks. A shard
    that holds pieces of a param to quantize in a buffer cut otherwise is a ``ValueError`` naming
    the param. Asked on whole tensors by `block_sizes`, it records ``(bits, block)`` as well."""
    probe = _BLOCKS.get()
    if probe is not None:
        probe.update({id(leaf): (bits, block) for leaf in leaves if quantizes(leaf.numel())})
    sharding = current(SHARDING)
    if sharding is None or sharding.whole_params:
        return [quantizes(leaf.numel()) for leaf in leaves]
    return [_quantized_leaf(sharding, leaf, block, quantizes, what) for leaf in leaves]


def _quantized_leaf(sharding: Sharding, leaf: torch.Tensor, block: int, quantizes: Callable[[int], bool],
                    what: str) -> bool:
    pc = sharding.pieces.get(id(leaf))
    if pc is None:
        raise ValueError(f"{what} under a sharded optimizer got a tensor the backend did not register")
    if len(pc.tensors) == 1 and sharding.numels[pc.tensors[0]] == leaf.numel() == pc.used:
        return quantizes(leaf.numel())  # a whole param (a hybrid plan's): its own blocks
    wanted = [t for t in pc.tensors if quantizes(sharding.numels[t])]
    if pc.block != block and wanted:
        raise ValueError(f"{what} keeps param {name_of(wanted[0])}'s state in blocks of {block} elements, but this "
                         f"flat plan cuts its buffer {'at ' + str(pc.block) if pc.block else 'anywhere'}, so a block "
                         "could be split between ranks and its numbers change with the plan: make the plan with "
                         "zero.make_plan(..., optimizer='adamw8bit') (or '4bit', '/BLOCK'), or let "
                         "ZeroRedundancyOptimizer(..., strategy='flat') make it")
    others = [t for t in pc.tensors if t not in wanted]
    if pc.block == block and others:
        raise ValueError(f"{what}: this flat plan put param {name_of(others[0])}, whose state keeps full precision, "
                         "in a buffer cut for quantized state: it was made for another block size or threshold")
    return pc.block == block


def block_sizes(tx: Any, params: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, tuple[int, int]]:
    """The params (by name) whose state ``tx`` keeps quantized, each with its (bits, block size), asked
    of the rule itself: its ``init`` on whole ``meta`` tensors of these shapes and dtypes,
    recording what it asks `quantized`. What a flat plan must cut at block edges."""
    tree = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in params.items()}
    index = {id(t): name for name, t in tree.items()}
    found: dict[int, tuple[int, int]] = {}
    token = _BLOCKS.set(found)
    try:
        tx.init(tree)
    except Exception:  # noqa: BLE001 - a rule that cannot start on meta tensors keeps no quantized state we can see
        return {}
    finally:
        _BLOCKS.reset(token)
    return {index[i]: b for i, b in found.items() if i in index}
