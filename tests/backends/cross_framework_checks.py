"""The JAX side of `test_cross_framework.py`, run in a subprocess with 8 CPU devices: a torch
run's DCP checkpoint of step 10 converted to Orbax, restored on a 4-device mesh with
``optax.adamw``, stepped to 20 and to 30; at 20 saved with Orbax and converted to DCP for the
torch ranks. Prints the params at 20 and 30 as JSON.

``python tests/backends/cross_framework_checks.py FOLDER`` (FOLDER holds ``dcp10``; writes ``dcp20``).
"""

from __future__ import annotations

import json
import os
import sys

from xla_devices import flags_with_devices  # noqa: E402  (beside this script; imports nothing)

os.environ["XLA_FLAGS"] = flags_with_devices(8)  # run by hand too: 8 devices, before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from cross_framework_workers import BETAS, EPS, LR, WD  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax_mesh_twin import SHAPES, grads  # noqa: E402

import zero  # noqa: E402
from zero.backends import jax_mesh  # noqa: E402
from zero.backends.checkpoint import convert  # noqa: E402

NAMES = [f"{layer}.{kind}" for layer in range(3) for kind in ("weight", "bias")]


def main(folder: str) -> None:
    meta = convert.to_orbax(os.path.join(folder, "dcp10"), os.path.join(folder, "orbax10"))
    template = {n: jnp.zeros(s, jnp.float32) for n, s in zip(NAMES, SHAPES)}
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    plan = zero.make_plan(zero.param_metas(template), 4, "sorted_greedy")
    tx = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    params, state = jax_mesh.restore(os.path.join(folder, "orbax10"), tx, template, plan, mesh)
    step = jax_mesh.update(tx, plan, mesh)
    g = lambda k: {n: jnp.asarray(x, jnp.float32) for n, x in zip(NAMES, grads(k))}
    for k in range(10, 20):
        params, state = step(g(k), state, params)
    at20 = [np.asarray(params[n]).tolist() for n in NAMES]
    jax_mesh.save(os.path.join(folder, "orbax20"), state, plan, mesh, params=params)
    convert.to_dcp(os.path.join(folder, "orbax20"), os.path.join(folder, "dcp20"))
    # a zero.functional rule's names: Optax's paths, there and back
    convert.to_dcp(os.path.join(folder, "orbax20"), os.path.join(folder, "dcp20_optax"), names="optax")
    convert.to_orbax(os.path.join(folder, "dcp20_optax"), os.path.join(folder, "orbax20_again"))
    again = jax_mesh.restore(os.path.join(folder, "orbax20_again"), tx, template, plan, mesh)
    same = [bool(np.array_equal(np.asarray(a), np.asarray(b))) for a, b in zip(jax.tree.leaves((params, state)),
                                                                              jax.tree.leaves(again))]
    for k in range(20, 30):
        params, state = step(g(k), state, params)
    print(json.dumps({"at20": at20, "at30": [np.asarray(params[n]).tolist() for n in NAMES],
                      "nodes": meta["nodes"], "names": meta["names"], "round_trip_equal": same}))


if __name__ == "__main__":
    main(sys.argv[1])
