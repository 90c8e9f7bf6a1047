"""The JAX side of `test_jax_mesh.py`, run in a subprocess with 8 CPU devices (XLA_FLAGS must be
set before jax starts): every check's figures, printed as one JSON object for the tests to judge.

``python tests/backends/jax_mesh_checks.py PLANS.json`` (PLANS.json: the two-executor test's saved plans).
"""

from __future__ import annotations

import json
import os
import re
import sys

from xla_devices import flags_with_devices  # noqa: E402  (beside this script; imports nothing)

os.environ["XLA_FLAGS"] = flags_with_devices(8)  # run by hand too: 8 devices, before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax_mesh_twin import STEPS, grads, initial  # noqa: E402
from jax_soap import soap  # noqa: E402

import zero  # noqa: E402
from zero.backends import jax_mesh  # noqa: E402
from zero.backends.jax_mesh import executor  # noqa: E402
from zero.plans.mesh_padding import mesh_state_bytes  # noqa: E402

jax.config.update("jax_enable_x64", True)
SHAPES = {"b1": (33,), "b2": (5,), "emb": (100, 16), "w1": (16, 33), "w2": (33, 5)}  # 2331 elements, uneven
RULES = {  # name: (transformation, zero's accounting name)
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), "adamw"),
    "lion": (lambda: optax.lion(1e-3, weight_decay=0.1), "lion"),
    "clip_adam": (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), "adam"),
}
PLANS = {"flat": dict(strategy="flat", bucket_numel=1000), "whole": dict(strategy="sorted_greedy")}
COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *_, **__: COMPILES.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)


def mesh_of(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def tree_of(rng, dtype) -> dict:
    """``dtype="mixed"``: w1 and b2 in bfloat16, the rest float32 (buffers per dtype)."""
    dtypes = {k: (jnp.bfloat16 if k in ("w1", "b2") else np.float32) if dtype == "mixed" else dtype for k in SHAPES}
    return {k: jnp.asarray(rng.standard_normal(s), dtypes[k]) for k, s in SHAPES.items()}


def worst(a, b) -> float:
    """The largest difference of any leaf, relative to the reference leaf's largest magnitude; on
    the host in float64 (eager JAX ops on the 8 devices' sharded leaves compiled a program per
    leaf and sharding: 0.45 s a comparison)."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    return max(float(np.abs(x - y).max() / np.abs(y).max())
               for x, y in ((np.asarray(x, np.float64), np.asarray(y, np.float64)) for x, y in pairs))


def collectives(step, grads, state, params) -> dict[str, int]:
    text = step.compiled_text(grads, state, params)
    return {op: len(re.findall(rf"= \S+ {op}(-start)?\(", text)) for op in ("all-gather", "all-reduce")}


def parity(rule: str, kind: str, dtype) -> dict:
    """50 steps on 8 devices against Optax unsharded, state bytes per device, compiles, collectives."""
    make, accounting = RULES[rule]
    rng = np.random.default_rng(0)
    params = tree_of(rng, dtype)
    plan = zero.make_plan(zero.param_metas(params), 8, optimizer=accounting, **PLANS[kind])
    tx, mesh = make(), mesh_of(8)
    state, step = jax_mesh.init(tx, params, plan, mesh), jax_mesh.update(tx, plan, mesh)
    ref_step = jitted_step(tx)
    ref, ref_state, ours, rel, compiles = params, tx.init(params), params, 0.0, []
    placed_bytes = jax_mesh.state_bytes(state, mesh)
    for _ in range(50):
        g = tree_of(rng, dtype)
        before = len(COMPILES)
        ours, state = step(g, state, ours)
        compiles.append(len(COMPILES) - before)
        ref, ref_state = ref_step(g, ref_state, ref)
        rel = max(rel, worst(ours, ref))
    gathered = jax_mesh.gather_state(state, tx, params, plan, mesh)
    init_memory = executor._init_program(tx, executor.Placed(plan, mesh, "data"), params).lower(
        params).compile().memory_analysis()  # what one device's init program allocates
    buffers = jax_mesh.packing(plan)
    return {"rel": rel, "state_rel": worst(gathered, ref_state), "bytes": jax_mesh.state_bytes(state, mesh),
            "init_bytes": placed_bytes, "plan_bytes": [r.state_bytes for r in plan.ranks],
            "mesh_bytes": list(mesh_state_bytes(plan)),
            "scalar_bytes": [zero.plans.costs.cost_of(accounting).scalar_bytes
                             * (len(buffers) if kind == "flat" else len(plan.partition.params_of(r)))
                             for r in range(8)],
            "owned": [sum(b.owned[r] for b in buffers) for r in range(8)], "buffers": len(buffers),
            "init_allocates": init_memory.temp_size_in_bytes + init_memory.output_size_in_bytes,
            "state_whole": sum(x.nbytes for x in jax.tree.leaves(gathered)),
            "itemsize": np.dtype(np.float32 if dtype == "mixed" else dtype).itemsize,
            "compiles_after_first": sum(compiles[1:]),
            "collectives": collectives(step, g, state, ours)}


def two_executors(plan_texts: list[str]) -> list[dict]:
    """The torch ranks' plans on a 4-device mesh: 20 AdamW steps from the same numbers."""
    out = []
    for text in plan_texts:
        plan, tx, mesh = zero.Plan.from_json(text), optax.adamw(1e-2, weight_decay=0.1), mesh_of(4)
        params = [jnp.asarray(x) for x in initial()]
        state, step = jax_mesh.init(tx, params, plan, mesh), jax_mesh.update(tx, plan, mesh)
        for k in range(STEPS):
            params, state = step([jnp.asarray(g) for g in grads(k)], state, params)
        out.append({"params": [np.asarray(p).tolist() for p in params],
                    "state_bytes": jax_mesh.state_bytes(state, mesh)})
    return out


def two_axes() -> dict:
    """A 4 x 2 mesh ("data", "model"), the plan along "data": 10 AdamW steps against Optax."""
    rng = np.random.default_rng(3)
    params = tree_of(rng, np.float64)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    plan, tx = zero.make_plan(zero.param_metas(params), 4, "flat"), optax.adamw(1e-2, weight_decay=0.1)
    state, step = jax_mesh.init(tx, params, plan, mesh), jax_mesh.update(tx, plan, mesh)
    ours, ref, ref_state = params, params, tx.init(params)
    for _ in range(10):
        g = tree_of(rng, np.float64)
        ours, state = step(g, state, ours)
        updates, ref_state = tx.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    return {"rel": worst(ours, ref), "bytes": jax_mesh.state_bytes(state, mesh),
            "plan_bytes": [r.state_bytes - 4 for r in plan.ranks]}  # less the plan's torch `step` scalar


def errors() -> dict[str, str]:
    """The message each wrong input raises (or "no error")."""
    params = tree_of(np.random.default_rng(0), np.float32)
    metas = zero.param_metas(params)
    plan, mesh = zero.make_plan(metas, 8, "flat"), mesh_of(8)
    cases = {
        "mesh_size": lambda: jax_mesh.init(optax.adam(1e-2), params, zero.make_plan(metas, 4), mesh),
        "other_params": lambda: jax_mesh.init(optax.adam(1e-2), {**params, "w1": jnp.zeros((16, 34))}, plan, mesh),
        "extra_param": lambda: jax_mesh.init(optax.adam(1e-2), {**params, "w3": jnp.zeros(3)}, plan, mesh),
        "gather_other_params": lambda: jax_mesh.gather_state(
            jax_mesh.init(optax.adam(1e-2), params, plan, mesh), optax.adam(1e-2), {**params, "b1": jnp.zeros(3)},
            plan, mesh),
        "axis": lambda: jax_mesh.update(optax.adam(1e-2), plan, mesh, axis="model"),
        "not_a_plan": lambda: jax_mesh.init(optax.adam(1e-2), params, plan.to_json(), mesh),
        "lamb": lambda: jax_mesh.init(optax.lamb(1e-2), params, plan, mesh),
        "mask": lambda: jax_mesh.init(optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
                                      params, plan, mesh),
        "muon": lambda: jax_mesh.init(optax.contrib.muon(1e-2), params, plan, mesh),
        "adafactor": lambda: jax_mesh.init(optax.adafactor(1e-2, min_dim_size_to_factor=8), params, plan, mesh),
        "frozen": lambda: jax_mesh.init(optax.adam(1e-2), params,
                                        zero.make_plan([m._replace(requires_grad=m.name != "b2") for m in metas], 8),
                                        mesh),
        "hybrid_global_norm": lambda: jax_mesh.init(
            optax.chain(optax.clip_by_global_norm(1.0), optax.contrib.muon(1e-2)), params,
            zero.make_plan(metas, 8, "flat", optimizer="muon"), mesh),
        "hybrid_flat_adafactor": lambda: jax_mesh.init(
            optax.adafactor(1e-2, min_dim_size_to_factor=8), params,
            zero.make_plan(metas, 8, "flat", whole=lambda m: len(m.shape) == 2), mesh),
        "hybrid_dims_by_name": lambda: jax_mesh.init(
            optax.contrib.muon(1e-2, muon_weight_dimension_numbers={
                k: optax.contrib.MuonDimensionNumbers() if v.ndim == 2 else None for k, v in params.items()}),
            params, zero.make_plan(metas, 8, "flat", optimizer="muon"), mesh),
        "split_heads": lambda: jax_mesh.init(optax.contrib.muon(1e-2), params, zero.make_plan(
            metas, 8, "flat", optimizer="muon(heads={'w1': 2})", split_heads=True), mesh),
        "hybrid_gather": lambda: jax_mesh.gather_state(None, optax.adam(1e-2), params,
                                                       zero.make_plan(metas, 8, "flat", optimizer="muon"), mesh),
        "grads_tree": lambda: jax_mesh.update(optax.adam(1e-2), plan, mesh)(
            {k: v for k, v in params.items() if k != "b2"}, jax_mesh.init(optax.adam(1e-2), params, plan, mesh),
            params),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except (ValueError, TypeError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def checkpoint_moves(folder: str) -> dict:
    """10 steps on the mesh, 10 in torch from its gathered state (through a torch checkpoint), 10
    on the mesh from torch's state: against 30 steps on the mesh alone."""
    import torch

    import zero.functional as zf

    params = {f"p{i}": jnp.asarray(x) for i, x in enumerate(initial())}
    plan, mesh, tx, ttx = (zero.make_plan(zero.param_metas(params), 8, "flat"), mesh_of(8),
                           optax.adamw(1e-2, weight_decay=0.1), zf.adamw(1e-2, weight_decay=0.1))
    step = jax_mesh.update(tx, plan, mesh)
    g = lambda k: {f"p{i}": jnp.asarray(x) for i, x in enumerate(grads(k))}
    alone, state = params, jax_mesh.init(tx, params, plan, mesh)
    for k in range(30):
        alone, state = step(g(k), state, alone)
    p, state = params, jax_mesh.init(tx, params, plan, mesh)
    for k in range(10):
        p, state = step(g(k), state, p)
    saved = {"params": {k: torch.from_numpy(np.array(v)) for k, v in p.items()},
             "state": zf.from_optax_state(jax_mesh.gather_state(state, tx, params, plan, mesh))}
    path = os.path.join(folder, "mesh_state.pt")
    torch.save(saved, path)
    loaded = torch.load(path, weights_only=False)
    tp, ts = loaded["params"], loaded["state"]
    for k in range(10, 20):
        u, ts = ttx.update({n: torch.from_numpy(np.array(x)) for n, x in g(k).items()}, ts, tp)
        tp = zf.apply_updates(tp, u)
    p = {k: jnp.asarray(v.numpy()) for k, v in tp.items()}
    state = jax_mesh.place_state(zf.to_optax_state(ts), tx, params, plan, mesh)
    for k in range(20, 30):
        p, state = step(g(k), state, p)
    return {"rel": worst(p, alone), "bytes": jax_mesh.state_bytes(state, mesh),
            "plan_bytes": [r.state_bytes - 4 for r in plan.ranks]}


MATRICES = {**SHAPES, "w3": (64, 40), "w4": (40, 40)}
HYBRID = {  # name: (transformation, make_plan's keywords)
    "muon": (lambda: optax.contrib.muon(1e-2, weight_decay=0.1), dict(optimizer="muon")),
    "adafactor": (lambda: optax.adafactor(1e-2, min_dim_size_to_factor=16), dict(whole=lambda m: True)),
    # on its own model, of square matrices: each factor of full rank from the first gradient (a rank-deficient
    # factor's null space has no one eigenbasis, and a last-bit difference in a fused Gram matrix picks another)
    "soap": (lambda: soap(1e-2, weight_decay=0.01, precondition_frequency=3),
             dict(optimizer="soap(precondition_frequency=3)"),
             {"b1": (33,), "b2": (5,), "t": (4, 4, 4), "w1": (16, 16), "w2": (8, 8), "w3": (12, 12)}),  # JAX's order
}
# per-head Muon on JAX attention kernels in Flax's (in, heads, head_dim) layout, Optax's Muon reading
# the head axis as a batch axis (dimension numbers by each leaf's rank, so the flat buffers' 1-D
# leaves are AdamW's); the plan costs each head's matrix, by name, and keeps the kernels whole
PER_HEAD = {"b": (5,), "kv": (16, 2, 8), "q": (16, 4, 8), "w": (16, 12)}  # JAX's order
PER_HEAD_COUNTS = {"kv": 2, "q": 4}


def by_rank(tree):
    """Optax's dimension numbers of each leaf by its rank: a kernel's heads, a matrix, or AdamW."""
    dims = optax.contrib.MuonDimensionNumbers
    return jax.tree.map(lambda p: dims(0, 2) if p.ndim == 3 else (dims() if p.ndim == 2 else None), tree)


HYBRID["per_head_muon"] = (lambda: optax.contrib.muon(1e-2, muon_weight_dimension_numbers=by_rank),
                           dict(optimizer=f"muon(heads={PER_HEAD_COUNTS!r})"), PER_HEAD)
EIGH = r'custom_call_target="lapack_[sd]syevd'  # an eigendecomposition, as XLA's CPU backend calls LAPACK


def branch_dots(text: str, op: str = r"= \S+ dot\(", branches: int | None = None) -> list[int]:
    """The dot ops (or other ``op``) each branch of the compiled step's switch over devices runs
    (with what it calls), for the conditional whose branches hold any (or that has ``branches``)."""
    bodies = re.split(r"\n(?=\S.*\{\s*$)", text, flags=re.M)
    comps = {}
    for body in bodies:
        head = re.match(r"(?:ENTRY )?%?([\w.\-]+)", body.strip())
        if head:
            comps[head.group(1)] = body
    name = r"%?([\w.\-]+)"
    calls = {n: re.findall(r"(?:calls|to_apply|body|condition)=" + name, b) +
             [c for group in re.findall(r"branch_computations=\{([^}]*)\}", b) for c in re.findall(name, group)]
             for n, b in comps.items()}
    memo: dict[str, int] = {}

    def dots(name: str) -> int:
        if name not in memo:
            memo[name] = 0
            own = len(re.findall(op, comps.get(name, "")))
            memo[name] = own + sum(dots(c) for c in calls.get(name, []))
        return memo[name]

    found = []
    for b in comps.values():
        for group in re.findall(r"branch_computations=\{([^}]*)\}", b):
            counts = [dots(c) for c in re.findall(r"%?([\w.\-]+)", group)]
            if sum(counts) and branches in (None, len(counts)):
                found.append(counts)
    return found[0] if len(found) == 1 else found


def jitted_step(tx):
    """Optax's own step, unsharded, jitted (eager, Muon's takes 1.7 s a step here)."""
    return jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))


def explicit_mesh(n: int) -> Mesh:
    """``jax.make_mesh``'s mesh, whose axes JAX types ``Explicit`` by default (arrays' types carry
    their shardings): the executor must take it as it takes ``Mesh(devices, names)``."""
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def hybrid_fed_back(name: str) -> dict:
    """A hybrid plan (matrices and vectors) on ``jax.make_mesh``'s mesh: 24 steps, each fed the
    last one's params and state, against Optax unsharded."""
    make, kwargs = HYBRID[name]
    rng = np.random.default_rng(6)
    tree = lambda: {k: jnp.asarray(rng.standard_normal(s), np.float32) for k, s in MATRICES.items()}
    params, tx, mesh = tree(), make(), explicit_mesh(8)
    plan = zero.make_plan(zero.param_metas(params), 8, "flat", **kwargs)
    state, step = jax_mesh.init(tx, params, plan, mesh), jax_mesh.update(tx, plan, mesh)
    ref, ref_state, ours, rel, ref_step = params, tx.init(params), params, 0.0, jitted_step(tx)
    for _ in range(24):
        g = tree()
        ours, state = step(g, state, ours)
        ref, ref_state = ref_step(g, ref_state, ref)
        rel = max(rel, worst(ours, ref))
    return {"rel": rel, "vectors": sorted(k for k, s in MATRICES.items() if len(s) == 1),
            "axis_types": [str(t) for t in mesh.axis_types]}


def hybrid(name: str) -> dict:
    """A hybrid plan on 8 devices: 20 float32 steps against Optax unsharded, the Newton-Schulz
    dots (the eigendecompositions) of each device's branch, the bytes each device holds."""
    make, kwargs, *model = HYBRID[name]
    shapes = model[0] if model else MATRICES
    rng = np.random.default_rng(5)
    tree = lambda: {k: jnp.asarray(rng.standard_normal(s), np.float32) for k, s in shapes.items()}
    params, tx, mesh = tree(), make(), mesh_of(8)
    plan = zero.make_plan(zero.param_metas(params), 8, "flat", **kwargs)
    state, step = jax_mesh.init(tx, params, plan, mesh), jax_mesh.update(tx, plan, mesh)
    ref, ref_state, ours, rel, compiles, ref_step = params, tx.init(params), params, 0.0, [], jitted_step(tx)
    for _ in range(20):
        g = tree()
        before = len(COMPILES)
        ours, state = step(g, state, ours)
        compiles.append(len(COMPILES) - before)
        ref, ref_state = ref_step(g, ref_state, ref)
        rel = max(rel, worst(ours, ref))
    text = step.compiled_text(g, state, ours)
    unsharded = ref_step.lower(g, ref_state, ref).compile().as_text()  # compiled already: read, not rebuilt
    names = list(shapes)
    owners = {names[i]: plan.partition.owner[i] for i in plan.whole}
    return {"rel": rel, "whole": owners, "branch_dots": branch_dots(text),
            "dots": len(re.findall(r"= \S+ dot\(", text)), "unsharded_dots": len(re.findall(r"= \S+ dot\(", unsharded)),
            "bytes": jax_mesh.state_bytes(state, mesh), "device_bytes": jax_mesh.device_bytes(tx, params, plan),
            "mesh_bytes": list(mesh_state_bytes(plan)),
            "own_bytes": list(step.whole.nbytes()), "compiles_after_first": sum(compiles[1:]),
            "collectives": collectives(step, g, state, ours), "branch_eighs": branch_dots(text, EIGH, 8),
            "eighs": len(re.findall(EIGH, text)), "unsharded_eighs": len(re.findall(EIGH, unsharded))}


def soap_against_zero() -> float:
    """The JAX SOAP of these checks against `zero.functional.contrib.soap`, float64, 12 steps of
    full-rank factors: the largest difference relative to how far zero's moved each param."""
    import torch

    import zero.functional as F

    shapes = {"w": (6, 6), "b": (7,), "t": (4, 4, 4), "v": (5, 5)}
    rng = np.random.default_rng(0)
    start = {k: rng.standard_normal(s) for k, s in shapes.items()}
    steps = [{k: rng.standard_normal(s) for k, s in shapes.items()} for _ in range(12)]
    tx, ttx = soap(1e-2, weight_decay=0.01, precondition_frequency=3), F.contrib.soap(
        1e-2, weight_decay=0.01, precondition_frequency=3)
    p, state, step = {k: jnp.asarray(v) for k, v in start.items()}, None, jitted_step(tx)
    state = tx.init(p)
    tp = {k: torch.tensor(v) for k, v in start.items()}
    tstate = ttx.init(tp)
    for g in steps:
        p, state = step({k: jnp.asarray(v) for k, v in g.items()}, state, p)
        u, tstate = ttx.update({k: torch.tensor(v) for k, v in g.items()}, tstate, tp)
        tp = F.apply_updates(tp, u)
    return max(float(np.abs(np.asarray(p[k]) - tp[k].numpy()).max() / np.abs(tp[k].numpy() - start[k]).max())
               for k in shapes)


def per_head_against_zero() -> float:
    """The mesh's per-head Muon (the hybrid plan above, float64, 12 steps) against zero's torch
    per-head Muon on the same weights in torch's layout ((heads * head_dim, in), heads=H): the same
    blocks, orthogonalised apart. The largest difference relative to how far zero's moved each param."""
    import torch

    import zero.functional as F
    from zero.functional.contrib import MuonDimensionNumbers as Dims

    rng = np.random.default_rng(1)
    start = {k: rng.standard_normal(s) for k, s in PER_HEAD.items()}
    steps = [{k: rng.standard_normal(s) for k, s in PER_HEAD.items()} for _ in range(12)]
    tx = HYBRID["per_head_muon"][0]()
    params = {k: jnp.asarray(v) for k, v in start.items()}
    plan = zero.make_plan(zero.param_metas(params), 8, "flat", optimizer=f"muon(heads={PER_HEAD_COUNTS!r})")
    state, step = jax_mesh.init(tx, params, plan, mesh_of(8)), jax_mesh.update(tx, plan, mesh_of(8))
    for g in steps:
        params, state = step({k: jnp.asarray(v) for k, v in g.items()}, state, params)

    def torch_layout(k, x):  # (in, H, d) -> (H * d, in)
        return x.transpose(1, 2, 0).reshape(-1, x.shape[0]) if k in PER_HEAD_COUNTS else x

    dims = {k: Dims(1, 0, heads=PER_HEAD_COUNTS[k]) if k in PER_HEAD_COUNTS else (Dims() if k == "w" else None)
            for k in PER_HEAD}
    ttx = F.contrib.muon(1e-2, muon_weight_dimension_numbers=dims)
    tp = {k: torch.tensor(torch_layout(k, v)) for k, v in start.items()}
    tstate = ttx.init(tp)
    for g in steps:
        u, tstate = ttx.update({k: torch.tensor(torch_layout(k, v)) for k, v in g.items()}, tstate, tp)
        tp = F.apply_updates(tp, u)
    return max(float(np.abs(torch_layout(k, np.asarray(params[k])) - tp[k].numpy()).max()
                     / np.abs(tp[k].numpy() - torch_layout(k, start[k])).max()) for k in PER_HEAD)


def orbax_moves(folder: str) -> dict:
    """10 AdamW steps on 8 devices under a flat plan, saved with Orbax (twice: the second replaces
    the first), restored on 4 devices under a whole-param plan, 10 more steps: against 20 steps
    uninterrupted. What each device read, and the errors of a wrong restore."""
    from zero.backends.jax_mesh import checkpoint

    rng = np.random.default_rng(7)
    params = tree_of(rng, np.float32)
    grads = [tree_of(rng, np.float32) for _ in range(20)]
    tx, metas = optax.adamw(1e-2, weight_decay=0.1), zero.param_metas(params)
    flat8, whole4 = zero.make_plan(metas, 8, "flat", bucket_numel=1000), zero.make_plan(metas, 4, "sorted_greedy")
    step8 = jax_mesh.update(tx, flat8, mesh_of(8))
    alone, state = params, jax_mesh.init(tx, params, flat8, mesh_of(8))
    for k in range(20):
        alone, state = step8(grads[k], state, alone)
    p, state = params, jax_mesh.init(tx, params, flat8, mesh_of(8))
    path = os.path.join(folder, "orbax_ckpt")
    checkpoint.save(path, state, flat8, mesh_of(8), params=p)  # an older checkpoint, replaced below
    for k in range(10):
        p, state = step8(grads[k], state, p)
    checkpoint.save(path, state, flat8, mesh_of(8), params=p)
    reads: dict[int, int] = {}
    p, state = checkpoint.restore(path, tx, params, whole4, mesh_of(4), reads=reads)
    restored_bytes = jax_mesh.state_bytes(state, mesh_of(4))
    step4 = jax_mesh.update(tx, whole4, mesh_of(4))
    for k in range(10, 20):
        p, state = step4(grads[k], state, p)
    errors, wider = {}, {**params, "w1": jnp.zeros((16, 34))}
    for name, call in {
        "other_rule": lambda: checkpoint.restore(path, optax.sgd(1e-2, momentum=0.9), params, whole4, mesh_of(4)),
        "other_params": lambda: checkpoint.restore(path, tx, wider, zero.make_plan(zero.param_metas(wider), 4),
                                                   mesh_of(4)),
        "no_checkpoint": lambda: checkpoint.restore(os.path.join(folder, "nothing"), tx, params, whole4, mesh_of(4)),
    }.items():
        try:
            call()
            errors[name] = "no error"
        except ValueError as err:
            errors[name] = f"ValueError: {err}"
    errors["damaged"], errors["mismatch"], errors["unverified"] = damaged_and_unverified(path, folder, tx, params,
                                                                                          whole4)
    # the plan's bytes, less torch's per-param step (Optax keeps one count, replicated)
    own = [whole4.ranks[r].state_bytes - 4 * len(whole4.partition.params_of(r)) for r in range(4)]
    return {"rel": worst(jax.tree.map(np.asarray, p), jax.tree.map(np.asarray, alone)),
            "reads": [reads.get(r, 0) for r in range(4)], "own_bytes": own,
            "restored_bytes": restored_bytes, "device_bytes": jax_mesh.device_bytes(tx, params, whole4),
            "errors": errors, "siblings": sorted(n for n in os.listdir(folder) if n.startswith("orbax_ckpt."))}


def damaged_and_unverified(path: str, folder: str, tx, params, plan) -> tuple[str, str, list[str]]:
    """The checkpoint with 8 bytes of its largest data files changed (restore's error: tensorstore's
    own check of its files may see it first), with one piece's recorded checksum not the data's
    (zero's check: data changed where tensorstore would not see it), and without its checksums, as
    an older zero wrote it (restore's warnings)."""
    import shutil
    import warnings

    from zero.backends.jax_mesh import checkpoint

    bad, old = os.path.join(folder, "orbax_damaged"), os.path.join(folder, "orbax_old")
    shutil.copytree(path, bad)
    shutil.copytree(path, old)
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(bad, "state")) for f in fs if "/d/" in r + "/"]
    # the largest size: the state's data; Orbax may keep two files of it (its merged and its
    # per-process copy), and which one a restore reads is Orbax's choice, so damage both
    largest = max(map(os.path.getsize, files))
    for biggest in (f for f in files if os.path.getsize(f) == largest):
        data = bytearray(open(biggest, "rb").read())
        data[len(data) // 2:len(data) // 2 + 8] = bytes(255 - b for b in data[len(data) // 2:len(data) // 2 + 8])
        open(biggest, "wb").write(bytes(data))
    damaged = _restore_error(checkpoint, bad, tx, params, plan)
    tampered = os.path.join(folder, "orbax_tampered")
    shutil.copytree(path, tampered)
    meta_path = os.path.join(tampered, "zero", "metadata")
    meta = json.load(open(meta_path))
    piece = next(p for name, ps in sorted(meta["checksums"].items()) if name.startswith("state/") for p in ps)
    piece[2] = format(int(piece[2], 16) ^ 1, "016x")
    json.dump(meta, open(meta_path, "w"))
    mismatch = _restore_error(checkpoint, tampered, tx, params, plan)
    meta_path = os.path.join(old, "zero", "metadata")
    meta = json.load(open(meta_path))
    del meta["checksums"]
    json.dump(meta, open(meta_path, "w"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.restore(old, tx, params, plan, mesh_of(4))
    return damaged, mismatch, [f"{w.category.__name__}: {w.message}" for w in caught if "checksums" in str(w.message)]


def _restore_error(checkpoint, path: str, tx, params, plan) -> str:
    try:
        checkpoint.restore(path, tx, params, plan, mesh_of(4))
        return "no error"
    except ValueError as err:
        return f"ValueError: {err}"


def hybrid_orbax(folder: str) -> dict:
    """Muon, 10 steps on 8 devices under a hybrid plan, saved with Orbax, restored on 2 devices
    (each owning several matrices now), 10 more: against 20 uninterrupted. The saved state also
    goes to DCP under Optax's paths and back to Orbax, and restores bitwise the same."""
    from zero.backends.checkpoint import convert
    from zero.backends.jax_mesh import checkpoint

    rng = np.random.default_rng(11)
    tree = lambda: {k: jnp.asarray(rng.standard_normal(s), np.float32) for k, s in MATRICES.items()}
    params, grads = tree(), [tree() for _ in range(20)]
    tx, metas = HYBRID["muon"][0](), zero.param_metas(params)
    at8, at2 = (zero.make_plan(metas, n, "flat", optimizer="muon") for n in (8, 2))
    step8 = jax_mesh.update(tx, at8, mesh_of(8))
    alone, state = params, jax_mesh.init(tx, params, at8, mesh_of(8))
    for k in range(20):
        alone, state = step8(grads[k], state, alone)
    p, state = params, jax_mesh.init(tx, params, at8, mesh_of(8))
    for k in range(10):
        p, state = step8(grads[k], state, p)
    path = os.path.join(folder, "hybrid_ckpt")
    checkpoint.save(path, state, at8, mesh_of(8), params=p, tx=tx)
    reads: dict[int, int] = {}
    p, state = checkpoint.restore(path, tx, params, at2, mesh_of(2), reads=reads)
    restored = jax.tree.leaves((p, state))
    convert.to_dcp(path, os.path.join(folder, "hybrid_dcp"), names="optax")
    convert.to_orbax(os.path.join(folder, "hybrid_dcp"), os.path.join(folder, "hybrid_again"))
    again = jax.tree.leaves(checkpoint.restore(os.path.join(folder, "hybrid_again"), tx, params, at2, mesh_of(2)))
    same = [bool(np.array_equal(np.asarray(a), np.asarray(b))) for a, b in zip(restored, again)]  # before donation
    owned = [[list(MATRICES)[i] for i in at2.partition.params_of(r)] for r in range(2)]
    # its own bytes: Adam's two moments of its flat slice, Muon's momentum of its matrices (float32)
    own = [4 * (2 * sum(b.owned[r] for b in jax_mesh.packing(at2))
                + sum(int(np.prod(MATRICES[n])) for n in owned[r])) for r in range(2)]
    bytes_after = jax_mesh.state_bytes(state, mesh_of(2))
    step2 = jax_mesh.update(tx, at2, mesh_of(2))
    for k in range(10, 20):
        p, state = step2(grads[k], state, p)
    try:
        checkpoint.save(path, state, at2, mesh_of(2))
        no_tx = "no error"
    except ValueError as err:
        no_tx = f"ValueError: {err}"
    return {"rel": worst(jax.tree.map(np.asarray, p), jax.tree.map(np.asarray, alone)), "owned": owned,
            "reads": [reads.get(r, 0) for r in range(2)], "own_bytes": own, "bytes": bytes_after,
            "device_bytes": jax_mesh.device_bytes(tx, params, at2),
            "round_trip_equal": same, "no_tx": no_tx}


def main() -> None:
    with open(sys.argv[1]) as f:
        plan_texts = json.load(f)
    out = {"parity": {f"{rule}-{kind}-{np.dtype(dt).name}": parity(rule, kind, dt)
                      for rule in RULES for kind in PLANS for dt in (np.float64,)},
           "errors": errors(), "two_executors": two_executors(plan_texts),
           "checkpoint": checkpoint_moves(os.path.dirname(sys.argv[1])),  # the test's own temporary folder
           "two_axes": two_axes(), "hybrid": {name: hybrid(name) for name in HYBRID},
           "hybrid_fed_back": {name: hybrid_fed_back(name) for name in ("muon", "adafactor")},
           "soap_against_zero": soap_against_zero(), "per_head_against_zero": per_head_against_zero(),
           "orbax": orbax_moves(os.path.dirname(sys.argv[1])),
           "hybrid_orbax": hybrid_orbax(os.path.dirname(sys.argv[1]))}
    out["parity"].update({f"{rule}-{kind}-float32": parity(rule, kind, np.float32)
                          for rule, kind in (("adamw", "flat"), ("clip_adam", "whole"))})
    out["parity"]["adamw-flat-mixed"] = parity("adamw", "flat", "mixed")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
