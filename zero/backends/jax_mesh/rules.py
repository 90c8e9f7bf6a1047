"""Which Optax transformations a mesh can step on packed buffers, decided before any step.

The mesh hands a transformation its params, gradients and state as a few long 1-D buffers
(see `zero.backends.jax_mesh.buffers`), so each device steps only its slice and XLA inserts
the collectives of global reductions (``clip_by_global_norm``'s norm) itself. That is exact
for a rule that treats every element alike, and silently wrong for one that does not: a mask
or a partition by name or by shape, a per-tensor norm (LAMB's trust ratio), whole matrices
(Muon), factored state (Adafactor). Optax's transformations are closures, so instead of
reading them we run them: `check_rule` steps a small twin of the params (same tree, same
ranks, each dimension cut to a few elements) as a tree and as packed buffers, and refuses the
rule, naming the first param whose update differs, unless both agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero.backends.jax_mesh.buffers import Buffer, pack, unpack
from zero.backends.jax_mesh.hybrid import masked

__all__ = ["check_state", "check_rule", "is_per_param"]

_STEPS = 2  # the second step reads the state the first wrote
_GAP = 1  # zeros between a twin's params, as padding lies between a plan's


def is_per_param(node: Any, treedef: Any, shapes: Sequence[tuple[int, ...]]) -> bool:
    """Whether a state node holds one leaf per param, each shaped like it (Adam's ``mu``)."""
    leaves, structure = jax.tree.flatten(node)
    return structure == treedef and all(tuple(leaf.shape) == tuple(s) for leaf, s in zip(leaves, shapes))


def check_state(tx: optax.GradientTransformation, params: Any) -> None:
    """``ValueError`` naming the first state leaf that is neither a scalar nor one of a set of
    leaves shaped like the params: a plan has no place for it."""
    leaves, treedef = jax.tree.flatten(params)
    shapes = [tuple(x.shape) for x in leaves]
    state = jax.eval_shape(tx.init, params)
    grown = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(d + 1 for d in x.shape), x.dtype), params)
    constant = {jax.tree_util.keystr(p): tuple(x.shape)  # leaves whose shape does not follow the params'
                for p, x in jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, grown))[0]}
    found = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda n: is_per_param(n, treedef, shapes))[0]
    for path, node in found:
        if is_per_param(node, treedef, shapes) or node.shape == ():
            continue
        if constant.get(jax.tree_util.keystr(path)) != tuple(node.shape):
            raise ValueError(f"optimizer state leaf {jax.tree_util.keystr(path)} has shape {tuple(node.shape)}: it is "
                             "neither a scalar nor part of a set of leaves shaped like all the params (factored "
                             "moments such as Adafactor's, or state over the params a mask or partition picks, "
                             "such as Muon's), so no plan can place it; step this rule unsharded")


def check_rule(tx: optax.GradientTransformation, params: Any, names: Sequence[str],
               owners: Mapping[int, int] | None = None) -> None:
    """``ValueError`` unless ``tx`` steps a twin of ``params`` as the mesh will, exactly as it
    steps the twin as a tree, naming the first param whose update differs.

    The mesh packs every param into buffers, except a hybrid plan's whole params (``owners``:
    param index to its rank), which each owner steps as the tree with the others masked."""
    owners = dict(owners or {})
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(0)
    twin = [rng.standard_normal(_twin_shape(x.shape)).astype(_twin_dtype(x.dtype)) for x in leaves]
    grads = [[rng.standard_normal(t.shape).astype(t.dtype) for t in twin] for _ in range(_STEPS)]
    as_tree = lambda xs: treedef.unflatten([jnp.asarray(x) for x in xs])
    expected = _run(tx, as_tree(twin), [as_tree(g) for g in grads])
    got = [list(twin) for _ in range(_STEPS)]
    flat = [i for i in range(len(twin)) if i not in owners]
    if flat:
        _packed_twin(tx, twin, grads, flat, got)
    for rank in sorted(set(owners.values())):
        mine = [i for i, r in owners.items() if r == rank]
        for step, updates in enumerate(_run(tx, masked(as_tree(twin), mine), [masked(as_tree(g), mine)
                                                                                for g in grads])):
            for i, u in zip(mine, jax.tree.leaves(updates)):
                got[step][i] = u
    for step, (want, ours) in enumerate(zip(expected, got)):
        scale = max(float(np.max(np.abs(u))) for u in jax.tree.leaves(want)) or 1.0
        for i, (u, mine) in enumerate(zip(jax.tree.leaves(want), ours)):
            if not np.allclose(np.asarray(mine), np.asarray(u), rtol=1e-4, atol=1e-5 * scale):
                how = ("under the hybrid plan, flat params packed together and whole ones stepped apart on their "
                       "owners (a reduction across params such as clip_by_global_norm, or a flat param the rule "
                       "reads whole: add it to whole=)" if owners else
                       "when its elements are packed with the others' (a mask or partition by name or shape, a "
                       "per-tensor norm such as LAMB's or Adafactor's, or whole matrices such as Muon's: a hybrid "
                       "plan keeps those whole)")
                raise ValueError(f"this transformation does not treat every element alike: param {names[i]!r} gets "
                                 f"another update (step {step + 1}) {how}; step it unsharded")


def _packed_twin(tx, twin, grads, flat: list[int], got: list[list]) -> None:
    """The twin's ``flat`` params stepped packed into buffers, their updates written into ``got``."""
    layout = _twin_layout(twin, flat)
    as_buffers = lambda leaves: tuple(jnp.asarray(b) for b in pack(leaves, layout, np))
    try:
        packed = _run(tx, as_buffers(twin), [as_buffers(g) for g in grads])
    except Exception as err:  # a mask or a partition by tree: the rule cannot even run on buffers
        raise ValueError(f"this transformation cannot step packed buffers ({type(err).__name__}: {err}); "
                         "zero.backends.jax_mesh steps rules that treat every element alike (with global "
                         "reductions such as clip_by_global_norm): step it unsharded, or keep the params it "
                         "needs whole with a hybrid plan. An argument that is a tree of the params (Muon's "
                         "dimension numbers or a mask as a dict by name) cannot be read on the buffers: give "
                         "it as a function of the tree") from err
    for step, view in enumerate(packed):
        unpacked = unpack(view, layout, twin)
        for i in flat:
            got[step][i] = unpacked[i]


def _run(tx, params, grads_per_step) -> list[Any]:
    """``tx``'s updates over the steps, jitted: run eagerly, each op of a rule compiles on its own
    (Muon's Newton-Schulz: 6 s a check here, against 1 s as one program)."""
    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return updates, state, optax.apply_updates(params, updates)

    state, out, step = jax.jit(tx.init)(params), [], jax.jit(step)
    for grads in grads_per_step:
        updates, state, params = step(grads, state, params)
        out.append(updates)
    return out


def _twin_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Each dimension cut to a few elements, unequal so that no matrix turns square."""
    return tuple(min(d, 3 + j) for j, d in enumerate(shape))


def _twin_dtype(dtype) -> np.dtype:
    return np.float64 if dtype == jnp.float64 and jax.config.jax_enable_x64 else np.float32


def _twin_layout(twin: list[np.ndarray], flat: list[int]) -> tuple[Buffer, ...]:
    """The twin's ``flat`` params in buffers of at most two, by dtype, a zero between params and
    two after, as a plan's padding lies between and after its params."""
    by_dtype: dict[Any, list[int]] = {}
    for i in flat:
        by_dtype.setdefault(twin[i].dtype, []).append(i)
    out = []
    for members in by_dtype.values():
        for k in range(0, len(members), 2):
            params = members[k:k + 2]
            sizes = [twin[i].size for i in params]
            starts = [0, sizes[0] + _GAP][:len(params)]
            out.append(Buffer(str(twin[params[0]].dtype), starts[-1] + sizes[-1] + 2, tuple(params), tuple(starts),
                              tuple(sizes), ()))
    return tuple(out)
