"""Workers for tests/tools/test_launch.py (importable, as zero.tools.launch.run needs)."""

import torch
import torch.distributed as dist


def tensors(rank, world_size):
    """Tensors in a nested result, one of them all-reduced: they reach the parent by value."""
    total = torch.full((3,), float(rank + 1))
    dist.all_reduce(total)
    return {"rank": rank, "total": total, "pieces": [torch.arange(rank + 2), torch.eye(2) * rank]}


def many_tensors(rank, world_size):
    """Many tensors, from ranks that exit at once: each would be a handle into a dead process."""
    return [torch.full((64,), float(rank + i)) for i in range(200)]
