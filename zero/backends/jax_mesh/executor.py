"""ZeRO-1 for Optax on a JAX device mesh: the state placed by a plan, the step sharded by it.

A transformation sees its params, gradients and state as the plan's buffers (see `packing`),
each sharded in equal slices along the mesh axis. Under ``jit`` every device then computes
the step for its slice only, XLA all-reduces what a global reduction needs, and the new params
leave replicated: one all-gather of the updated buffers, as ZeRO's param sync. The state
stays placed between steps (its buffers are donated to the next state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from zero.backends.jax_mesh.buffers import pack, pack_slices, packing, unpack
from zero.backends.jax_mesh.hybrid import HybridState, WholeParams, masked
from zero.backends.jax_mesh.rules import check_rule, check_state, is_per_param
from zero.plans.meta import param_metas
from zero.plans.plan import Plan, check_plan

__all__ = ["init", "update", "gather_state", "place_state", "state_bytes", "device_bytes", "Placed", "auto_axes"]


class Placed:
    """One plan on one mesh axis: its buffers, shardings, and the checks of what it is given
    (shared by the step here and the checkpoints of `zero.backends.jax_mesh.checkpoint`)."""

    def __init__(self, plan: Plan, mesh: Mesh, axis: str):
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a zero.Plan (zero.make_plan(zero.param_metas(params), ...)), got "
                            f"{type(plan).__name__}")
        if axis not in mesh.axis_names:
            raise ValueError(f"the mesh has no axis {axis!r}; its axes are {mesh.axis_names}")
        if plan.world_size != mesh.shape[axis]:
            raise ValueError(f"the plan is for {plan.world_size} ranks but mesh axis {axis!r} has "
                             f"{mesh.shape[axis]} devices: make the plan for {mesh.shape[axis]}")
        if plan.split_heads:  # each rank's heads would be a piece of its buffer row, not a leaf of Optax's tree
            cut = [plan.metas[i].name for i in plan.cut_at_heads]
            raise ValueError(f"the plan cuts {cut[0]!r} ({len(cut)} params) at head edges (split_heads=True), which "
                             "zero.ZeroRedundancyOptimizer executes; a mesh steps per-head params whole on their "
                             "owners, each head one batched matrix: make the plan without split_heads")
        frozen = [m.name for m in plan.metas if not m.requires_grad]
        if frozen:
            raise ValueError(f"the plan marks param {frozen[0]!r} frozen, but a mesh steps every leaf it is given: "
                             "plan the trainable leaves only, and pass only those")
        self.plan, self.mesh, self.axis = plan, auto_axes(mesh), axis
        self.buffers = packing(plan)
        self.sharded = NamedSharding(self.mesh, PartitionSpec(axis))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())

    def check(self, tx: optax.GradientTransformation, params: Any) -> None:
        """``ValueError`` when ``params`` are not the plan's, or ``tx`` cannot be placed or stepped
        on buffers, with a hybrid plan's whole params on their owners (see `rules`)."""
        names = self.check_params(params)
        whole = self.plan.whole
        check_state(tx, masked(params, [i for i in range(len(names)) if i not in set(whole)]) if whole else params)
        check_rule(tx, params, names, {i: self.plan.partition.owner[i] for i in whole})

    def refuse_hybrid(self, what: str) -> None:
        if self.plan.hybrid:
            raise ValueError(f"{what} moves element-wise state between Optax's tree and a plan's buffers; a hybrid "
                             f"plan's whole params keep per-owner state ({len(self.plan.whole)} params): save it "
                             "with jax_mesh.save, which keeps each device's rows as they are")

    def whole_params(self, tx: optax.GradientTransformation, params: Any) -> WholeParams | None:
        """A hybrid plan's per-owner step of its whole params (None for other plans)."""
        return WholeParams(tx, self.plan, params, self.mesh, self.axis) if self.plan.hybrid else None

    def check_params(self, params: Any) -> list[str]:
        """``ValueError`` naming the first param that differs from the plan's; the params' names."""
        given = param_metas(jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params))  # numpy too
        if len(given) != len(self.plan.metas):
            raise ValueError(f"the plan is for {len(self.plan.metas)} params but the tree has {len(given)} leaves: "
                             "make it with zero.make_plan(zero.param_metas(params), ...) for these params")
        check_plan(self.plan, [g._replace(device=p.device, group=p.group) for g, p in zip(given, self.plan.metas)],
                   self.plan.world_size)  # a mesh has no devices or groups in the plan's sense: shapes and dtypes
        return [m.name for m in given]

    def pack(self, leaves) -> tuple[jax.Array, ...]:
        return pack_slices(leaves, self.buffers, self.mesh, self.axis)

    def shardings(self, tx: optax.GradientTransformation, params: Any, whole: WholeParams | None) -> Any:
        """Each state leaf's placement: a buffer's leaves sharded; scalars, and constants (leaves
        that keep their shape when the buffers grow: Muon's coefficients), replicated; a hybrid
        plan's rows sharded."""
        view = self.view_of(params)
        state_shapes = jax.eval_shape(tx.init, view)
        grown = jax.eval_shape(tx.init, tuple(jax.ShapeDtypeStruct((b.shape[0] + self.plan.world_size,), b.dtype)
                                              for b in view))
        lengths = {(b.length,) for b in self.buffers}

        def place(path, leaf, other):
            if leaf.shape == () or leaf.shape == other.shape:
                return self.replicated
            if tuple(leaf.shape) in lengths:
                return self.sharded
            raise ValueError(f"optimizer state leaf {jax.tree_util.keystr(path)} of the packed step has shape "
                             f"{tuple(leaf.shape)}, not a buffer's: no plan can place it")

        flat = jax.tree_util.tree_map_with_path(place, state_shapes, grown)
        return flat if whole is None else HybridState(flat, (self.sharded,) * len(whole.state.dtypes))

    def view_of(self, params: Any) -> Any:
        """The buffers' abstract values, for ``jax.eval_shape``."""
        return buffer_shapes(self.buffers, params)


def auto_axes(mesh: Mesh) -> Mesh:
    """``mesh`` with its axes typed ``Auto``: `jax.make_mesh` types them ``Explicit`` by default, and
    there an array's type carries its sharding, which the packing's slices and reshapes would have
    to spell out; placed by the plan, the executor's arrays keep the shardings it gives them."""
    types = getattr(mesh, "axis_types", None)
    auto = getattr(jax.sharding, "AxisType", None)
    if types is None or auto is None or all(t == auto.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(auto.Auto,) * len(mesh.axis_names))


def init(tx: optax.GradientTransformation, params: Any, plan: Plan, mesh: Mesh, axis: str = "data") -> Any:
    """``tx.init`` of ``params`` placed by ``plan`` along ``axis`` of ``mesh``.

    The state is the transformation's own, over the plan's buffers instead of the params' tree:
    each per-param leaf (Adam's ``mu``) is one buffer per plan buffer, sharded so that device
    ``r`` holds rank ``r``'s elements; scalars (counts) are replicated. It is built under ``jit``
    with those output shardings, so no device ever holds it whole. `gather_state` gives it in the
    params' tree (Optax's layout), `place_state` places such a state.

    Under a hybrid plan (``make_plan(..., "flat", optimizer="muon")``) it is a
    `zero.backends.jax_mesh.hybrid.HybridState`: that state for the flat buffers, and each
    device's ``tx.init`` of the whole params it owns, in rows (`zero.backends.jax_mesh.hybrid`).
    """
    placed = Placed(plan, mesh, axis)
    placed.check(tx, params)
    return _init_program(tx, placed, params)(params)


def _init_program(tx: optax.GradientTransformation, placed: Placed, params: Any) -> Callable:
    """``tx.init`` over the packed params, jitted with the state's shardings as its outputs."""
    whole = placed.whole_params(tx, params)

    def build(params):
        flat = tx.init(placed.pack(jax.tree.leaves(params)))
        return flat if whole is None else HybridState(flat, whole.init(params))

    return jax.jit(build, out_shardings=placed.shardings(tx, params, whole))


def update(tx: optax.GradientTransformation, plan: Plan, mesh: Mesh, axis: str = "data") -> Callable:
    """A step ``(grads, state, params) -> (params, state)`` of ``tx`` placed by ``plan``.

    Each device steps its slice of every buffer, and under a hybrid plan the whole params it
    owns (only those: one device per matrix); the state keeps its placement (the old one is
    donated), the params come back replicated. The first call checks the params against the
    plan and compiles; later calls with the same tree reuse the compiled step.
    """
    placed = Placed(plan, mesh, axis)
    return _Step(tx, placed)


class _Step:
    """The jitted step of `update`, compiled on the first call (it needs the params' tree).

    ``whole``: a hybrid plan's whole params as the first call placed them (`WholeParams`: what
    each device owns of them, ``nbytes()``), None before it or for a plan without whole params;
    `compiled_text` the program a step runs."""

    def __init__(self, tx: optax.GradientTransformation, placed: Placed):
        self._tx, self._placed, self._jitted, self._treedef, self.whole = tx, placed, None, None, None

    def __call__(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        treedef = jax.tree.structure(params)
        if self._jitted is None:
            self._placed.check(self._tx, params)
            self.whole = self._placed.whole_params(self._tx, params)
            self._jitted = jax.jit(self._step, donate_argnums=1, out_shardings=(
                self._placed.replicated, self._placed.shardings(self._tx, params, self.whole)))
            self._treedef = treedef
        elif treedef != self._treedef:
            raise ValueError(f"these params are another tree than the first step's: {treedef} against {self._treedef}")
        if jax.tree.structure(grads) != treedef:
            raise ValueError(f"the grads' tree {jax.tree.structure(grads)} is not the params' {treedef}")
        replicated = self._placed.replicated  # the sharding every step's params come back with: one compile
        return self._jitted(jax.device_put(grads, replicated), state, jax.device_put(params, replicated))

    def compiled_text(self, grads: Any, state: Any, params: Any) -> str:
        """The compiled program a step with these arguments runs (XLA's HLO text, where its
        collectives can be read); after the first step, which compiled it."""
        if self._jitted is None:
            raise ValueError("the step is compiled at its first call: take one step before reading its program")
        replicated = self._placed.replicated
        lowered = self._jitted.lower(jax.device_put(grads, replicated), state, jax.device_put(params, replicated))
        return lowered.compile().as_text()

    def _step(self, grads, state, params):
        leaves, treedef = jax.tree.flatten(params)
        flat_state = state if self.whole is None else state.flat
        if self.whole is not None:  # the owners' whole params first, the flat buffers then fill in theirs
            leaves, rows = self.whole.step(grads, state.whole, params)
        view = self._placed.pack(leaves)
        updates, flat_state = self._tx.update(self._placed.pack(treedef.flatten_up_to(grads)), flat_state, view)
        stepped = optax.apply_updates(view, updates)
        # gathered whole before they are cut into params: one all-gather a buffer, then local slices
        gathered = [jax.lax.with_sharding_constraint(b, self._placed.replicated) for b in stepped]
        new = treedef.unflatten(unpack(gathered, self._placed.buffers, leaves))
        return new, (flat_state if self.whole is None else HybridState(flat_state, rows))


def gather_state(state: Any, tx: optax.GradientTransformation, params: Any, plan: Plan, mesh: Mesh,
                 axis: str = "data") -> Any:
    """``state`` (from `init` or a step) in Optax's layout, ``tx.init(params)``'s tree, whole on
    the mesh's first device (as a consolidated checkpoint is on one rank): for
    `zero.functional.from_optax_state`, which reads single-device arrays, and a torch checkpoint.
    Each buffer travels to the host and is cut into params there, so no other device holds it whole."""
    placed = Placed(plan, mesh, axis)
    placed.refuse_hybrid("gather_state")
    placed.check_params(params)
    tree, view = _trees(tx, params, placed)
    nodes = [[np.asarray(b) for b in n] if like else np.asarray(n) for n, like in zip(_nodes(state, view), tree.likes)]
    out = tree.upper.unflatten([tree.treedef.unflatten(unpack(n, placed.buffers, like)) if like else n
                                for n, like in zip(nodes, tree.likes)])
    return jax.device_put(out, SingleDeviceSharding(mesh.devices.flat[0]))


def place_state(optax_state: Any, tx: optax.GradientTransformation, params: Any, plan: Plan, mesh: Mesh,
                axis: str = "data") -> Any:
    """An Optax state of ``tx.init(params)``'s layout (from `gather_state`, or a torch run through
    `zero.functional.to_optax_state`) placed as `init` places it: packed on the host, each device
    sent only its slice."""
    placed = Placed(plan, mesh, axis)
    placed.refuse_hybrid("place_state")
    placed.check_params(params)
    tree, view = _trees(tx, params, placed)
    nodes = _nodes(jax.tree.map(np.asarray, optax_state), tree)
    return view.upper.unflatten([
        tuple(jax.device_put(b, placed.sharded) for b in pack(jax.tree.leaves(n), placed.buffers, np)) if like
        else jax.device_put(n, placed.replicated) for n, like in zip(nodes, tree.likes)])


def state_bytes(state: Any, mesh: Mesh, axis: str = "data") -> tuple[int, ...]:
    """Bytes of ``state``'s sharded leaves on the device at each position along ``axis``: what
    each device really holds, padding included (a whole-param plan's rows are each as long as the
    busiest rank's; a hybrid plan's whole-param rows too). Replicated scalars are left out.
    `device_bytes` predicts it from the plan without a state."""
    where = mesh.axis_names.index(axis)
    devices = [np.asarray(np.take(mesh.devices, r, axis=where)).flat[0] for r in range(mesh.shape[axis])]
    out = [0] * len(devices)
    for leaf in jax.tree.leaves(state):
        if leaf.sharding.is_fully_replicated:
            continue
        for shard in leaf.addressable_shards:
            if shard.device in devices:
                out[devices.index(shard.device)] += shard.data.nbytes
    return tuple(out)


def device_bytes(tx: optax.GradientTransformation, params: Any, plan: Plan) -> tuple[int, ...]:
    """The bytes of ``tx``'s state each device of a mesh holds under ``plan``, padding included,
    from the params' shapes alone (no mesh, no arrays): what `state_bytes` measures. A plan's own
    ``ranks[r].state_bytes`` counts rank ``r``'s elements only, as torch ranks hold them; a mesh
    shards evenly, so under a whole-param plan every device holds the busiest rank's row."""
    buffers = packing(plan)
    view = buffer_shapes(buffers, params)
    per_buffer = {(b.length,) for b in buffers}
    flat = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(tx.init, view))
               if tuple(x.shape) in per_buffer) // plan.world_size
    whole = WholeParams(tx, plan, params, None, "") if plan.hybrid else None  # shapes only: no mesh needed
    rows = 0 if whole is None else sum(w * np.dtype(d).itemsize for d, w in zip(whole.state.dtypes, whole.state.width))
    return (flat + rows,) * plan.world_size


def buffer_shapes(buffers: Any, params: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
    leaves = jax.tree.leaves(params)
    return tuple(jax.ShapeDtypeStruct((b.length,), leaves[b.params[0]].dtype) for b in buffers)


class _Layout:
    """A state's tree cut at its per-param nodes: ``upper`` over nodes, ``likes`` the params'
    leaves (shapes) for a per-param node and None for a scalar."""

    def __init__(self, shapes: Any, treedef: Any, per_param: Callable[[Any], bool], likes: list):
        self.treedef, self.per_param = treedef, per_param
        nodes, self.upper = jax.tree.flatten(shapes, is_leaf=per_param)
        self.likes = [likes if per_param(n) else None for n in nodes]


def _trees(tx, params, placed: Placed) -> tuple[_Layout, _Layout]:
    """The layouts of ``tx``'s state over the params' tree and over the plan's buffers."""
    leaves, treedef = jax.tree.flatten(params)
    shapes = [tuple(x.shape) for x in leaves]
    buffers = placed.view_of(params)
    view_def = jax.tree.structure(buffers)
    tree = _Layout(jax.eval_shape(tx.init, params), treedef, lambda n: is_per_param(n, treedef, shapes), leaves)
    view = _Layout(jax.eval_shape(tx.init, buffers), view_def,
                   lambda n: is_per_param(n, view_def, [b.shape for b in buffers]), list(buffers))
    if [like is None for like in tree.likes] != [like is None for like in view.likes]:
        raise ValueError("this transformation's state over the params' tree and over buffers differ in layout: "
                         "it cannot move between them")
    return tree, view


def _nodes(state: Any, layout: _Layout) -> list:
    nodes, upper = jax.tree.flatten(state, is_leaf=layout.per_param)
    if upper != layout.upper:
        raise ValueError(f"the state's tree {upper} is not this transformation's {layout.upper}: pass the state "
                         "of the same transformation and params")
    return nodes
