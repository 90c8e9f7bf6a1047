"""Layouts: a transformation run on the params flattened into one vector (``optax.flatten``)."""

from __future__ import annotations

import optree
import torch

from zero.functional.base import GradientTransformation, update_with

__all__ = ["flatten"]


def _flat(tree) -> torch.Tensor:
    leaves = optree.tree_leaves(tree)
    return torch.cat([x.reshape(-1) for x in leaves]) if leaves else torch.zeros(0)


def _unflat(like, flat: torch.Tensor):
    leaves, treedef = optree.tree_flatten(like)
    parts = torch.split(flat, [x.numel() for x in leaves]) if leaves else []
    return treedef.unflatten([p.view_as(x) for p, x in zip(parts, leaves)])


def flatten(inner: GradientTransformation) -> GradientTransformation:
    """``inner`` on one vector of every leaf, flattened and joined, its updates split back into the
    tree (``optax.flatten``): fewer, larger ops for a rule over many small tensors. Under a sharded
    optimizer ``inner`` sees one leaf for the rank's pieces, so a rule that asks about whole
    tensors (a global norm) is refused there by name; element-wise rules step the same."""

    def init(params):
        return inner.init(_flat(params))

    def update(updates, state, params=None, **extra_args):
        flat_params = None if params is None else _flat(params)
        out, state = update_with(inner, _flat(updates), state, flat_params, extra_args)
        return _unflat(updates, out), state

    return GradientTransformation(init, update)
