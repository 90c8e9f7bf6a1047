"""Bodies of the RPC `DistributedOptimizer` tests (`distributed.run_ranks(..., backend="rpc")`).

``worker0`` is the trainer; the other workers own the parameters and only serve RPCs (their
body returns at once and `rpc.shutdown` waits for the trainer). Everything a worker runs
(`Part`, the factories) is defined here at module level so workers can import it.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

import zero.functional as zf
from zero.backends import DistributedOptimizer

# (owner, seed, in, hidden, out): a model split over two workers.
PARTS = [("worker1", 1, 7, 33, 5), ("worker2", 2, 5, 64, 3)]
CONFIGS = {
    "sgd_positional_lr": (torch.optim.SGD, (0.05,), {"momentum": 0.9}),
    "adam": (torch.optim.Adam, (), {"lr": 1e-2, "weight_decay": 0.01}),
    "adamw_factory": (zf.adamw, (), {"learning_rate": 1e-2, "weight_decay": 0.1}),
}


class Part(nn.Module):
    """A stage of the model; ``extra`` takes part only when asked (so it may have no gradient)."""

    def __init__(self, seed: int, n_in: int, n_hidden: int, n_out: int):
        super().__init__()
        torch.manual_seed(seed)
        self.main = nn.Sequential(nn.Linear(n_in, n_hidden), nn.Tanh(), nn.Linear(n_hidden, n_out)).double()
        self.extra = nn.Linear(n_in, n_out).double()

    def forward(self, x, use_extra: bool):
        y = self.main(x)
        return y + self.extra(x) if use_extra else y


def run_part(part_rref, x, use_extra):
    return part_rref.local_value()(x, use_extra)


def part_param_rrefs(part_rref):
    return [rpc.RRef(p) for p in part_rref.local_value().parameters()]


def part_params(part_rref):
    return [p.detach().clone() for p in part_rref.local_value().parameters()]


def remote_model():
    return [rpc.remote(owner, Part, args=spec) for owner, *spec in PARTS]


def forward(parts, x, step):
    """Through both stages; worker2's ``extra`` only on even steps."""
    h = rpc.rpc_sync(parts[0].owner(), run_part, args=(parts[0], x, True))
    return rpc.rpc_sync(parts[1].owner(), run_part, args=(parts[1], h, step % 2 == 0))


def train_step(parts, opt, x, step):
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [forward(parts, x, step).square().mean()])
        opt.step(cid)


def fetch(parts):
    return [p for part in parts for p in rpc.rpc_sync(part.owner(), part_params, args=(part,))]


def split_model(rank: int, world_size: int, config: str, steps: int = 6) -> dict | None:
    """Ours against torch's DistributedOptimizer (a torch class) or a local functional run (a factory)."""
    if rank:
        return None
    cls, args, kwargs = CONFIGS[config]
    ours_parts = remote_model()
    rrefs = [r for part in ours_parts for r in rpc.rpc_sync(part.owner(), part_param_rrefs, args=(part,))]
    ours = DistributedOptimizer(cls, rrefs, *args, **kwargs)
    reference = _torch_reference(cls, args, kwargs) if isinstance(cls, type) else _local_reference(cls, kwargs)
    for step in range(steps):
        x = torch.randn(4, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        train_step(ours_parts, ours, x, step)
        want = reference(x, step)
        for i, (got, exp) in enumerate(zip(fetch(ours_parts), want)):
            torch.testing.assert_close(got, exp, rtol=1e-9, atol=1e-12, msg=lambda m, i=i, s=step: f"{config} step {s} "
                                       f"param {i}: {m}")
    return {"owners": sorted(o.owner().name for o in ours.remote_optimizers)}


def _torch_reference(cls, args, kwargs):
    parts = remote_model()
    rrefs = [r for part in parts for r in rpc.rpc_sync(part.owner(), part_param_rrefs, args=(part,))]
    theirs = TorchDistributedOptimizer(cls, rrefs, *args, **kwargs)

    def step(x, i):
        train_step(parts, theirs, x, i)
        return fetch(parts)
    return step


def _local_reference(factory, kwargs):
    """The same model in this process, one `FunctionalOptimizer` per stage, zero for a missing grad."""
    parts = [Part(*spec) for _, *spec in PARTS]
    optims = [zf.FunctionalOptimizer(list(p.parameters()), factory(**kwargs)) for p in parts]

    def step(x, i):
        for p in parts:
            p.zero_grad(set_to_none=True)
        parts[1](parts[0](x, True), i % 2 == 0).square().mean().backward()
        for part, opt in zip(parts, optims):
            opt.step([torch.zeros_like(p) if p.grad is None else p.grad for p in part.parameters()])
        return [p.detach().clone() for part in parts for p in part.parameters()]
    return step


def seed_example(rank: int, world_size: int) -> dict | None:
    """The docs' example (with ``requires_grad`` on the leaves, which torch needs for the backward):
    the RRefs are results of ``torch.add``, not leaves, so they have no gradient and stay put."""
    if rank:
        return None
    out = {}
    for name, cls in (("ours", DistributedOptimizer), ("torch", TorchDistributedOptimizer)):
        with dist_autograd.context() as context_id:
            rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2, requires_grad=True), 3))
            rref2 = rpc.remote("worker1", torch.add, args=(torch.ones(2, requires_grad=True), 1))
            loss = rref1.to_here() + rref2.to_here()
            dist_autograd.backward(context_id, [loss.sum()])
            dist_optim = cls(torch.optim.SGD, [rref1, rref2], lr=0.05)
            dist_optim.step(context_id)
            out[name] = (rref1.to_here().tolist(), rref2.to_here().tolist())
    return out


# -- serialisation and timeouts: a transformation that takes its time, and logs it -----------

_LOG: list[str] = []


def slow_sgd(learning_rate: float, seconds: float) -> zf.GradientTransformation:
    inner = zf.sgd(learning_rate)

    def update(updates, state, params=None):
        _LOG.append("enter")
        time.sleep(seconds)
        _LOG.append("exit")
        return inner.update(updates, state, params)
    return zf.GradientTransformation(inner.init, update)


def read_log() -> list[str]:
    return list(_LOG)


def make_leaf(n):
    return torch.ones(n, dtype=torch.float64, requires_grad=True)


def _one_param_on(worker: str):
    rref = rpc.remote(worker, make_leaf, args=(3,))
    return rref, DistributedOptimizer(slow_sgd, [rref], 0.1, 0.3)


def _backward_through(rref):
    return rpc.rpc_sync(rref.owner(), _square_sum_of, args=(rref,))


def _square_sum_of(rref):
    return rref.local_value().square().sum()


def concurrent_steps(rank: int, world_size: int) -> dict | None:
    """Two trainer threads step one optimizer at once: the worker applies one context at a time."""
    if rank:
        return None
    rref, opt = _one_param_on("worker1")

    def trainer():
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [_backward_through(rref)])
            opt.step(cid)
    threads = [threading.Thread(target=trainer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"log": rpc.rpc_sync("worker1", read_log), "value": rref.to_here().tolist()}


def unresponsive(rank: int, world_size: int) -> dict | None:
    """worker1's step outlasts the timeout: the step fails naming it, worker2's step completes."""
    if rank:
        return None
    slow = rpc.remote("worker1", make_leaf, args=(3,))
    fast = rpc.remote("worker2", make_leaf, args=(2,))
    opt = DistributedOptimizer(slow_sgd, [slow, fast], 0.1, 0.0)
    rpc.rpc_sync("worker1", _set_sleep, args=(opt.remote_optimizers[0], 6.0))
    with dist_autograd.context() as cid:
        loss = _backward_through(slow) + _backward_through(fast)
        dist_autograd.backward(cid, [loss])
        start = time.monotonic()
        try:
            opt.step(cid, timeout=1.5)
            error = None
        except RuntimeError as e:
            error = str(e)
        seconds = time.monotonic() - start
    return {"error": error, "seconds": seconds, "fast": fast.to_here().tolist()}


def _set_sleep(optim_rref, seconds):
    """Make this worker's optimizer slow from now on (a stand-in for a worker that hangs)."""
    local = optim_rref.local_value()
    local.optim = zf.FunctionalOptimizer(local.params, slow_sgd(0.1, seconds))
