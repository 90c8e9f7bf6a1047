"""zero: sharded optimizers whose plans are values.

``import zero`` loads the plan layer only (standard library); names from the other layers
resolve on first access, importing torch then.
"""

from zero.accounting import OPTIMIZERS
from zero.accounting import state_bytes
from zero.ddp import assign_ddp_buckets
from zero.ddp import ddp_buckets
from zero.layout import bucket_views
from zero.layout import flat_layout
from zero.layout import split_bucket
from zero.layout import sync_rows
from zero.meta import ParamMeta
from zero.meta import param_metas
from zero.partition import Partition
from zero.partition import partition
from zero.plan import Plan
from zero.plan import make_plan

__all__ = [
    "OPTIMIZERS",
    "ParamMeta",
    "Partition",
    "Plan",
    "ZeroRedundancyOptimizer",
    "assign_ddp_buckets",
    "bucket_views",
    "ddp_buckets",
    "flat_layout",
    "make_plan",
    "param_metas",
    "partition",
    "split_bucket",
    "state_bytes",
    "sync_rows",
]

_LAZY = {"ZeroRedundancyOptimizer": "zero.backends"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zero' has no attribute {name!r}")
