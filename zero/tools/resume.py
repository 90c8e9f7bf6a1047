"""``zero checkpoint train``: train, save a sharded checkpoint, resume it at another size or in FSDP2.

Each run spawns ``--ranks`` gloo ranks that train a small stack of ``Linear`` layers with AdamW
(DDP + `zero.ZeroRedundancyOptimizer`, or with ``--fsdp2`` the model under ``fully_shard`` and
plain AdamW), every rank on the same batch of each step. ``--load DIR`` resumes a checkpoint
(zero's `zero.backends.checkpoint.load`, or FSDP2's own ``get_state_dict`` / ``dcp.load`` /
``set_state_dict``), at the step its optimizer state counts; ``--save DIR`` writes one (each
rank its own pieces). At the end it prints the largest difference of any param from one process
running plain AdamW for the same steps on the same data.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from zero.tools import launch
from zero.tools.arguments import positive_int

__all__ = ["main", "train_leg"]

WIDTH, LAYERS, LR = 64, 4, 1e-2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zero checkpoint train", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=positive_int, default=2)
    p.add_argument("--steps", type=positive_int, default=3, help="steps to train in this run")
    p.add_argument("--strategy", choices=("flat", "sorted_greedy"), default="flat", help="zero's plan")
    p.add_argument("--fsdp2", action="store_true", help="train under FSDP2 (torch's fully_shard) instead")
    p.add_argument("--load", help="resume from this checkpoint directory")
    p.add_argument("--save", help="save a sharded checkpoint to this (new) directory at the end")
    return p


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, WIDTH, generator=gen), torch.randn(16, WIDTH, generator=gen)


def _steps_taken(opt: torch.optim.Optimizer) -> int:
    state = next((st for st in opt.state.values() if "step" in st), None)
    return 0 if state is None else int(state["step"])


def train_leg(rank: int, world_size: int, strategy: str, fsdp2: bool, load: str | None, save: str | None,
              steps: int) -> dict[str, Any]:
    """One rank: build, resume, train ``steps``, save; the params (whole) and the steps taken."""
    model = _model()
    if fsdp2:
        forward, opt, saver, loader = _fsdp2(model)
    else:
        forward, opt, saver, loader = _zero(model, strategy)
    if load:
        loader(load)
    start = _steps_taken(opt.optim if hasattr(opt, "optim") else opt)
    for step in range(start, start + steps):
        x, y = _batch(step)
        nn.functional.mse_loss(forward(x), y).backward()
        opt.step()
        opt.zero_grad()
    if save:
        saver(save)
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return {"params": [p.detach().numpy().copy() for p in full], "steps": start + steps}  # numpy: pickled whole


def _zero(model: nn.Module, strategy: str):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero.backends import ZeroRedundancyOptimizer, checkpoint

    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, strategy=strategy, lr=LR)
    return (ddp, opt, lambda path: checkpoint.save(path, ddp, opt),
            lambda path: checkpoint.load(path, ddp, opt))


def _fsdp2(model: nn.Module):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def saver(path: str) -> None:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    def loader(path: str) -> None:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)

    return model, opt, saver, loader


def one_process(steps: int) -> list[torch.Tensor]:
    """Plain AdamW, one process, the same batches: what every run should end at."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.load:
        from zero.backends.checkpoint import read_metadata

        read_metadata(args.load)  # a missing or unfinished checkpoint: a ValueError here, not in a rank
    rows = launch.run(train_leg, args.ranks, args.strategy, args.fsdp2, args.load, args.save, args.steps,
                      timeout=600)
    got, steps = rows[0]["params"], rows[0]["steps"]
    worst = max(float((torch.from_numpy(a) - b).abs().max()) for a, b in zip(got, one_process(steps)))
    system = "FSDP2 + AdamW" if args.fsdp2 else f"ZeRO(AdamW), {args.strategy} plan"
    print(f"{system} on {args.ranks} ranks: {args.steps} steps"
          + (f" resumed from {args.load}" if args.load else "") + f", {steps} in all"
          + (f"; saved to {args.save}" if args.save else ""))
    print(f"largest difference of any param from one process over {steps} steps: {worst:.1e}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
