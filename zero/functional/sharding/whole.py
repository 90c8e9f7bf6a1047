"""Rules that need whole tensors (Newton-Schulz, factored moments): the check that a step holds
them whole (`whole_tensors`, `cut_tensors`), the probe that asks a rule which it needs
(`needs_whole`, on meta tensors), and the step's whole tensors by name (`whole_tree`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import optree
import torch

from zero.functional.sharding.context import (
    DEFERRED,
    LEAVES,
    SHARDING,
    Pieces,
    Sharding,
    current,
    name_of,
    sharded,
    stepping_whole,
    whole_hint,
    whole_piece,
)

__all__ = ["whole_tensors", "needs_whole", "cut_tensors", "whole_tree", "asked_of", "pieces_unknown",
           "ParamsRefused", "refuse_together", "defer_refusal", "PROBE"]


PROBE: ContextVar[set[int] | None] = ContextVar("zero_whole_probe", default=None)  # see needs_whole
_PROBE = PROBE


class ParamsRefused(ValueError):
    """A rule's refusal of the params themselves (a label on a vector): raised where it is found,
    also while `needs_whole` asks the rule on meta tensors (other errors there are taken as a link
    that cannot run on meta tensors, and the step checks it)."""


def whole_tensors(leaves: Sequence[torch.Tensor], what: str,
                  needs: Callable[[tuple[int, ...]], bool] | Sequence[bool] | None = None) -> None:
    """``ValueError`` unless every leaf is a whole tensor in its own shape: for rules that read a
    tensor's shape or all its elements at once (Newton-Schulz, factored moments, per-tensor
    state), which a rank stepping pieces of tensors (a flat plan) cannot run.

    ``needs(shape)``: only tensors of such shapes must be whole; the rule treats the others
    element by element, so their pieces in a 1-D shard step as they would whole (Adafactor's
    vectors, beside the matrices it factors; a hybrid plan keeps those whole). Or ``needs`` a
    flag per leaf, for rules that decide by name (SOAP's ``weight_dimension_numbers``).
    """
    flags = None if needs is None or callable(needs) else list(needs)
    probe = current(_PROBE)
    if probe is not None:  # needs_whole is asking, on whole meta tensors: record, do not check
        probe.update(id(leaf) for j, leaf in enumerate(leaves)
                     if (flags[j] if flags is not None else needs is None or needs(tuple(leaf.shape))))
        return
    sharding = current(SHARDING)
    shapes = sharding.shapes if sharding is not None else ()
    found = cut_tensors(leaves, what)
    if found is None:  # every rank steps whole tensors (or a start outside a step: the step checks)
        return
    bad = set()
    for j, pieces_of in enumerate(found):
        if flags is not None:
            bad.update(pieces_of if flags[j] else ())
        else:
            bad.update(t for t in pieces_of if needs is None or not shapes or needs(shapes[t]))
    refuse_together(sharding, bad, f"{what} needs each tensor whole")


def defer_refusal(tensors: Sequence[int], message: str) -> None:
    """Refuse the step for ``tensors`` with ``message`` on every rank: at the step's next
    `refuse_together` (which every rank reaches), or at once outside a sharded step."""
    deferred = current(DEFERRED)
    if deferred is None:
        raise ValueError(message)
    deferred.append((tuple(tensors), message))


def refuse_together(sharding: Sharding, bad: set[int], what: str) -> None:
    """``ValueError`` on every rank when any rank found a tensor in ``bad`` (held in pieces a rule
    cannot step), or deferred a refusal (`defer_refusal`): every rank decides together, since a
    rank whose pieces are all fine would otherwise go on into the step's collectives while
    another refuses, and wait for it forever (one small all-reduce). A rank raises its own
    deferred message where it has one."""
    deferred = current(DEFERRED) or []
    found, deferred[:] = list(deferred), []
    flagged = torch.zeros(sharding.n_tensors, dtype=torch.float64)
    marked = set(bad).union(*(ts for ts, _ in found))
    if marked:
        flagged[sorted(marked)] = 1.0
    everyone = sharding.reduce(flagged)
    if bool((everyone > 0).any()):
        if found:
            raise ValueError(found[0][1])
        t = int(torch.nonzero(everyone > 0)[0])
        shape = f" of shape {sharding.shapes[t]}" if sharding.shapes else ""
        raise ValueError(f"{what}, but this sharded step holds pieces of param {name_of(t)}{shape}: {whole_hint()}")


def needs_whole(tx: Any, params: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
    """The params (by name) ``tx`` needs whole, asked of the rule itself: one ``init`` and
    ``update`` on ``meta`` tensors of these shapes and dtypes, recording what its
    `whole_tensors` checks ask for (Muon's matrices, Adafactor's factored ones, SM3's, NovoGrad's
    every tensor) instead of checking: what a flat plan must keep whole to run it (a hybrid plan).

    A chain that cannot run on meta tensors (a link reads data: ``clip_by_global_norm`` compares
    its norm) is asked link by link; a link that cannot is taken to step element by element, and
    the step still checks it (a ``ValueError`` naming the param it was given in pieces)."""
    return asked_of(tx, params, _PROBE)


def asked_of(tx: Any, params: dict[str, tuple[tuple[int, ...], torch.dtype]], probe: ContextVar) -> list[str]:
    """The params (by name) ``tx``'s step records in ``probe`` (a ContextVar holding a set of
    ids while asked), on ``meta`` tensors of these shapes and dtypes, link by link where the
    whole cannot run on them."""
    tree = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in params.items()}
    asked = _asked(tx, tree, probe)
    return [name for name in params if name in asked]


def _asked(tx: Any, tree: dict[str, torch.Tensor], probe: ContextVar, found: dict | None = None) -> set[str]:
    """The names ``tx``'s step records ids of in ``probe``; with ``found``, the probe is that dict
    (id -> what the rule said), filled by name into ``found`` too."""
    grads = {name: torch.empty_like(t) for name, t in tree.items()}
    index = {id(t): name for pair in (tree, grads) for name, t in pair.items()}
    asked: set[int] | dict[int, Any] = set() if found is None else {}
    token = probe.set(asked)
    try:
        tx.update(grads, tx.init(tree), tree)
        if found is not None:
            found.update({index[i]: v for i, v in asked.items() if i in index})
        return {index[i] for i in asked if i in index}
    except ParamsRefused:
        raise  # the rule refuses these params (a label on a vector): one process would refuse them too
    except Exception:  # noqa: BLE001 - a link that reads data: ask its links, or take it as element-wise
        links = _links(tx)
        return set().union(*(_asked(link, tree, probe, found) for link in links)) if links else set()
    finally:
        probe.reset(token)


def _links(tx: Any) -> tuple:
    """What ``tx`` is made of: a chain's links, or the transformation an injected chain builds
    from its hyperparameters (`inject_hyperparams` keeps its factory and arguments)."""
    spec = getattr(tx, "spec", None)
    if spec is None:
        return ()
    if spec.links:
        return spec.links
    source = spec.args.get("source") if spec.name == "inject_hyperparams" else None
    if not source:
        return ()
    factory, args = source
    return (factory(**args),)


def cut_tensors(leaves: Sequence[torch.Tensor], what: str = "which tensors a leaf holds pieces of"
                ) -> list[tuple[int, ...]] | None:
    """Per leaf, the whole tensors it holds pieces of (empty for a whole tensor in its own
    shape); None when every rank steps whole tensors, or outside a step (a transformation's
    init: the step checks). ``what`` names the asker in errors."""
    if stepping_whole() or current(LEAVES) is None:
        return None
    sharding, pieces = sharded(leaves, what)
    return [() if whole_piece(sharding, pc) and pc.lengths[0] == leaf.numel() and _own_shape(sharding, pc, leaf)
            else pc.tensors for leaf, pc in zip(leaves, pieces)]


def pieces_unknown() -> bool:
    """A sharded step's init (outside `stepping`): its leaves may be pieces, but which is not known
    yet (the step checks them)."""
    return current(SHARDING) is not None and not stepping_whole() and current(LEAVES) is None


def whole_tree() -> tuple[dict[str, torch.Tensor], list[int]]:
    """The step's whole tensors as a dict by name, each an empty ``meta`` tensor of its shape and
    dtype (for a rule's function of the params' tree, asked about the whole tensors), and which
    tensor each of the dict's leaves is, in ``tree_leaves`` order."""
    sharding = current(SHARDING)
    names = sharding.names if sharding is not None else ()
    if not names or len(set(names)) != len(names) or not sharding.shapes:
        raise ValueError("this sharded step does not know its tensors' names and shapes (or two share a name)")
    meta = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in zip(sharding.shapes, sharding.dtypes)]
    tree = dict(zip(names, meta))
    at = {id(x): t for t, x in enumerate(meta)}
    return tree, [at[id(x)] for x in optree.tree_leaves(tree)]


def _own_shape(sharding: Sharding, pc: Pieces, leaf: torch.Tensor) -> bool:
    return not sharding.shapes or tuple(leaf.shape) == tuple(sharding.shapes[pc.tensors[0]])
