"""What the simulations share (`zero.backends.simulate` of a ZeRO rank, `zero.backends.fsdp2_peer`
of an FSDP2 one): torch's fake process group for a block (`fake_group`), a memory tracker that keeps
the rank's peak alone (`peak_only`), the ``optimizer=`` names they run (`optimizer_class`), a model
factory's model built without memory (`built_on_meta`, `as_fake`), the batch a run's forward takes
and its loss (`batch_tokens`, `batch_loss`), and the store of runs kept under
``ZERO_SIMULATE_CACHE`` (`cached`)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import pickle
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["fake_group", "require_no_group", "cached", "peak_only", "optimizer_class", "OPTIMIZER_CLASSES",
           "built_on_meta", "as_fake", "batch_tokens", "batch_loss"]

# ``optimizer=`` names: the torch.optim class each runs and its settings (the plan's accounting
# counts the state of the rule of the same name, `zero.plans.accounting.OPTIMIZERS`).
OPTIMIZER_CLASSES = {"adamw": ("AdamW", {"lr": 1e-3}), "adam": ("Adam", {"lr": 1e-3}), "sgd": ("SGD", {"lr": 1e-3}),
                     "sgd_momentum": ("SGD", {"lr": 1e-3, "momentum": 0.9})}


@contextlib.contextmanager
def fake_group(rank: int, world_size: int) -> Iterator[Any]:
    """torch's fake process group as the default group, ``rank`` of ``world_size``, for the block
    (a default group already set up is a ``RuntimeError``: a simulation takes the process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    require_no_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def built_on_meta(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``factory()`` with ``meta`` the default device: no memory, and whatever a model's
    constructor does works as on real tensors (in-place initialisation under ``no_grad``,
    ``.to(dtype)``, tied weights), which fake parameters do not allow (``Module.to`` swaps them,
    and torch cannot swap a fake parameter). A factory that returns no module is a ``TypeError``."""
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the model factory {getattr(factory, '__qualname__', factory)!r} returned "
                        f"{type(model).__name__}, not an nn.Module")
    return model


def as_fake(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (built on ``meta``) with each param and buffer a tensor of the active
    ``FakeTensorMode`` of its shape, dtype and ``requires_grad`` (on the CPU), ties kept."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype)
            made[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if param else new
        return made[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = fake(p, True)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake(b, False)
    return model


def batch_tokens(model: nn.Module, batch: tuple[int, int]) -> torch.Tensor:
    """``B x T`` token ids below the first embedding's vocabulary (every token id is read the same way)."""
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError("a batch runs the model on token ids: its forward must take them (an nn.Embedding first)")
    b, t = batch
    return torch.randint(0, embedding.num_embeddings, (b, t))


def batch_loss(out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the logits against the tokens (in float32, as training computes it), or, for
    an output that is not logits per token, its mean."""
    if out.shape[:-1] == tokens.shape and out.is_floating_point():
        return torch.nn.functional.cross_entropy(out.flatten(0, -2).float(), tokens.flatten())
    return out.float().mean()


def require_no_group() -> None:
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialized: simulate in a process of its own")


def cached(params: Any, world_size: int, rank: int, options: dict, kind: type, compute: Callable[[], Any]) -> Any:
    """``compute()``'s run of ``rank`` of ``world_size`` on ``params`` with ``options`` (each a
    value), read back from ``ZERO_SIMULATE_CACHE`` when a run of the same inputs (and of ``kind``)
    is kept there, else computed and kept (see the module). Runs from a model factory are not kept."""
    key = _cache_key(params, world_size, rank, options)
    run = _cache_read(key, kind)
    if run is None:
        run = compute()
        _cache_write(key, run)
    return run


def peak_only(tracker_class: type) -> type:
    """``tracker_class`` (torch's ``MemTracker`` or ``FSDPMemTracker``) keeping the whole rank's
    peak alone, and able to start it again (``restart_peak()``). After every op torch's tracker
    also walks every module it has seen, to keep each one's own peak while it runs: 40% of a
    LLaMA-70B run's time at 1,024 ranks, and the simulations read only the rank's peak
    (``get_tracker_snapshot("peak")``), which this keeps as torch does, to the byte
    (tests/backends/test_simulate.py, tests/backends/test_fsdp2_peer.py), and where it came
    (``peak_moment``). The tracker's peak and its module context live in its private fields, which
    torch gives no other way to read or reset: they are touched here only."""
    from copy import deepcopy

    class PeakOnly(tracker_class):
        peak_moment = "before the first op"  # where the peak came: "backward of layers.3", "step"

        def _update_peak_stats(self, peak_state: Any) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = deepcopy(snapshot)
                    self.peak_moment = self._moment()

        def _moment(self) -> str:
            if getattr(self, "_in_opt", False):
                return "step"
            inner = max((p for p in self._mod_tracker.parents if p != "Global"), key=len, default="")
            inner = inner.partition(".")[2] or "the model"  # (its name below the root's class name)
            return f"{'backward' if self._mod_tracker.is_bw else 'forward'} of {inner}"

        def restart_peak(self) -> None:
            """The peak from now on: what is alive now and what comes, as though tracking began here."""
            self._peak_mem = {device: snapshot["Total"] for device, snapshot in self._curr_mem_snap.items()}
            self._peak_mem_snap = deepcopy(self._curr_mem_snap)
            self.peak_moment = "between iterations"

    PeakOnly.__name__ = PeakOnly.__qualname__ = f"PeakOnly{tracker_class.__name__}"
    return PeakOnly


def _cache_key(params: Any, world_size: int, rank: int, options: dict) -> str | None:
    """What a run depends on, hashed: None where it cannot be named (no cache set; a model built by a
    function, whose code is not a value; a ``whole=`` that `make_plan` will refuse)."""
    if not os.environ.get("ZERO_SIMULATE_CACHE") or callable(params):
        return None
    from zero.plans.costs import cost_of
    from zero.plans.hybrid import resolve_whole

    metas = tuple(params)
    whole = options.get("whole")
    if whole is not None:
        if options["strategy"] != "flat":
            return None
        whole = resolve_whole(metas, whole, cost_of(options["optimizer"]))  # a function: what it picks
    inputs = (metas, world_size, rank, sorted({**options, "whole": whole}.items()), _source_digest())
    return hashlib.sha256(repr(inputs).encode()).hexdigest()


@functools.cache
def _source_digest() -> str:
    """zero's own source and torch's version: a run kept by other code is never read back."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(pathlib.Path(__file__).parents[1].rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _cache_read(key: str | None, kind: type) -> Any:
    path = None if key is None else pathlib.Path(os.environ["ZERO_SIMULATE_CACHE"], f"{key}.pkl")
    if path is None or not path.is_file():
        return None
    try:
        run = pickle.loads(path.read_bytes())
    except Exception:  # a file another version or a killed writer left: run again, and replace it
        return None
    return run if isinstance(run, kind) else None


def _cache_write(key: str | None, run: Any) -> None:
    """Written whole or not at all (a temporary file renamed): two processes may write one key."""
    if key is None:
        return
    folder = pathlib.Path(os.environ["ZERO_SIMULATE_CACHE"])
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(pickle.dumps(run))
    os.replace(tmp, folder / f"{key}.pkl")


def optimizer_class(name: str) -> tuple[type, dict]:
    """The ``torch.optim`` class and settings of an ``optimizer=`` name a simulation runs
    (`OPTIMIZER_CLASSES`); another name is a ``ValueError`` naming the choices."""
    if name not in OPTIMIZER_CLASSES:
        raise ValueError(f"unknown optimizer {name!r} for a simulation; choose one of {sorted(OPTIMIZER_CLASSES)}")
    cls_name, settings = OPTIMIZER_CLASSES[name]
    return getattr(torch.optim, cls_name), settings
