"""Running a rule's maths on lists of tensors, with many small CPU tensors packed into one.

A rule's ``update`` writes its maths once, over lists of tensors with ``torch._foreach_*`` ops
(`foreach_map`). On CPU a foreach op is a loop that dispatches one op per tensor, about 2-3 us
each: 2,000 small tensors cost milliseconds per op whatever their size. So the small leaves of
each list are packed into one flat tensor before the maths runs and cut back into leaves after:
the maths then dispatches once for all of them. Leaves that are already consecutive
views of one buffer, as every output of a previous packed step is, pack without a copy; only
fresh inputs (the gradients) are copied. Large leaves, and every leaf on an accelerator (where
foreach ops are multi-tensor kernels), stay as they are; a call whose small leaves are not all
CPU tensors of one dtype per list runs unpacked.

Elementwise maths gives the same numbers either way: packing changes which tensors hold the
elements, not what is computed for each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["PACK_NUMEL", "foreach_map", "map_lists", "elementwise_map"]

# A leaf of at most this many elements is packed: copying it into a flat buffer (about 1 ns per
# element) costs less than the per-tensor dispatches it saves across a rule's ops.
PACK_NUMEL = 16384


def foreach_map(fn: Callable[..., Any], tree: Any, *rest: Any, outputs: int = 1) -> Any:
    """``fn`` on the leaves of ``tree`` and of ``rest`` (trees of the same structure), as lists.

    ``fn`` takes one list of tensors per tree and returns a sequence of tensors, or with
    ``outputs=k`` a tuple of ``k`` sequences; each becomes a tree like ``tree``. Its maths must be
    elementwise: the lists it gets may hold packed flat tensors instead of the leaves (see the
    module's docstring). Without leaves, ``fn`` is not called (foreach ops refuse empty lists).
    """
    leaves, treedef = optree.tree_flatten(tree)
    return map_lists(fn, treedef, [leaves] + [treedef.flatten_up_to(other) for other in rest], outputs)


def map_lists(fn: Callable[..., Any], treedef: Any, lists: list[list[Any]], outputs: int = 1) -> Any:
    """`foreach_map` given the trees already flattened: ``lists`` of leaves in ``treedef``'s order."""
    leaves = lists[0]
    if not leaves:
        empty = optree.tree_unflatten(treedef, [])
        return empty if outputs == 1 else (empty,) * outputs
    packing = _Packing.of(leaves)
    packed = None if packing is None else packing.pack(lists)
    result = fn(*(lists if packed is None else packed))
    results = [result] if outputs == 1 else list(result)
    if packed is not None:
        cut: dict[int, list] = {}  # one cut per distinct output list: a rule may return one list twice
        for out in results:
            if id(out) not in cut:
                cut[id(out)] = packing.unpack(out)
        results = [cut[id(out)] for out in results]
    trees = [optree.tree_unflatten(treedef, list(out)) for out in results]
    return trees[0] if outputs == 1 else tuple(trees)


def elementwise_map(fn: Callable[..., torch.Tensor], tree: Any, *rest: Any) -> Any:
    """``tree_map(fn, tree, *rest)`` for an elementwise ``fn`` of single tensors, run on packed
    tensors where `foreach_map` packs (few dispatches for many small leaves)."""
    return foreach_map(lambda *lists: [fn(*xs) for xs in zip(*lists)], tree, *rest)


class _Packing:
    """Which leaves are packed (the small ones, in order), and how to pack and cut lists of them.

    A list is packed when its small leaves are CPU tensors of one dtype, of the sizes of the
    first list's; else the whole call runs unpacked (mixed dtypes within a tree, accelerators,
    leaves autograd tracks). This runs at every update, so it reads few attributes per leaf.
    """

    def __init__(self, leaves: list[torch.Tensor], small: list[int], sizes: list[int]):
        self.leaves, self.small, self.sizes = leaves, small, sizes
        small_set = set(small)
        self.alone = [i for i in range(len(leaves)) if i not in small_set]
        self.one_dim = all(leaves[i].dim() == 1 for i in small)

    @classmethod
    def of(cls, leaves: list[Any]) -> _Packing | None:
        """The packing for lists like ``leaves``, or ``None`` when fewer than two leaves are small."""
        if len(leaves) < 2 or not all(isinstance(t, torch.Tensor) for t in leaves):
            return None
        numels = [t.numel() for t in leaves]
        small = [i for i, n in enumerate(numels) if 0 < n <= PACK_NUMEL]
        if len(small) < 2:
            return None
        return cls(leaves, small, [numels[i] for i in small])

    def pack(self, lists: Sequence[Sequence[Any]]) -> list[list[torch.Tensor]] | None:
        """Each list as one flat tensor of its small leaves, then its other leaves; ``None`` when
        a list cannot be packed."""
        packed = []
        for ts in lists:
            flat = self._flat([ts[i] for i in self.small])
            if flat is None:
                return None
            packed.append([flat] + [ts[i] for i in self.alone])
        return packed

    def unpack(self, packed: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The leaves back from `pack`'s layout: views of the flat tensor, in the leaves' shapes."""
        if len(packed) != 1 + len(self.alone):
            raise ValueError(f"a packed rule returned {len(packed)} tensors for {1 + len(self.alone)} packed inputs")
        out: list[Any] = [None] * len(self.leaves)
        if self.one_dim:  # one split: a single op for any number of leaves
            pieces = packed[0].split(self.sizes)
        else:  # views shaped like the leaves, made in one C++ loop (a Python view per leaf costs 3x more)
            pieces = _unflatten_dense_tensors(packed[0], [self.leaves[i] for i in self.small])
        for i, piece in zip(self.small, pieces):
            out[i] = piece
        for i, t in zip(self.alone, packed[1:]):
            out[i] = t
        return out

    def _flat(self, leaves: list[Any]) -> torch.Tensor | None:
        """``leaves`` as one 1-D tensor: a view when they lie back to back in memory in order (the
        outputs of a packed step do), else a copy; ``None`` when they are unfit to pack."""
        head = leaves[0]
        if not isinstance(head, torch.Tensor) or not head.is_cpu:
            return None
        grad = torch.is_grad_enabled()
        if grad and head.requires_grad:
            return None  # differentiating through an update: leave autograd the leaves
        width, at = head.element_size(), head.data_ptr()
        try:
            for t, n in zip(leaves, self.sizes):
                if t.data_ptr() != at or not t.is_contiguous():
                    break
                at += n * width
            else:
                return head.as_strided((sum(self.sizes),), (1,))
        except (AttributeError, RuntimeError):
            pass  # a leaf that is not a tensor (refused below), or neighbours not in one storage
        try:
            if [t.numel() for t in leaves] != self.sizes or len({t.dtype for t in leaves}) != 1:
                return None
        except AttributeError:  # a leaf that is not a tensor
            return None
        flat = torch.cat(leaves) if self.one_dim else _flatten_dense_tensors(leaves)
        return None if flat.device.type != "cpu" or (grad and flat.requires_grad) else flat
