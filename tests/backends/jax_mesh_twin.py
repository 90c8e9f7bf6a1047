"""A model both executors build from the same numbers: shapes, initial values and gradients in
numpy only, so the torch ranks and the JAX mesh (separate processes) start and step alike."""

from __future__ import annotations

import numpy as np

# torch.nn.Sequential(Linear(7, 33), Linear(33, 5), Linear(5, 64)): uneven sizes, registration order
SHAPES = [(33, 7), (33,), (5, 33), (5,), (64, 5), (64,)]
STEPS = 20


def initial(dtype=np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(s).astype(dtype) for s in SHAPES]


def grads(step: int, dtype=np.float64) -> list[np.ndarray]:
    """Step ``step``'s gradients, as every rank's DDP would leave them (the same everywhere)."""
    rng = np.random.default_rng(1000 + step)
    return [rng.standard_normal(s).astype(dtype) for s in SHAPES]
