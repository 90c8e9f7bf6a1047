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

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from zero.backends.simulate import OPTIMIZER_CLASSES, fake_group
from zero.plans.meta import ParamMeta, param_metas

__all__ = ["fsdp2_peak", "layered"]


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


def fsdp2_peak(params: Callable[[], nn.Module] | Sequence[ParamMeta], world_size: int, rank: int, *,
               optimizer: str = "adamw", master_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None) -> int:
    """The peak bytes of ``rank`` of ``world_size`` training ``params`` (a model factory, or
    metadata) with FSDP2 and ``torch.optim``'s ``optimizer``, over two iterations.

    ``master_dtype``: FSDP2's mixed precision as torchtitan runs it: the sharded params (the
    optimizer's) in this dtype, all-gathered and computed in the params' own
    (``MixedPrecisionPolicy(param_dtype=...)``); ``reduce_dtype``: the gradients' reduce-scatter's."""
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
