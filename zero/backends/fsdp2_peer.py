"""FSDP2, the peer, measured the way `zero.backends.simulate` measures zero: one rank of a large job
under torch's fake process group and ``FakeTensorMode``, its peak by torch's own ``FSDPMemTracker``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) is ZeRO-3: params, gradients and optimizer state
all sharded, each layer's params all-gathered for its forward and again for its backward, its
gradients reduce-scattered as they are made. Its peak per rank is therefore the shards plus the
largest layers unsharded at once, where ZeRO-1/2 keep every param whole.

The model is rebuilt from parameter metadata: one module per transformer layer (the params named
up to a number, ``layers.N.`` as the presets and Hugging Face models name them) and one per
other param (the embedding, the final norm, the head), each wrapped by ``fully_shard``, as
torchtitan wraps its blocks and embeddings, then the root. Its forward
reads every param once, through a scalar, so the measured memory is the params', gradients' and
optimizer's, activations aside, as in `simulate`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from zero.backends.simulate import OPTIMIZER_CLASSES, fake_group
from zero.plans.meta import ParamMeta, param_metas

__all__ = ["fsdp2_peak", "measure", "layered", "few_chunks"]


class _Layer(nn.Module):
    def __init__(self, metas: Sequence[ParamMeta], dtype: torch.dtype | None):
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(torch.empty(m.shape, dtype=dtype or getattr(torch, m.dtype)),
                                                     requires_grad=m.requires_grad) for m in metas])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(p.sum() for p in self.params)


class _Layered(nn.Module):
    def __init__(self, layers: list[_Layer]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def layered(metas: Sequence[ParamMeta], dtype: torch.dtype | None = None) -> nn.Module:
    """A module with ``metas``' params (``dtype``: all in it) in ``layers``, in order: one per
    transformer layer (the params whose names share the prefix up to their first number:
    ``layers.3``, ``h.3``), and one per other param (the embedding, the final norm, the head)."""
    groups: dict[str, list[ParamMeta]] = {}
    for m in metas:
        parts = m.name.split(".")
        at = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
        groups.setdefault(m.name if at is None else ".".join(parts[:at + 1]), []).append(m)
    return _Layered([_Layer(g, dtype) for g in groups.values()])


class _Chunks(Sequence):
    """What ``list(torch.chunk(tensor, n, dim))`` padded with empty tensors to ``n`` holds (FSDP2's
    ``_chunk_with_empty``), each chunk made when it is read: the same views, at the same offsets."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int):
        self.tensor, self.n, self.dim = tensor, n, dim
        self.size = -(-tensor.size(dim) // n) if tensor.size(dim) else 0  # torch.chunk's chunk size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.n <= i < self.n:
            raise IndexError(i)
        i %= self.n
        start, length = i * self.size, self.tensor.size(self.dim)
        if not length:  # torch.chunk of an empty dim: n empty views of the tensor
            return self.tensor.narrow(self.dim, 0, 0)
        if start < length:
            return self.tensor.narrow(self.dim, start, min(self.size, length - start))
        return self[0].new_empty(0)


@contextlib.contextmanager
def few_chunks() -> Iterator[None]:
    """FSDP2 chunks every param into one view per rank when it shards it and reads two of them
    (its own and the first); under ``FakeTensorMode`` at 1,024 ranks making the other views was
    three quarters of a 7B model's measurement. In the block each view is made when read: the
    same views, so the same memory (`tests/backends/test_fsdp2_peer.py` measures both ways).
    Outside torch versions with ``_fsdp_param._chunk_with_empty`` it changes nothing."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return
    _fsdp_param._chunk_with_empty = _Chunks
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


def fsdp2_peak(params: Callable[[], nn.Module] | Sequence[ParamMeta], world_size: int, rank: int, *,
               optimizer: str = "adamw", master_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, every_chunk: bool = False) -> int:
    """The peak bytes of ``rank`` of ``world_size`` training ``params`` with FSDP2 (`measure`), in a
    process of its own: in one process the same configuration measured twice gave two figures
    (GPT-2 at 64 ranks: 496.3 MB the first time, 340.6 MB after, one embedding apart), so each
    figure is taken as a fresh job's process takes it, whatever was measured before. ``params``:
    metadata, or a picklable model factory."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, params, world_size, rank, optimizer=optimizer, master_dtype=master_dtype,
                           reduce_dtype=reduce_dtype, every_chunk=every_chunk).result()


def measure(params: Callable[[], nn.Module] | Sequence[ParamMeta], world_size: int, rank: int, *,
            optimizer: str = "adamw", master_dtype: torch.dtype | None = None,
            reduce_dtype: torch.dtype | None = None, every_chunk: bool = False) -> int:
    """The peak bytes of ``rank`` of ``world_size`` training ``params`` (a model factory, or
    metadata) with FSDP2 and ``torch.optim``'s ``optimizer``, over two iterations.

    ``master_dtype``: FSDP2's mixed precision as torchtitan runs it: the sharded params (the
    optimizer's) in this dtype, all-gathered and computed in the params' own
    (``MixedPrecisionPolicy(param_dtype=...)``); ``reduce_dtype``: the gradients' reduce-scatter's.
    ``every_chunk``: let FSDP2 make every rank's view of each param as it does (see `few_chunks`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cls_name, settings = OPTIMIZER_CLASSES[optimizer]
    with fake_group(rank, world_size), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        mesh = init_device_mesh("cpu", (world_size,))  # outside FakeTensorMode: the mesh reads real tensors
        with FakeTensorMode():
            metas = params if not callable(params) else param_metas(params())
            compute = {m.dtype for m in metas if m.requires_grad}
            policy = MixedPrecisionPolicy(
                param_dtype=getattr(torch, compute.pop()) if master_dtype is not None and len(compute) == 1 else None,
                reduce_dtype=reduce_dtype)
            model = layered(metas, master_dtype)
            with contextlib.nullcontext() if every_chunk else few_chunks():
                for layer in model.layers:
                    fully_shard(layer, mesh=mesh, mp_policy=policy)
                fully_shard(model, mesh=mesh, mp_policy=policy)
            opt = getattr(torch.optim, cls_name)(model.parameters(), **settings)
            tracker = FSDPMemTracker(model, opt)
            x = torch.zeros(())
            tracker.track_inputs((x,))
            with tracker:
                for _ in range(2):
                    model(x).backward()
                    opt.step()
                    opt.zero_grad()
                    tracker.reset_mod_stats()  # (the tracker's per-module records hold one iteration)
            return int(sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values()))
