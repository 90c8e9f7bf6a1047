"""An Optax step on a JAX device mesh: zero's plan-placed state against Optax unsharded.

The params are a GPT-style model's (``--layers`` blocks of width ``--width``, embeddings, norms and
biases: about 10.7M floats at the defaults), replicated on ``--devices`` CPU devices, with
gradients given. Rows, each a jitted step ``(grads, state, params) -> (params, state)``:

- Optax unsharded, replicated: plain ``jit`` over the mesh, the state on every device (what data
  parallelism without ZeRO holds);
- Optax on one device: the same step, state and params on the first device only;
- ``zero.backends.jax_mesh`` with a flat plan, and with a whole-param plan (``sorted_greedy``);
- ``--rule muon`` (``optax.contrib.muon``): instead of those two, GSPMD (the same ``jit`` with
  each state leaf sharded along its first dimension where it divides: XLA partitions Muon's
  Newton-Schulz across devices with collectives between), and ``zero.backends.jax_mesh`` with a
  hybrid plan (``make_plan(..., "flat", optimizer="muon")``: each matrix on its owner device).

Times are medians of ``--repeat`` runs of ``--steps`` steps, after a compiling step; bytes are the
optimizer state each device holds (``addressable_shards``). The devices are XLA's host devices,
sharing this machine's cores: a ratio of times here says what the executor costs in work and
copies, not what a mesh of accelerators would gain.
Usage: python bench/jax_mesh_bench.py [--devices 8] [--rule adamw|clip_adam|muon] [--repeat 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rule", choices=("adamw", "clip_adam", "muon"), default="adamw")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    return parser.parse_args()


ARGS = arguments()
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ARGS.devices}"  # before jax starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import zero  # noqa: E402
from zero.backends import jax_mesh  # noqa: E402


def gpt_params(layers: int, width: int, vocab: int = 4096, context: int = 512) -> dict:
    shapes = {"wte": (vocab, width), "wpe": (context, width), "ln_f": (width,)}
    for i in range(layers):
        shapes |= {f"h{i:02d}.qkv": (width, 3 * width), f"h{i:02d}.qkv_b": (3 * width,),
                   f"h{i:02d}.proj": (width, width), f"h{i:02d}.fc": (width, 4 * width),
                   f"h{i:02d}.fc_b": (4 * width,), f"h{i:02d}.fc_proj": (4 * width, width),
                   f"h{i:02d}.ln_1": (width,), f"h{i:02d}.ln_2": (width,)}
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s, dtype=np.float32) * 0.02 for k, s in shapes.items()}


def rule(name: str) -> optax.GradientTransformation:
    if name == "adamw":
        return optax.adamw(1e-3, weight_decay=0.1)
    if name == "muon":
        return optax.contrib.muon(1e-3, weight_decay=0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))


def plain_step(tx):
    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=1)


def time_steps(step, grads, state, params) -> tuple[float, object]:
    params, state = step(grads, state, params)  # compiles
    jax.block_until_ready(params)
    runs = []
    for _ in range(ARGS.repeat):
        start = time.perf_counter()
        for _ in range(ARGS.steps):
            params, state = step(grads, state, params)
        jax.block_until_ready((params, state))
        runs.append((time.perf_counter() - start) / ARGS.steps * 1e3)
    return statistics.median(runs), state


def per_device_bytes(state, devices) -> list[int]:
    out = {d: 0 for d in devices}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return [out[d] for d in devices]


def main() -> None:
    devices = jax.devices()[:ARGS.devices]
    mesh = Mesh(np.array(devices), ("data",))
    host = gpt_params(ARGS.layers, ARGS.width)
    replicated, first = NamedSharding(mesh, PartitionSpec()), SingleDeviceSharding(devices[0])
    grads_host = jax.tree.map(lambda x: x * 0.5 + 0.01, host)
    tx = rule(ARGS.rule)
    rows = []
    for label, where in (("Optax unsharded, replicated", replicated), ("Optax on one device", first)):
        params, grads = jax.device_put(host, where), jax.device_put(grads_host, where)
        state = jax.jit(tx.init, out_shardings=where)(params)
        ms, state = time_steps(plain_step(tx), grads, state, params)
        rows.append((label, ms, per_device_bytes(state, devices)))
    params, grads = jax.device_put(host, replicated), jax.device_put(grads_host, replicated)
    metas = zero.param_metas(params)
    if ARGS.rule == "muon":
        rows.append(gspmd_row(tx, mesh, grads, params, devices))
        plans = (("zero jax_mesh, hybrid plan", zero.make_plan(metas, ARGS.devices, "flat", optimizer="muon")),)
    else:
        plans = (("zero jax_mesh, flat plan", zero.make_plan(metas, ARGS.devices, "flat")),
                 ("zero jax_mesh, whole plan", zero.make_plan(metas, ARGS.devices, "sorted_greedy")))
    for label, plan in plans:
        state = jax_mesh.init(tx, params, plan, mesh)
        ms, state = time_steps(jax_mesh.update(tx, plan, mesh), grads, state, params)
        rows.append((label, ms, per_device_bytes(state, devices)))
    report(rows, sum(x.size for x in host.values()))


def gspmd_row(tx, mesh, grads, params, devices) -> tuple:
    """The rule under plain ``jit`` with its state sharded along each leaf's first dimension where
    the device count divides it (replicated elsewhere): GSPMD partitions the step to match."""
    def place(x):
        spec = PartitionSpec("data") if x.ndim and x.shape[0] % len(devices) == 0 else PartitionSpec()
        return NamedSharding(mesh, spec)

    shardings = jax.tree.map(place, jax.eval_shape(tx.init, params))
    state = jax.jit(tx.init, out_shardings=shardings)(params)
    replicated = NamedSharding(mesh, PartitionSpec())

    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(step, donate_argnums=1, out_shardings=(replicated, shardings))
    ms, state = time_steps(jitted, grads, state, params)
    return "GSPMD: jit, state sharded by dim 0", ms, per_device_bytes(state, devices)


def report(rows, numel: int) -> None:
    base = rows[0][1]
    table = Table(title=f"{ARGS.rule} step, {numel / 1e6:.1f}M float32 params, {ARGS.devices} CPU devices "
                        f"({os.cpu_count()} cores), median of {ARGS.repeat} x {ARGS.steps} steps")
    for col in ("executor", "ms / step", "vs replicated", "state MiB: max device", "min device", "all devices"):
        table.add_column(col, justify="left" if col == "executor" else "right")
    for label, ms, nbytes in rows:
        table.add_row(label, f"{ms:.1f}", f"{ms / base:.2f}x", f"{max(nbytes) / 2**20:.2f}",
                      f"{min(nbytes) / 2**20:.2f}", f"{sum(nbytes) / 2**20:.2f}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
