"""The plan layer: pure functions from parameter metadata to placement and cost (stdlib only).

metadata (`meta`) -> ownership (`partition`) or element shards (`layout.flat_layout`) -> bucket
and sync layouts (`layout`), DDP buckets (`ddp_buckets`), what each rank's local optimizer sees
(`shards`) -> what it all costs (`accounting`, `cost`) -> one printable, saveable `Plan` (`plan`).
`averaging_schedule` is post-local SGD's schedule; `presets` are shape lists of known models.
"""

from zero.plans.accounting import OPTIMIZERS
from zero.plans.accounting import state_bytes
from zero.plans.ddp_buckets import assign_ddp_buckets
from zero.plans.ddp_buckets import ddp_buckets
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
    "assign_ddp_buckets",
    "bucket_views",
    "ddp_buckets",
    "flat_layout",
    "make_plan",
    "param_metas",
    "partition",
    "preset",
    "split_bucket",
    "state_bytes",
    "sync_rows",
]
