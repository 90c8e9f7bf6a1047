"""Torch's own ZeroRedundancyOptimizer, built without a process group, as a planning reference.

Torch asks `torch.distributed` for the world size and rank in its constructor; patching those
answers lets us read torch's partition for any world size, with meta parameters and no memory.
"""

import contextlib
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.optim.zero_redundancy_optimizer import _OverlapStatus


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    with mock.patch.object(dist, "get_world_size", lambda group=None: world_size), \
         mock.patch.object(dist, "get_rank", lambda group=None: rank), \
         mock.patch.object(dist.distributed_c10d, "get_global_rank", lambda group, r: r), \
         mock.patch.object(dist, "get_debug_level", lambda: dist.DebugLevel.OFF):
        yield


def torch_zero(param_groups, world_size: int, **kwargs) -> ZeroRedundancyOptimizer:
    with fake_world(world_size):
        return ZeroRedundancyOptimizer(param_groups, torch.optim.SGD, lr=0.1, **kwargs)


def torch_partition(param_groups, world_size: int) -> list[list[torch.Tensor]]:
    """Per rank, the parameters torch's local optimizer receives, in order."""
    opt = torch_zero(param_groups, world_size)
    with fake_world(world_size):
        return [[p for g in groups for p in g["params"]] for groups in opt._partition_parameters()]


def torch_ddp_assignment(bucket_numels, world_size: int, shard_buckets: bool):
    """Torch's overlap_with_ddp bucket assignment, as {bucket: (offset, count)} per rank."""
    buckets = [[torch.empty(n, device="meta", requires_grad=True) for n in b] for b in bucket_numels]
    opt = torch_zero([p for b in buckets for p in b], world_size, overlap_with_ddp=True)
    info = opt._overlap_info
    info.status = _OverlapStatus.INITIALIZED
    info.shard_buckets = shard_buckets
    info.params_per_bucket = buckets
    info.total_size = sum(map(sum, bucket_numels))
    with fake_world(world_size):
        per_rank = opt._bucket_assignments_per_rank
    return [{i: (a.offset, len(a.parameters)) for i, a in r.items()} for r in per_rank]
