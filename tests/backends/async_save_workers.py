"""Per-rank bodies of the asynchronous-save tests (`zero.backends.checkpoint.save(async_save=True)`).

The background write is slowed on purpose (its data written ``DELAY`` seconds into the background)
so that the steps a test takes meanwhile really run while the save is in flight."""

from __future__ import annotations

import os
import time

import torch
from fsdp2_workers import build as fsdp2_build
from fsdp2_workers import fixed_grads, full, groups, make_model, make_rule, set_grads, sharded
from hsdp_workers import hsdp, zero_over

from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import checkpoint
from zero.backends.checkpoint import integrity

DELAY = 1.0
RULE = ("adamw", {"learning_rate": 1e-2, "weight_decay": 0.1})


def _model_and_optimizer(where: str, world_size: int):
    """``where``: "flat" (ZeRO's flat plan over plain params), "fsdp2", "hsdp" (2 replicas)."""
    if where == "flat":
        model = make_model()
        return model, Zero(groups(model), make_rule(RULE), strategy="flat")
    if where == "fsdp2":
        model = sharded(make_model())
        return model, fsdp2_build(RULE, model)
    model = hsdp(make_model(), world_size, 2)
    return model, zero_over(model, RULE)


def _steps(model, opt, steps: range) -> None:
    for k in steps:
        set_grads(model, fixed_grads(model, k))
        opt.step()


def _slowed_writer(rank: int, die: bool = False) -> None:
    """zero's writer writes its data ``DELAY`` seconds late (on the background thread); with ``die``,
    rank 1 dies there instead, having written part of its file."""
    write = integrity.ChecksumWriter.write_data

    def slowed(self, plan, planner):
        time.sleep(DELAY)
        if die and rank == 1:
            with open(os.path.join(os.fspath(self.path), "__1_0.distcp"), "wb") as f:
                f.write(b"\0" * 1000)  # a partial file, as a write cut short leaves
            os._exit(1)
        return write(self, plan, planner)

    integrity.ChecksumWriter.write_data = slowed


def async_against_sync(rank: int, world_size: int, where: str, root: str, keep: bool = False, steps: int = 3,
                       during: int = 2) -> dict:
    """Save at step ``steps`` synchronously (``root/sync``) and in the background (``root/async``),
    take ``during`` steps while the background write runs, then ask for a second background save
    (``root/second``) while the first may still be in flight; what each blocked and saw. ``keep``:
    both background saves with ``keep_staging=True`` (the second copies into the first's buffers)."""
    model, opt = _model_and_optimizer(where, world_size)
    _steps(model, opt, range(steps))
    t = time.perf_counter()
    checkpoint.save(os.path.join(root, "sync"), model, opt)
    sync_s = time.perf_counter() - t
    _slowed_writer(rank)
    t = time.perf_counter()
    first = checkpoint.save(os.path.join(root, "async"), model, opt, async_save=True, keep_staging=keep)
    blocked_s = time.perf_counter() - t
    _steps(model, opt, range(steps, steps + during))
    in_flight_after_steps = not first.done()
    second = checkpoint.save(os.path.join(root, "second"), model, opt, async_save=True, keep_staging=keep)
    first_done_when_second_started = first.done()
    first.result()
    second.result()
    return {"sync_s": sync_s, "blocked_s": blocked_s, "in_flight_after_steps": in_flight_after_steps,
            "first_done_when_second_started": first_done_when_second_started,
            "params": [full(p.detach()) for p in model.parameters()]}


def resumed(rank: int, world_size: int, where: str, path: str, start: int, steps: int) -> list[torch.Tensor]:
    """Load ``path`` and take ``steps`` steps from ``start``: the whole params after."""
    model, opt = _model_and_optimizer(where, world_size)
    checkpoint.load(path, model, opt)
    _steps(model, opt, range(start, start + steps))
    return [full(p.detach()) for p in model.parameters()]


def crash_during_background_write(rank: int, world_size: int, path: str) -> dict:
    """Save at step 3 synchronously to ``path``, step twice, then save over ``path`` in the
    background while rank 1 dies in the middle of the write; rank 0's future says how it went, and
    its params after step 5 are what a resume from the step-3 checkpoint must reach."""
    model, opt = _model_and_optimizer("flat", world_size)
    _steps(model, opt, range(3))
    checkpoint.save(path, model, opt)
    _steps(model, opt, range(3, 5))
    params = [full(p.detach()) for p in model.parameters()]
    _slowed_writer(rank, die=True)
    future = checkpoint.save(path, model, opt, async_save=True)
    try:
        future.result()
    except Exception as e:  # noqa: BLE001 - the survivor learns of it from the background collective
        return {"outcome": type(e).__name__, "params": params}
    return {"outcome": "saved", "params": params}
