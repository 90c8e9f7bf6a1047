"""Which leaves a whole-matrix rule takes, and how it reads them, by dimension numbers (Muon's
``muon_weight_dimension_numbers``, SOAP's and Shampoo's ``weight_dimension_numbers``): one
`MuonDimensionNumbers` for all, a tree of them (None: the leaf is not the rule's), or a function
of the params returning one; and the check that a hybrid plan's flat shards hold no labelled
param's pieces (`check_cut`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from zero.functional import sharding
from zero.functional.contrib.newton_schulz import MuonDimensionNumbers, is_dimension_numbers, split_axes
from zero.functional.sharding.context import sharded
from zero.functional.transforms.masking import MaskedNode

__all__ = ["DimensionNumbers", "dims_per_leaf", "local_dims", "check_cut", "check_labelled"]

DimensionNumbers = MuonDimensionNumbers | Any | Callable[[Any], Any] | None


def _is_dims_leaf(x: Any) -> bool:
    return x is None or is_dimension_numbers(x)


def _unmasked(tree: Any) -> Any:
    """``tree`` as a dimension-numbers function expects it: the leaves `muon` routes elsewhere
    (`MaskedNode` here, where Optax shows them too) as empty 1-D tensors, which such a function
    reads as "not a matrix", so ``lambda t: {n: ... p.ndim == 2 ...}`` works on masked trees."""
    return optree.tree_map(lambda x: torch.empty(0) if isinstance(x, MaskedNode) else x, tree,
                           is_leaf=lambda x: isinstance(x, MaskedNode))


def _pieces(tree: Any) -> tuple | None:
    """The pieces this sharded step's leaves of ``tree`` hold, when some are pieces of params
    (a flat plan's shards, FSDP2's rows); None for whole leaves, or a tree not of the step's leaves."""
    leaves = optree.tree_leaves(tree)
    if not leaves or len(leaves) != len(optree.tree_leaves(tree, none_is_leaf=True)):
        return None
    try:
        cut = sharding.cut_tensors(leaves)
        return sharded(leaves, "dimension numbers")[1] if cut is not None and any(cut) else None
    except ValueError:  # not the stepped params' own leaves: asked as they are
        return None


def dims_per_leaf(dimension_numbers: DimensionNumbers, tree: Any) -> list:
    """For each leaf of ``tree`` (in order), its dimension numbers or None: ``dimension_numbers``
    is one `MuonDimensionNumbers` for all, a tree of them (a prefix of ``tree``; None marks
    leaves that are not Muon's), or a function of ``tree`` returning one.

    A function is asked about whole params: where a sharded step holds pieces, it is asked about
    the whole tensors by name (`sharding.whole_tree`) and each leaf takes its param's answer (a
    function reading shapes would read a piece's), a flat shard of several params None."""
    pieces = _pieces(tree) if callable(dimension_numbers) else None
    if pieces is not None:
        whole, order = sharding.whole_tree()
        of = dict(zip(order, local_dims(dimension_numbers, whole)))
        return [of[pc.tensors[0]] if len(pc.tensors) == 1 else None for pc in pieces]
    return local_dims(dimension_numbers, tree)


def local_dims(dimension_numbers: DimensionNumbers, tree: Any) -> list:
    """`dims_per_leaf` of ``tree`` as it is (its leaves' own names and shapes)."""
    n = len(optree.tree_leaves(tree, none_is_leaf=True))
    if n == 0:
        return []  # nothing to label (a branch every leaf of which is masked)
    if callable(dimension_numbers) and isinstance(tree, (list, tuple)) and _pieces(tree) is not None:
        return [None] * n  # a flat plan's shards: no names to ask by (check_cut refuses a labelled param cut)
    dims = dimension_numbers(_unmasked(tree)) if callable(dimension_numbers) else dimension_numbers
    if _is_dims_leaf(dims):  # one for all (torch.compile cannot trace optree's broadcast)
        return [dims] * n
    if isinstance(dims, dict) and isinstance(tree, dict) and set(tree) < set(dims):
        dims = {k: dims[k] for k in tree}  # a rank's own params of a dict by name (an owner's, under FSDP2)
    full = optree.tree_broadcast_prefix(dims, tree, is_leaf=_is_dims_leaf, none_is_leaf=True)
    return optree.tree_leaves(full, is_leaf=_is_dims_leaf, none_is_leaf=True)


def check_cut(dimension_numbers: DimensionNumbers, tree: Any, cut: list[tuple[int, ...]],
              what: str = "muon_weight_dimension_numbers", role: str = "a Muon weight",
              others: str = "shards step with AdamW", pieces_ok: Callable[[Any], bool] | None = None) -> None:
    """Under a hybrid plan: no flat shard may be labelled (``role``), nor hold a piece of a param
    the dimension numbers (``what``: a function of the params, asked about every whole param by
    name) label. ``ValueError`` naming it, else the shard's pieces would step unlabelled. Labels
    for which ``pieces_ok`` is true may hold pieces (per-head Muon's heads: the rule checks that
    each piece is whole heads)."""
    ok = pieces_ok or (lambda d: False)
    by_name = isinstance(dimension_numbers, dict) and isinstance(tree, dict) and set(tree) <= set(dimension_numbers)
    if not callable(dimension_numbers) and not by_name:
        raise ValueError(f"{what} as a tree labels leaves by position, but this sharded step holds some "
                         "params in pieces (a hybrid plan's flat shards, FSDP2's rows): pass a function of the "
                         "params' tree, which is asked by name")
    whole, order = sharding.whole_tree()
    whole_dims = local_dims(dimension_numbers, whole)
    of = dict(zip(order, whole_dims))
    # a piece of one param is labelled as its param (asked whole, by name: a function may read shapes);
    # a flat shard of several, as the function labels the shard itself
    leaf_dims = [of[ts[0]] if len(ts) == 1 else d for d, ts in zip(local_dims(dimension_numbers, tree), cut)]
    # Found on the ranks holding the pieces only: refused on every rank at the rule's whole-tensor
    # check (`sharding.defer_refusal`), which every rank reaches, so none waits on the others
    for d, ts in zip(leaf_dims, cut):
        if ts and d is not None and not ok(d):
            return sharding.defer_refusal(ts, f"{what} labels a shard (pieces of params "
                                          f"{', '.join(map(sharding.name_of, ts))}) as {role}: "
                                          f"{sharding.whole_hint()}; {others}")
    labelled = {t for t, d in zip(order, whole_dims) if d is not None}
    for d, ts in zip(leaf_dims, cut):
        # a piece may step labelled only as itself: a leaf of one tensor, labelled as it is (FSDP2's rows of
        # heads); a flat shard's piece of a labelled param would step with the others' rule
        own = len(ts) == 1 and d is not None and ok(d)
        for t in ts:
            if t in labelled and not own:
                return sharding.defer_refusal((t,), f"{what} makes param {sharding.name_of(t)} {role}, but this "
                                              f"step holds it in pieces: {sharding.whole_hint()}")


def check_labelled(dims: list, tree: Any, what: str = "muon_weight_dimension_numbers",
                   role: str = "a Muon weight") -> None:
    """`sharding.ParamsRefused` (a ``ValueError``) naming the first leaf of ``tree`` (whole tensors)
    that ``dims`` (per leaf) labels but that is no matrix under them: rank < 2, or reduction and
    output axes that overlap (the rule's own check would fail later, on a shape without a name).
    Raised while a plan asks the rule on meta tensors too, so a sharded optimizer refuses it when built."""
    leaves = optree.tree_leaves(tree, none_is_leaf=True)
    for j, (leaf, d) in enumerate(zip(leaves, dims)):
        if d is None or not isinstance(leaf, torch.Tensor):
            continue
        try:
            if leaf.ndim < 2:
                raise ValueError(f"it has rank {leaf.ndim}, and the rule reads a matrix")
            split_axes(leaf.shape, d)
        except ValueError as e:
            name = ".".join(map(str, optree.tree_paths(tree, none_is_leaf=True)[j]))
            raise sharding.ParamsRefused(
                f"{what} labels {name!r} (shape {tuple(leaf.shape)}) as {role}, but {e}: give it None (it then "
                "steps with the rule's element-wise part)") from None
