"""zero: sharded optimizers whose plans are values.

- ``plans/``: pure functions of parameter metadata: who owns what, layouts, costs, what a rank holds.
- ``functional/``: Optax-shaped update rules on torch tensors, and adapters to torch.optim and Optax.
- ``backends/``: execution (the only layer touching torch.distributed): ZeRO, its modes, state formats.
- ``tools/``: programs on top of the layers (the command line, the demo, the launcher).

``import zero`` loads the plan layer only (`zero.plans`, standard library); names from the other layers
resolve on first access, importing torch then.
"""

from zero._lazy import module_getattr
from zero.plans.accounting import OPTIMIZERS
from zero.plans.accounting import state_bytes
from zero.plans.ddp_buckets import assign_ddp_buckets
from zero.plans.ddp_buckets import ddp_buckets
from zero.plans.diff import diff_plans
from zero.plans.holdings import holdings
from zero.plans.layout import bucket_views
from zero.plans.layout import flat_layout
from zero.plans.layout import split_bucket
from zero.plans.layout import sync_rows
from zero.plans.meta import ParamMeta
from zero.plans.meta import param_metas
from zero.plans.partition import Partition
from zero.plans.partition import partition
from zero.plans.plan import Plan
from zero.plans.plan import make_plan
from zero.plans.presets import preset

__all__ = [
    "OPTIMIZERS",
    "ParamMeta",
    "Partition",
    "Plan",
    "ZeroRedundancyOptimizer",
    "assign_ddp_buckets",
    "bucket_views",
    "ddp_buckets",
    "diff_plans",
    "flat_layout",
    "holdings",
    "make_plan",
    "param_metas",
    "partition",
    "preset",
    "split_bucket",
    "state_bytes",
    "sync_rows",
]

# ZeroRedundancyOptimizer from the backends, and the subpackages (zero.backends, zero.functional,
# zero.tools ...), on first access: importing them loads torch
__getattr__ = module_getattr(__name__, {"ZeroRedundancyOptimizer": "zero.backends"})
