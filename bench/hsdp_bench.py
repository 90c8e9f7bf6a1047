"""HSDP (``fully_shard`` on a ``replicas x shards`` mesh) with the optimizer state over every rank:
whole iterations of `fsdp2_bench`'s GPT-style model on gloo ranks, each row against its reference in
the same run.

- AdamW: ``zero.ZeroRedundancyOptimizer(params, torch.optim.AdamW, ...)`` (each rank steps its part
  of its pieces, one all-gather per bucket over the replicas) against ``torch.optim.AdamW(foreach=True)``
  over the same HSDP params (every replica stepping, and holding the state of, its whole pieces).
- Muon (``contrib.muon``): zero over the replicas (each matrix by one owner in the mesh) against
  ``zero.functional.Optimizer`` over the same params (each replica's owners, so each matrix once
  per replica).

Columns: the median iteration (forward, backward, step, zero_grad; the slowest rank's, systems taking
turns), optimizer state per rank (tensor bytes), and the bytes zero's own collectives send per rank
in a step (FSDP2's, the same in every row, left out). One intra-op thread per rank.
Usage: python bench/hsdp_bench.py [--ranks 4] [--replicas 2] [--repeat 7] [--width 256] [--layers 12]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from fsdp2_bench import GPT, iterations_ms, muon_tx, state_bytes  # noqa: E402
from torch import nn  # noqa: E402

import zero  # noqa: E402
import zero.functional as F  # noqa: E402


def hsdp(layers: int, width: int, replicas: int) -> nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (replicas, dist.get_world_size() // replicas),
                            mesh_dim_names=("replicate", "shard"))
    model = GPT(layers, width)
    for block in model.h:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


PAIRS = {  # each system beside its reference, taking turns
    "AdamW": {"torch.optim.AdamW(foreach=True)": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4,
                                                                             weight_decay=0.01, foreach=True),
              "zero over the replicas": lambda m: zero.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW,
                                                                             lr=3e-4, weight_decay=0.01)},
    "Muon": {"zero.functional.Optimizer (per replica)": lambda m: F.Optimizer(m.named_parameters(), muon_tx()),
             "zero over the replicas": lambda m: zero.ZeroRedundancyOptimizer(m.named_parameters(), muon_tx())},
}


def worker(rank: int, world_size: int, layers: int, width: int, repeat: int, replicas: int) -> dict:
    rows = {}
    for kind, systems in PAIRS.items():
        pair = []
        for make in systems.values():
            model = hsdp(layers, width, replicas)
            pair.append((model, make(model)))
        for name, (_, opt), (ms, sent) in zip(systems, pair, iterations_ms(pair, repeat)):
            rows[f"{kind}: {name}"] = (ms, state_bytes(opt), sent)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from zero.tools.launch import run

    n = sum(p.numel() for p in GPT(args.layers, args.width).parameters())
    ranks = run(worker, args.ranks, args.layers, args.width, args.repeat, args.replicas, timeout=3000)
    shards = args.ranks // args.replicas
    table = Table(title=f"HSDP {args.replicas} replicas x {shards} shards on gloo, GPT-style {args.layers} x "
                        f"{args.width} ({n / 1e6:.1f}M params, fp32): one iteration, the slowest rank")
    for column in ("system", "ms", "vs reference", "state MiB / rank", "vs reference ", "step MiB sent / rank"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for kind, systems in PAIRS.items():
        ref = f"{kind}: {next(iter(systems))}"
        ref_ms, ref_state = max(r[ref][0] for r in ranks), max(r[ref][1] for r in ranks)
        for name in systems:
            row = f"{kind}: {name}"
            ms, state, sent = (max(r[row][k] for r in ranks) for k in range(3))
            table.add_row(row, f"{ms:.1f}", f"{ms / ref_ms:.2f}x", f"{state / 2**20:.2f}",
                          f"{state / ref_state:.2f}x", f"{sent / 2**20:.2f}")
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
