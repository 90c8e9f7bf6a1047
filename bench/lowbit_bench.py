"""Low-bit Adam state (issue #42): what a rank holds, from the plan, and what a step costs.

1. LLaMA-7B (bf16 params, fp32 masters) under flat plans at 8 and 64 ranks: each rank's
   optimizer state, masters and total (ZeRO-1 and ZeRO-2) with fp32 AdamW state, 8-bit and 4-bit
   state, and the padding the block-aligned cuts cost. Beside them, at one rank without masters
   (torchao's setting), how much state each saves against AdamW, and the difference of torchao's
   published peaks (Llama2-7B fine-tune: AdamW 51.6 GB, AdamW8bit 39.1 GB, AdamW4bit 33.2 GB; its
   README, which the issue cites).
2. The step on CPU, one process: ``zero.functional.Optimizer`` with ``adamw_8bit`` /
   ``adamw_4bit`` (in place) against torchao's ``AdamW8bit`` / ``AdamW4bit`` (its step compiled
   by ``torch.compile``; the first steps, which compile, are left out) and ``torch.optim.AdamW``
   (foreach), on the same params and gradients, taking turns step by step.

    python bench/lowbit_bench.py [--layers 8] [--width 1024] [--steps 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

import zero
import zero.functional as zf
from zero.functional import contrib

GIB = 2**30
PUBLISHED_GB = {"adamw": 51.6, "adamw8bit": 39.1, "adamw4bit": 33.2}  # torchao README, Llama2-7B peak


def plan_rows(console: Console) -> None:
    metas = zero.preset("llama-7b")
    table = Table(title="LLaMA-7B, bf16 params + fp32 masters, flat plans: GiB per rank (rank 0; every rank alike)")
    for col in ("ranks", "state", "optimizer state", "masters", "ZeRO-1 total", "ZeRO-2 total", "padding"):
        table.add_column(col, justify="right")
    for w in (8, 64):
        for name in ("adamw", "adamw8bit", "adamw4bit"):
            plan = zero.make_plan(metas, w, "flat", optimizer=name, master_dtype="float32")
            r = max(plan.ranks, key=lambda r: r.total_bytes)
            table.add_row(str(w), name, f"{r.state_bytes / GIB:.3f}", f"{r.master_bytes / GIB:.3f}",
                          f"{r.total_bytes / GIB:.2f}", f"{r.total_bytes_grads_sharded / GIB:.2f}",
                          f"{r.padding_bytes / 2**20:.2f} MiB")
    console.print(table)
    one = Table(title="One rank, no masters (torchao's setting): optimizer state, and what it saves against AdamW")
    for col in ("state", "state GB (plan)", "saved vs AdamW GB (plan)", "saved vs AdamW GB (torchao's peaks)"):
        one.add_column(col, justify="right")
    base = zero.make_plan(metas, 1, "sorted_greedy", optimizer="adamw").ranks[0].state_bytes
    for name in ("adamw", "adamw8bit", "adamw4bit"):
        state = zero.make_plan(metas, 1, "sorted_greedy", optimizer=name).ranks[0].state_bytes
        one.add_row(name, f"{state / 1e9:.2f}", f"{(base - state) / 1e9:.2f}",
                    f"{PUBLISHED_GB['adamw'] - PUBLISHED_GB[name]:.1f}")
    console.print(one)


def step_rows(console: Console, layers: int, width: int, steps: int, threads: int) -> None:
    from torchao.optim import AdamW4bit, AdamW8bit

    torch.manual_seed(0)
    shapes = [(width, width)] * layers + [(width,)] * layers
    start = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]

    def params():
        ps = [p.clone().requires_grad_() for p in start]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        return ps

    runs = {"torch.optim.AdamW (foreach, fp32 state)": torch.optim.AdamW(params(), lr=1e-4),
            "zero adamw_8bit (in place)": zf.Optimizer(params(), contrib.adamw_8bit(1e-4)),
            "torchao AdamW8bit (compiled)": AdamW8bit(params(), lr=1e-4),
            "zero adamw_4bit (in place)": zf.Optimizer(params(), contrib.adamw_4bit(1e-4)),
            "torchao AdamW4bit (compiled)": AdamW4bit(params(), lr=1e-4)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for k in range(steps + 3):
        for name, opt in runs.items():
            begin = time.perf_counter()
            opt.step()
            if k >= 3:  # torchao compiles in its first steps
                times[name].append(time.perf_counter() - begin)
    n = sum(p.numel() for p in start)
    table = Table(title=f"one step, {n / 1e6:.1f}M fp32 params in {len(shapes)} tensors, {threads} thread(s), "
                        f"median of {steps}")
    for col in ("optimizer", "ms", "vs torch AdamW"):
        table.add_column(col, justify="left" if col == "optimizer" else "right")
    base = statistics.median(times["torch.optim.AdamW (foreach, fp32 state)"])
    for name, ts in times.items():
        ms = statistics.median(ts)
        table.add_row(name, f"{ms * 1e3:.1f}", f"{ms / base:.2f}x")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=140)
    plan_rows(console)
    step_rows(console, args.layers, args.width, args.steps, args.threads)


if __name__ == "__main__":
    main()
