"""Bitwise claims and thread counts: ZeRO on 2 one-thread ranks (`zero.tools.launch.run` gives each
rank one thread) against one process stepping the same model with 1 and with 2 intra-op threads.

    python bench/threads_check.py [--steps 12]

Prints, per thread count of the single process, the largest relative difference of any param and
whether every param is bitwise equal.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "tests")]
from helpers import groups_of, make_model  # noqa: E402

from zero.tools.launch import run  # noqa: E402


def train(opt_of, steps: int) -> list[torch.Tensor]:
    model = make_model("net", dtype=torch.float32)
    opt = opt_of(groups_of(model))
    for k in range(steps):
        model.zero_grad()
        x = torch.randn(512, 7, generator=torch.Generator().manual_seed(k))
        model(x).square().mean().backward()  # every rank the same batch: no gradient averaging needed
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def ranks(rank: int, world_size: int, steps: int) -> list[torch.Tensor]:
    import zero

    return train(lambda groups: zero.ZeroRedundancyOptimizer(groups, torch.optim.Adam, lr=1e-2), steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    got = run(ranks, 2, args.steps)[0]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        ref = train(lambda groups: torch.optim.Adam(groups, lr=1e-2), args.steps)
        worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))
        print(f"one process, {threads} thread(s): largest relative difference {worst:.2e}, "
              f"bitwise equal: {all(torch.equal(a, b) for a, b in zip(got, ref))}")


if __name__ == "__main__":
    main()
