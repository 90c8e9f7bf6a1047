"""What comparing the masters with their params costs the step (issue #41, item 11).

Before each step `zero.backends.precision.Masters` compares every master, rounded to its
param's dtype, with the param, exactly, so weights loaded after the optimizer was built (or
changed by ``nn.init``, ``.data`` writes) are taken instead of written over. This times
``ZeroRedundancyOptimizer.step`` with fp32 masters over bf16 params on one gloo rank (the step
of what a rank holds), with the comparison on and off (its public ``Masters.check`` flag),
taking turns step by step so drift hits both alike.

    python bench/masters_check_bench.py [--layers 8] [--width 1024] [--steps 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import zero


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    model = model.to(torch.bfloat16)
    opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, master_dtype=torch.float32, lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    masters = opt.rank_state.masters
    times: dict[str, list[float]] = {"masters compared with the params": [], "comparison removed": []}
    try:
        for _ in range(args.steps + 2):
            for name in times:
                masters.check = name.startswith("masters")
                start = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - start)
    finally:
        dist.destroy_process_group()
    n = sum(p.numel() for p in model.parameters())
    table = Table(title=f"ZeroRedundancyOptimizer.step, AdamW, fp32 masters, {n / 1e6:.1f}M bf16 params, "
                        f"1 rank, {args.threads} thread(s), median of {args.steps}")
    for col in ("step", "ms", "ratio"):
        table.add_column(col, justify="left" if col == "step" else "right")
    base = statistics.median(times["comparison removed"][2:])
    for name, ts in times.items():
        ms = statistics.median(ts[2:])
        table.add_row(name, f"{ms * 1e3:.1f}", f"{ms / base:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
