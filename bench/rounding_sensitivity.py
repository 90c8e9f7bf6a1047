"""How far a one-ulp change of every gradient moves a run, per rule: what a sharded executor's
reduce-scatter (which sums the ranks' gradients in another order) does to the gradient.

A small model with an embedding (its second-moment factor of one batch is rank-deficient: the
eigenbasis SOAP rotates into is not unique), a real backward, 20 steps in float32, one process;
the same run with every gradient moved one ulp up (``torch.nextafter``). Prints the worst
relative difference of a param. Usage: python bench/rounding_sensitivity.py [--steps 20]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import zero.functional as F
from zero.functional import contrib

RULES = {"SOAP": lambda: contrib.soap(1e-2, precondition_frequency=2), "AdamW": lambda: F.adamw(1e-2),
         "Muon": lambda: contrib.muon(1e-2)}


def run(rule, steps: int, ulp: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 64))
    opt = F.Optimizer(model.parameters(), rule())
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 8), generator=gen)
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 64), tokens.reshape(-1))
        opt.zero_grad()
        loss.backward()
        if ulp:
            for p in model.parameters():
                p.grad = torch.nextafter(p.grad, torch.full_like(p.grad, float("inf")))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"| rule | worst relative param difference after {args.steps} steps, one ulp apart |")
    print("|---|---|")
    for name, rule in RULES.items():
        a, b = run(rule, args.steps, False), run(rule, args.steps, True)
        print(f"| {name} | {max(float((x - y).norm() / x.norm()) for x, y in zip(a, b)):.2e} |")


if __name__ == "__main__":
    main()
