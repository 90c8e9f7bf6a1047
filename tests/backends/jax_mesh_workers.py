"""The torch side of the two-executor test: `ZeroRedundancyOptimizer` running a saved plan on
gloo ranks over the twin of `jax_mesh_twin` (the JAX side is `jax_mesh_checks.py`)."""

from __future__ import annotations

import torch
from jax_mesh_twin import SHAPES, STEPS, grads, initial
from torch import nn

import zero
import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero


def twin_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(7, 33), nn.Linear(33, 5), nn.Linear(5, 64)).double()
    with torch.no_grad():
        for p, value in zip(model.parameters(), initial()):
            p.copy_(torch.from_numpy(value))
    assert [tuple(p.shape) for p in model.parameters()] == SHAPES
    return model


def run_plans(rank: int, world_size: int, plan_texts: list[str]) -> list[dict]:
    """Each plan: 20 AdamW steps; the params, and this rank's bytes of per-param state."""
    out = []
    for text in plan_texts:
        model = twin_model()
        opt = Zero(model.parameters(), zf.adamw(1e-2, weight_decay=0.1), plan=zero.Plan.from_json(text))
        for step in range(STEPS):
            for p, g in zip(model.parameters(), grads(step)):
                p.grad = torch.from_numpy(g)
            opt.step()
        out.append({"params": [p.detach().numpy().tolist() for p in model.parameters()],
                    "state_bytes": opt.optim.state_nbytes()})  # per-param state, not the counts
    return out
