"""Execution: the only layer that imports ``torch.distributed``.

It takes plans from `zero` and transformations from `zero.functional` and runs collectives.
"""

from zero.backends.zero_optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
