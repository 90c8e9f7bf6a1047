"""What the tests share: ranks in fresh processes, the models and param groups they train, the
gradients they feed, the loop that steps optimizers side by side, the collectives counter, and
the checks that params are close.

Ranks run in the library's own pools (`zero.tools.pool.Pool`): one pool per world size for the
session, its processes and gloo group reused from test to test, each run with a hard timeout;
runs that let a rank die, use another backend or another group timeout get fresh processes
(`zero.tools.launch.run`), as every run does with ``ZERO_TEST_FRESH_RANKS=1``. The per-rank
bodies live in the ``*_workers`` modules beside the tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import optree
import torch
import torch.distributed as dist
from torch import nn

from zero.backends import comm
from zero.backends.modes.gradients import ReducedGradients
from zero.tools import launch
from zero.tools.launch import free_port
from zero.tools.pool import Pool

__all__ = ["run_ranks", "close_pools", "free_port", "MODELS", "Net", "make_model", "groups_of", "ddp_grads",
           "fixed_grads", "set_grads", "side_by_side", "worst", "assert_params_close", "assert_trees_close", "digest",
           "same_on_every_rank", "broadcast", "patched", "torchao_optim", "CountingCalls", "CommCounter", "train",
           "mode_name"]

# -- ranks ------------------------------------------------------------------------------------

_POOLS: dict[int, Pool] = {}
POOL_RUNS = 60  # a pool's processes are started again after this many runs (what tests leave behind)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240, pg_timeout: float = 60,
              allow_exit: tuple[int, ...] = (), backend: str = "gloo", threads: int = 1, fresh: bool = False) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks (see `zero.tools.launch.run`), on
    the session's pool of that size unless the run needs fresh processes: ``fresh`` for a run
    whose ranks diverge on purpose (they leave the group unusable, which the pool would find
    only at its barrier's timeout), and runs where a rank may die, another backend, another
    group timeout."""
    fresh = fresh or allow_exit or backend != "gloo" or pg_timeout != 60 or \
        os.environ.get("ZERO_TEST_FRESH_RANKS") == "1"
    if fresh:
        return launch.run(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout, allow_exit=allow_exit,
                          backend=backend, threads=threads)
    pool = _POOLS.get(world_size)
    if pool is None or pool.runs >= POOL_RUNS:
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = Pool(world_size)
    out = pool.run(fn, *args, timeout=timeout, threads=threads)
    if os.environ.get("ZERO_POOL_LOG") and not pool.alive:
        with open(os.environ["ZERO_POOL_LOG"], "a") as f:
            f.write(f"{fn.__module__}.{fn.__name__} on {world_size}: the pool did not settle: {pool.unsettled}\n")
    return out


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


# -- models -----------------------------------------------------------------------------------

# The models the tests train, by name: layer widths (uneven on purpose), the default dtype, the
# params frozen at construction, and whether it is a `Net` (tanh between layers).
MODELS = {
    "small": ((7, 33, 5, 64, 3), torch.float32, (), False),  # 231, 33, 165, 5, 320, 64, 192, 3 elements
    "plan": ((7, 33, 5, 64, 40, 3), torch.float64, ("1.bias",), False),  # the 40x64 weight: over half of it
    "net": ((7, 33, 40, 64, 5), torch.float64, (), True),  # runs forward: each layer fed in its own dtype
}


class Net(nn.Sequential):
    """Linear layers with tanh, each fed in its own dtype (a model with mixed dtypes runs forward)."""

    def forward(self, x):
        for layer in self:
            x = torch.tanh(layer(x.to(layer.weight.dtype)))
        return x.double()


def make_model(kind: str = "plan", seed: int = 0, dtype: torch.dtype | None = None, mixed: bool = False,
               dtypes: Sequence[torch.dtype] | None = None) -> nn.Module:
    """A fresh model of ``MODELS[kind]`` from ``seed``: its layers in ``dtype`` (default: the
    kind's), ``mixed``: every other layer bfloat16; ``dtypes``: dtypes cycled over the layers."""
    widths, default, frozen, is_net = MODELS[kind]
    dtype = dtype or default
    cycle = tuple(dtypes) if dtypes else (dtype, torch.bfloat16) if mixed else (dtype,)
    torch.manual_seed(seed)
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    model = (Net if is_net else nn.Sequential)(*[lay.to(cycle[i % len(cycle)]) for i, lay in enumerate(layers)])
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return model


def groups_of(model: nn.Module, own_lr: bool = True) -> list[dict]:
    """Two param groups: the first two layers, the rest; ``own_lr``: the second at half the
    learning rate (5e-3; a hand-built transformation keeps no setting per group: pass False)."""
    first = [*model[0].parameters(), *model[1].parameters()]
    rest = [p for layer in model[2:] for p in layer.parameters()]
    return [{"params": first}, {"params": rest, "lr": 5e-3} if own_lr else {"params": rest}]


# -- gradients, and stepping side by side -------------------------------------------------------

def ddp_grads(params: list[torch.Tensor], step: int, rank: int, world_size: int, group=None) -> list:
    """This rank's random gradients, averaged over the group as DDP would (None where frozen)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    grads = []
    for p in params:
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
        dist.all_reduce(g, group=group)
        grads.append(g / world_size if p.requires_grad else None)
    return grads


def fixed_grads(params: list[torch.Tensor], step: int) -> list:
    """Gradients as DDP leaves them: the same on every rank, whatever the world size (drawn in
    float64, for the trainable params; None for the frozen)."""
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) if p.requires_grad else None
            for p in params]


def set_grads(model: nn.Module, grads: list) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = None if g is None else g.clone()


def side_by_side(runs: Sequence[tuple], grads: Callable[[int], list] | None, steps: Sequence[int], *,
                 loss: Callable[[nn.Module, int], torch.Tensor] | None = None,
                 step: Callable[[Any], Any] = lambda opt: opt.step(),
                 each_step: Callable[[int], None] | None = None) -> float:
    """Train every run of ``runs`` (``(model, optimizer)``, or ``(model, optimizer, scheduler)``)
    for each ``k`` of ``steps``, side by side: on the same gradients ``grads(k)``, or each on its
    own backward pass of ``loss(model, k)`` (zero_grad first); ``step(optimizer)``, then the
    scheduler's step. Returns the largest relative difference (`worst`) of the float64 params of
    each run from the last one's, after any step. ``each_step(k)`` runs after every step."""
    largest = 0.0
    for k in steps:
        g = grads(k) if grads is not None else None
        for model, opt, *scheduler in runs:
            if loss is None:
                set_grads(model, g)
            else:
                opt.zero_grad()
                loss(model, k).backward()
            step(opt)
            for sched in scheduler:
                if sched is not None:
                    sched.step()
        largest = max([largest] + [worst(run[0], runs[-1][0]) for run in runs[:-1]])
        if each_step is not None:
            each_step(k)
    return largest



def train(model: nn.Module, opt: Any, steps: Sequence[int], *, grads: Callable[[int], list] | None = None,
          loss: Callable[[nn.Module, int], torch.Tensor] | None = None, scheduler: Any = None) -> list[torch.Tensor]:
    """One run of `side_by_side`: ``opt`` steps ``model`` for each ``k`` of ``steps``, on ``grads(k)``
    (`fixed_grads` of the params when neither is given) or a backward pass of ``loss(model, k)``;
    ``scheduler`` steps after each. Returns detached copies of the params after."""
    if grads is None and loss is None:
        grads = lambda k: fixed_grads(list(model.parameters()), k)  # noqa: E731
    side_by_side([(model, opt, scheduler)], grads, steps, loss=loss)
    return [p.detach().clone() for p in model.parameters()]


def mode_name(opt: Any) -> str:
    """What executes ``opt``'s plan: the mode's class, then ``hybrid`` when it keeps whole params
    synced by their owners' rows, and ``reduced`` when zero reduces its gradients (``reduce_scatter_grads``)."""
    mode, parts = opt.mode, [type(opt.mode).__name__]
    if getattr(mode, "rows", None) is not None:
        parts.append("hybrid")
    if isinstance(mode.gradients, ReducedGradients) and parts[0] == "FlatShards":
        parts.append("reduced")
    return " ".join(parts)

# -- closeness --------------------------------------------------------------------------------

def worst(a: nn.Module | Sequence[torch.Tensor], b: nn.Module | Sequence[torch.Tensor]) -> float:
    """The largest relative difference between the float64 params of ``a`` and ``b``."""
    xs = a.parameters() if isinstance(a, nn.Module) else a
    ys = b.parameters() if isinstance(b, nn.Module) else b
    out = 0.0
    for x, y in zip(xs, ys):
        if x.dtype == torch.float64:
            out = max(out, float(((x - y).abs() / y.abs().clamp_min(1e-12)).max().detach()))
    return out


def assert_params_close(a: nn.Module | Sequence[torch.Tensor], b: nn.Module | Sequence[torch.Tensor],
                        exact: bool = False, what: str = "", rtol: float = 1e-6, atol: float = 1e-7) -> None:
    """Every param of ``a`` equals ``b``'s (``exact``: to the bit), each named in the failure."""
    xs = list(a.named_parameters()) if isinstance(a, nn.Module) else list(enumerate(a))
    ys = list(b.parameters()) if isinstance(b, nn.Module) else list(b)
    assert len(xs) == len(ys), f"{what}: {len(xs)} params against {len(ys)}"
    for (name, x), y in zip(xs, ys):
        y = y.detach()
        if exact:
            assert torch.equal(x, y), f"{what}: {name} differs"
        else:
            torch.testing.assert_close(x.detach(), y, rtol=rtol, atol=atol,
                                       msg=lambda m, n=name: f"{what}: {n}: {m}")


def assert_trees_close(ours: Any, theirs: Any, rtol: float, atol: float = 0.0, what: str = "") -> None:
    """The leaves of two pytrees (torch tensors, and torch tensors or JAX / numpy arrays) are close."""
    xs, ys = optree.tree_leaves(ours), optree.tree_leaves(theirs)
    assert len(xs) == len(ys), f"{what}: {len(xs)} leaves against {len(ys)}"
    for x, y in zip(xs, ys):
        np.testing.assert_allclose(_numpy(x), _numpy(y), rtol=rtol, atol=atol, err_msg=what)


def _numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to(torch.float64).numpy().tobytes())
    return h.hexdigest()


def same_on_every_rank(model: nn.Module, group=None) -> bool:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, digest(model), group=group)
    return len(set(out)) == 1


def broadcast(obj: Any, src: int = 0) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# -- counting and patching ----------------------------------------------------------------------

@contextlib.contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


class _TorchUncompiled:
    """``torch`` as torchao's optimizers see it, its ``compile`` handing the function back as it is."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def compile(fn: Callable, **_: Any) -> Callable:
        return fn


def torchao_optim() -> Any:
    """``torchao.optim`` (a skip where it is not installed; make installs it), its optimizers
    stepping uncompiled in this process. torchao wraps each param's step in ``torch.compile``, and
    inductor compiled every param shape anew: 45 of a 20-step test's 47 s on 2 CPU cores. The same
    step's code runs eagerly here, as the reference these tests compare zero's rules with; their
    tolerances hold as they did compiled (codes within one, params within rel 1e-3)."""
    import pytest

    optim = pytest.importorskip("torchao.optim", reason="torchao is a test dependency (make installs it)")
    import torchao.optim.adam as adam

    adam.torch = _TorchUncompiled()
    return optim


class CountingCalls:
    """Counts the calls of ``module.name`` inside the block (patched where its callers look it up)
    and keeps ``record(*args)`` of each (default: nothing)."""

    def __init__(self, module: Any, name: str, record: Callable[..., Any] | None = None):
        self.calls, self.records, self._module, self._name = 0, [], module, name
        self._orig, self._record = getattr(module, name), record

    def __enter__(self) -> CountingCalls:
        def counted(*args, **kwargs):
            self.calls += 1
            if self._record is not None:
                self.records.append(self._record(*args, **kwargs))
            return self._orig(*args, **kwargs)
        setattr(self._module, self._name, counted)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self._module, self._name, self._orig)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommCounter:
    """zero's collectives inside the block, counted where every caller looks them up
    (`zero.backends.comm`): per function, its calls, the bytes this rank puts in, and each
    call's group size. The ranks' check-ins (`zero.backends.consistency`) are not counted."""

    # function -> the bytes a call moves from this rank (its tensor argument), and its group
    TENSORS: dict[str, Callable[..., tuple[int, Any]]] = {
        "all_gather_rows": lambda rows, rank, group, *a, **k: (_nbytes(rows), group),
        "all_reduce_sum": lambda tensor, group: (_nbytes(tensor), group),
        "reduce_scatter_sum": lambda output, rows, group: (_nbytes(rows), group),
        "reduce_sum_to": lambda tensor, owner, group: (_nbytes(tensor), group),
        "broadcast_from": lambda tensor, owner, group, *a, **k: (_nbytes(tensor), group),
    }

    def __init__(self):
        self._counters = {name: CountingCalls(comm, name, how) for name, how in self.TENSORS.items()}

    def __enter__(self) -> CommCounter:
        for counter in self._counters.values():
            counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for counter in self._counters.values():
            counter.__exit__(*exc)

    def calls(self, name: str) -> int:
        return self._counters[name].calls

    def bytes(self, name: str) -> int:
        return sum(n for n, _ in self._counters[name].records)

    def group_sizes(self, name: str) -> list[int]:
        return [dist.get_world_size(group) for _, group in self._counters[name].records]
