"""The whole peak with activations, simulated against real: a small LLaMA-style model (the presets'
names, `zero.backends.preset_models`) trained for real on gloo ranks and simulated on fake tensors
(``zero simulate ... --batch``), both measured by torch's own trackers (``FSDPMemTracker`` under
FSDP2 and HSDP, ``MemTracker`` under zero's ZeRO), per model size, batch and mesh.

Each row: the real rank 0's peak, the simulated one, their ratio, and the activations at the
simulated peak. Usage: python bench/activation_bench.py
"""

from __future__ import annotations

from zero.backends.fsdp2_peer import batch_run, run
from zero.backends.simulate import simulate, zero_batch_run
from zero.plans.presets import llama
from zero.tools.launch import run as run_ranks

SIZES = {"dim 256, 2 layers": (256, 688, 2), "dim 384, 3 layers": (384, 1024, 3)}  # (d, ff, layers)
BATCHES = ((1, 64), (4, 256))
MESHES = (("FSDP2, 2 ranks", 2, 1), ("HSDP, 2 x 2", 4, 2), ("ZeRO-1, 2 ranks", 2, 0))


def _fsdp2(rank: int, world_size: int, metas, batch, replicas):
    return batch_run(metas, batch, replicas=replicas).measured_peak_bytes


def _zero(rank: int, world_size: int, metas, batch):
    return zero_batch_run(metas, batch)[0]


def main() -> None:
    print("| model | batch | mesh | real peak (MB) | simulated (MB) | simulated / real | activations at it (MB) |")
    print("|---|---|---|---:|---:|---:|---:|")
    for size, shape in SIZES.items():
        d, ff, layers = shape
        metas = llama(d, ff, layers, d, vocab=1000, dtype="float32")
        for batch in BATCHES:
            for mesh, world_size, replicas in MESHES:
                if replicas:
                    real = run_ranks(_fsdp2, world_size, metas, batch, replicas)[0]
                    sim = run(metas, world_size, 0, batch=batch, replicas=replicas)
                    peak, act = sim.measured_peak_bytes, sim.measured_by_category["act"]
                else:
                    real = run_ranks(_zero, world_size, metas, batch)[0]
                    sim = simulate(metas, world_size, 0, batch=batch)
                    peak, act = sim.measured_peak_bytes, sim.activation_bytes
                print(f"| {size} | {batch[0]}x{batch[1]} | {mesh} | {real / 1e6:.3f} | {peak / 1e6:.3f} | "
                      f"{peak / real:.4f} | {act / 1e6:.3f} |")


if __name__ == "__main__":
    main()
