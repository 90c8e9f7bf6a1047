"""The torch side of `test_cross_framework.py`: AdamW under `ZeroRedundancyOptimizer` on gloo
ranks over the twin of `jax_mesh_twin` (float32), saving and loading zero's DCP checkpoints."""

from __future__ import annotations

import torch
from jax_mesh_twin import grads, initial
from torch import nn

from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import checkpoint

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.99), 1e-8, 0.1  # optax.adamw(LR, 0.9, 0.99, EPS, weight_decay=WD)


def model_and_optimizer(strategy: str):
    model = nn.Sequential(nn.Linear(7, 33), nn.Linear(33, 5), nn.Linear(5, 64))
    with torch.no_grad():
        for p, value in zip(model.parameters(), initial()):
            p.copy_(torch.from_numpy(value).float())
    opt = Zero(model.parameters(), torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, strategy=strategy)
    return model, opt


def steps(model, opt, first: int, last: int) -> None:
    for k in range(first, last):
        for p, g in zip(model.parameters(), grads(k)):
            p.grad = torch.from_numpy(g).float()
        opt.step()


def train_save_continue(rank: int, world_size: int, save_to: str) -> list:
    """Steps 0-9, saved to ``save_to``, then steps 10-19: the params at 20."""
    model, opt = model_and_optimizer("flat")
    steps(model, opt, 0, 10)
    checkpoint.save(save_to, model, opt)
    steps(model, opt, 10, 20)
    return [p.detach().numpy().tolist() for p in model.parameters()]


def load_continue(rank: int, world_size: int, load_from: str) -> list:
    """A converted checkpoint of step 20 loaded, steps 20-29: the params at 30."""
    model, opt = model_and_optimizer("sorted_greedy")
    checkpoint.load(load_from, model, opt)
    steps(model, opt, 20, 30)
    return [p.detach().numpy().tolist() for p in model.parameters()]


def other_rule_save_continue(rank: int, world_size: int, rule: str, save_to: str) -> list:
    """``rule`` ("sgd": torch's SGD with momentum; "functional": zero.functional's adamw) on one
    rank: 5 steps, saved, 5 more: the params at 10."""
    import zero.functional as zf

    model = nn.Sequential(nn.Linear(7, 33), nn.Linear(33, 5), nn.Linear(5, 64))
    with torch.no_grad():
        for p, value in zip(model.parameters(), initial()):
            p.copy_(torch.from_numpy(value).float())
    opt = (Zero(model.parameters(), torch.optim.SGD, lr=LR, momentum=0.9) if rule == "sgd" else
           Zero(model.parameters(), zf.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)))
    steps(model, opt, 0, 5)
    checkpoint.save(save_to, model, opt)
    steps(model, opt, 5, 10)
    return [p.detach().numpy().tolist() for p in model.parameters()]


def fsdp2_save_continue(rank: int, world_size: int, save_to: str) -> list:
    """The twin under FSDP2 (each Linear and the root ``fully_shard``-ed) with ``torch.optim.AdamW``:
    5 steps, saved with ``dcp.save`` of torch's own ``get_state_dict``, 5 more: the params at 10."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = nn.Sequential(nn.Linear(7, 33), nn.Linear(33, 5), nn.Linear(5, 64))
    with torch.no_grad():
        for p, value in zip(model.parameters(), initial()):
            p.copy_(torch.from_numpy(value).float())
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for k in range(10):
        if k == 5:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=save_to)
        for p, g in zip(model.parameters(), grads(k)):
            p.grad = distribute_tensor(torch.from_numpy(g).float(), p.device_mesh, p.placements, src_data_rank=None)
        opt.step()
    return [p.full_tensor().detach().numpy().tolist() for p in model.parameters()]
