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


def dirty(rank, world_size):
    """Leaves a rank's process state changed: the next pooled run must not see any of it."""
    import os

    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ["ZERO_LEFT_BEHIND"] = "1"
    os.chdir("/")
    torch.manual_seed(rank + 123)
    return {"pid": os.getpid()}


def fresh_state(rank, world_size):
    """What a fresh rank sees: the default dtype, grad mode, environment, working directory,
    threads and the first draw of torch's default generator."""
    import os

    return {"pid": os.getpid(), "dtype": str(torch.get_default_dtype()), "grad": torch.is_grad_enabled(),
            "env": os.environ.get("ZERO_LEFT_BEHIND"), "cwd": os.getcwd(), "threads": torch.get_num_threads(),
            "draw": torch.rand(3).tolist()}


def fails_on(rank, world_size, bad):
    if rank == bad:
        raise ValueError(f"rank {rank} fails on purpose")
    return rank


def crashes(rank, world_size):
    """Rank 1 dies without a word (as a segfault or an abort would)."""
    import os

    if rank == 1:
        os._exit(3)
    return rank


def diverges(rank, world_size):
    """Rank 0 leaves an all-reduce no other rank joins: the group cannot pair collectives after it."""
    if rank == 0:
        dist.all_reduce(torch.ones(1000), async_op=True)
    return rank


def uneven_results(rank, world_size):
    return [torch.full((256,), float(i)) for i in range(200)] if rank == 1 else [rank]


def late_store_client(rank, world_size):
    """Rank 0 ends at once; rank 1 opens its own store connection later (as a rank's first
    check-in does), from a run that has no collective to hold rank 0 back."""
    if rank:
        import time

        time.sleep(1.0)
        dist.distributed_c10d._get_default_store().clone().set("late", "here")
    return rank


def environ_of(rank, world_size, name):
    """This rank's value of environment variable ``name``, and its process id."""
    import os

    return os.environ.get(name), os.getpid()
