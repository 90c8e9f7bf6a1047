"""torch's ``get_state_dict`` (what torchtitan's checkpointer calls at every save) on zero's
optimizers against ``torch.optim.AdamW`` on the same FSDP2 model, in the same run.

The GPT-style model of ``fsdp2_bench.py`` under ``fully_shard`` on gloo ranks; then, taking
turns, a step (not timed: a checkpoint follows steps) and
``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt)`` (timed) for:
``torch.optim.AdamW(foreach=True)``, ``zero.functional.Optimizer`` with
``from_torch(torch.optim.AdamW)`` (torch's names), with ``zero.functional.adamw`` (zero's paths),
and ``zero.ZeroRedundancyOptimizer(params, torch.optim.AdamW)`` (on a 1-D mesh: the same state as
``zero.functional.Optimizer``). Each row: the median ms (the slowest rank's), the state tensors it
returned, and the ratio to torch's. Before, zero's optimizers returned no state tensor and stepped.
Usage: python bench/state_dict_bench.py [--ranks 2] [--repeat 21] [--width 256] [--layers 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from fsdp2_bench import sharded  # noqa: E402

import zero.functional as F  # noqa: E402

SYSTEMS = {
    "torch.optim.AdamW(foreach=True)": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.01,
                                                                    foreach=True),
    "zero F.Optimizer(from_torch(AdamW))": lambda m: F.Optimizer(m.parameters(), F.from_torch(
        torch.optim.AdamW, lr=3e-4, weight_decay=0.01)),
    "zero F.Optimizer(F.adamw)": lambda m: F.Optimizer(m.parameters(), F.adamw(3e-4, weight_decay=0.01)),
    "zero ZeroRedundancyOptimizer(AdamW)": lambda m: _zero(m),
}


def _zero(model):
    from zero import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4, weight_decay=0.01)


def worker(rank: int, world_size: int, layers: int, width: int, repeat: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    built = []
    for make in SYSTEMS.values():
        model = sharded(layers, width)
        opt = make(model)
        idx = torch.randint(0, 4096, (4, 128), generator=torch.Generator().manual_seed(rank))
        model(idx).logsumexp(-1).mean().backward()  # the gradients every round's step takes again
        opt.step()
        built.append((model, opt))
    times, tensors = [[] for _ in built], [0] * len(built)
    for _ in range(repeat):
        for k, (model, opt) in enumerate(built):
            opt.step()  # a step between saves, as in training (not timed)
            dist.barrier()
            t0 = time.perf_counter()
            osd = get_state_dict(model, opt)[1]
            times[k].append(time.perf_counter() - t0)
            tensors[k] = sum(isinstance(v, torch.Tensor) for st in osd["state"].values() for v in st.values())
    return {name: (statistics.median(t) * 1e3, n) for name, t, n in zip(SYSTEMS, times, tensors)}


def main() -> None:
    from zero.tools.launch import run

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    rows = run(worker, args.ranks, args.layers, args.width, args.repeat, timeout=900)
    reference = max(r["torch.optim.AdamW(foreach=True)"][0] for r in rows)
    print(f"get_state_dict on FSDP2 ({args.ranks} gloo ranks, {args.layers} layers of width {args.width}), "
          "median of the slowest rank")
    print(f"{'optimizer':40s} {'ms':>8s} {'tensors':>8s} {'vs torch':>9s}")
    for name in SYSTEMS:
        ms = max(r[name][0] for r in rows)
        print(f"{name:40s} {ms:8.2f} {rows[0][name][1]:8d} {ms / reference:8.2f}x")


if __name__ == "__main__":
    main()
