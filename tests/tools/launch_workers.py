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


def heartbeat_stopped(rank, world_size):
    """A ZeRO step starts the ranks' heartbeat threads; `stop_watches` (run at exit) ends them."""
    import threading

    import zero
    from zero.backends import consistency

    model = torch.nn.Linear(4, 4)
    opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    before = [t.name for t in threading.enumerate() if t.name == "zero-heartbeat"]
    consistency.stop_watches()
    return {"before": before, "after": [t.name for t in threading.enumerate() if t.name == "zero-heartbeat"]}
