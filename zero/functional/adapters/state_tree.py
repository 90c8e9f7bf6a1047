"""A transformation's state as a tree of leaves per param: cut into parts (`split_state`), mapped
(`map_state_leaves`) or listed (`state_leaves`) with each leaf's key and the param it belongs to.
The checkpoint code reads states through these.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["split_state", "map_state_leaves", "state_leaves", "as_tree"]


def split_state(state: Any, n: int, parts: list[list[int]]) -> list[Any]:
    """Cut the state of a transformation initialised on ``n`` params into one state per part.

    Per-param entries are the lists of length ``n`` (a state mirrors the params list it was made
    for); everything else (step counts, hyperparameters) is copied into every part, tensors cloned
    so that the parts step independently. Meaningful only for rules that treat params alone.
    """
    def cut(node: Any, part: list[int]) -> Any:
        if isinstance(node, list) and len(node) == n:
            return [node[i] for i in part]
        if isinstance(node, tuple):
            items = [cut(x, part) for x in node]
            return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
        if isinstance(node, dict):
            return {k: cut(v, part) for k, v in node.items()}
        return node.clone() if isinstance(node, torch.Tensor) else node
    return [cut(state, part) for part in parts]


def map_state_leaves(state: Any, n: int, fn: Any, names: list[str] | None = None) -> Any:
    """``state`` (of a transformation initialised on ``n`` params) with each leaf replaced by
    ``fn(key, position, leaf)``: ``key`` is the leaf's path, dotted (NamedTuple fields by name);
    ``position`` the index of the param a per-param leaf belongs to (the lists of length ``n``,
    as `split_state` reads them, or with ``names`` the dicts by those names), None for leaves the
    params share (counts, hyperparameters)."""
    def walk(node: Any, path: tuple[str, ...], pos: int | None) -> Any:
        if isinstance(node, list) and len(node) == n and pos is None:
            return [walk(x, path, i) for i, x in enumerate(node)]
        if names is not None and isinstance(node, dict) and pos is None and set(node) == set(names):
            return {k: walk(x, path, names.index(k)) for k, x in node.items()}
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*[walk(x, path + (f,), pos) for f, x in zip(node._fields, node)])
        if isinstance(node, (tuple, list)):
            return type(node)(walk(x, path + (str(i),), pos) for i, x in enumerate(node))
        if isinstance(node, dict):
            return {k: walk(x, path + (str(k),), pos) for k, x in node.items()}
        return fn(".".join(path) or "state", pos, node)
    return walk(state, (), None)


def state_leaves(state: Any, n: int, names: list[str] | None = None) -> list[tuple[str, int | None, Any]]:
    """``(key, position, leaf)`` of every leaf of ``state``, as `map_state_leaves` names them."""
    out: list[tuple[str, int | None, Any]] = []
    map_state_leaves(state, n, lambda key, pos, leaf: out.append((key, pos, leaf)), names)
    return out


def as_tree(params: list, names: list[str] | None) -> Any:
    """The tree a transformation steps: the list of params, or a dict by name when named."""
    return params if names is None else dict(zip(names, params))
