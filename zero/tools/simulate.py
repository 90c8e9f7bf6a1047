"""``zero simulate``: ranks of a large job, each running the real ZeRO step under torch's fake process
group and fake tensors, their measured memory and collectives beside what the plan predicts.

    zero simulate --preset llama-70b -w 1024 --strategy flat --reduce-scatter-grads \\
        --master-dtype float32 --reduce-dtype float32 --ranks 0,511,1023 --json out.json
    zero simulate --preset llama-70b -w 1024 --engine fsdp2 --replicate 8 --zero-over-replicas

See `zero.backends.simulate` for what runs, and `zero.plans.footprint` for what is predicted;
with ``--engine fsdp2``, `zero.backends.fsdp2_peer.simulate_fsdp2` and `zero.plans.fsdp2_memory`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from zero.plans.presets import PRESETS, preset

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zero simulate", description="Run the real ZeRO step of some ranks of a "
                                "large job under torch's fake process group (no memory, no GPU) and compare "
                                "the memory and collectives measured with the plan's prediction.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS), help="a built-in shape list")
    src.add_argument("--model", help="module:attr naming an nn.Module factory (called on the meta device, its "
                     "params then fake tensors) or module")
    p.add_argument("-w", "--world-size", type=int, default=64)
    p.add_argument("--strategy", default="sorted_greedy", help="a plan strategy (flat: element-level shards)")
    p.add_argument("--optimizer", default="adamw", help="the torch.optim rule each rank steps with: adamw, adam, "
                                                        "sgd or sgd_momentum")
    p.add_argument("--whole", choices=("matrices",), help="with --strategy flat: a hybrid plan keeping these whole")
    p.add_argument("--dtype", help="cast the params to this dtype first (e.g. bfloat16)")
    p.add_argument("--master-dtype", help="step fp32 (or this dtype's) master copies of the params")
    p.add_argument("--reduce-scatter-grads", action="store_true", help="ZeRO-2: gradients reduce-scattered in "
                                                                        "backward, in place of DDP (flat plans)")
    p.add_argument("--reduce-dtype", help="with --reduce-scatter-grads: reduce the gradients in this dtype")
    p.add_argument("--bucket-view", choices=("default", "true", "false"), default="default",
                   help="parameters_as_bucket_view (whole-param plans)")
    p.add_argument("--engine", choices=("zero", "fsdp2"), default="zero",
                   help="zero: zero's ZeRO-1/2 over whole params; fsdp2: FSDP2's fully_shard per layer (HSDP with "
                        "--replicate)")
    p.add_argument("--replicate", type=int, default=1, help="with --engine fsdp2: replicas (HSDP's replicate dim)")
    p.add_argument("--zero-over-replicas", action="store_true",
                   help="with --engine fsdp2: step with zero.ZeroRedundancyOptimizer (the state over every rank) in "
                        "place of torch.optim's class")
    p.add_argument("--ranks", default=None, help="comma-separated ranks to run (default: first, middle and last)")
    p.add_argument("--batch", type=_batch, metavar="B,T",
                   help="run the model's forward and backward on B x T token ids (a LLaMA preset, or --model whose "
                        "forward takes them), so activations are measured too")
    p.add_argument("--json", type=Path, help="write one object per rank here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        runs = _simulate(args)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"zero simulate: error: {e}", file=sys.stderr)
        return 2
    _print(runs, args)
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in runs], indent=1))
        print(f"saved {args.json}")
    return 0


def _simulate(args: argparse.Namespace) -> list[Any]:
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from zero.backends.simulate import simulate

    ranks = _ranks(args.ranks, args.world_size)
    if args.engine == "fsdp2":
        return _simulate_fsdp2(args, ranks)
    if args.replicate != 1 or args.zero_over_replicas:
        raise ValueError("--replicate and --zero-over-replicas are --engine fsdp2's")
    options = {"optimizer": args.optimizer, "strategy": args.strategy,
               "reduce_scatter_grads": args.reduce_scatter_grads, "dtype": _dtype(args.dtype, "--dtype"),
               "master_dtype": _dtype(args.master_dtype, "--master-dtype"),
               "reduce_dtype": _dtype(args.reduce_dtype, "--reduce-dtype"),
               "parameters_as_bucket_view": {"default": None, "true": True, "false": False}[args.bucket_view],
               "whole": (lambda m: len(m.shape) == 2) if args.whole else None, "batch": args.batch}
    source = preset(args.preset) if args.preset else _factory(args.model)
    runs = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=True) as progress:
        task = progress.add_task(f"simulating {len(ranks)} of {args.world_size} ranks", total=len(ranks))
        for rank in ranks:
            runs.append(simulate(source, args.world_size, rank, **options))
            progress.advance(task)
    torch.set_grad_enabled(True)
    return runs


# zero's own options, which FSDP2 (placing the params and reducing the gradients itself) does not take
_ZERO_ONLY = {"strategy": "sorted_greedy", "whole": None, "master_dtype": None,
              "reduce_scatter_grads": False, "reduce_dtype": None, "bucket_view": "default"}


def _simulate_fsdp2(args: argparse.Namespace, ranks: list[int]) -> list[Any]:
    from zero.backends.fsdp2_peer import simulate_fsdp2
    from zero.plans.meta import ParamMeta, param_metas

    given = [k for k, default in _ZERO_ONLY.items() if getattr(args, k) != default]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} is an option of --engine zero")
    if args.replicate < 1 or args.world_size % args.replicate:
        raise ValueError(f"--replicate {args.replicate} must be a positive divisor of -w {args.world_size}")
    source = preset(args.preset) if args.preset else _factory(args.model)
    factory = source if callable(source) else None
    if factory is not None:
        from zero.backends.fake_runs import built_on_meta

        source = param_metas(built_on_meta(source))
    if args.batch is not None and args.dtype is not None:
        raise ValueError("--dtype casts a preset's or a model's params for a run without --batch: with --batch the "
                         "model runs as its factory builds it")
    import torch

    dtype = _dtype(args.dtype, "--dtype")
    if dtype is not None:  # as --engine zero casts them: the float params, to this dtype
        name = str(dtype).removeprefix("torch.")
        source = [ParamMeta(m.name, m.shape, name, m.device, m.group, m.requires_grad)
                  if getattr(torch, m.dtype).is_floating_point else m for m in source]
    return [simulate_fsdp2(source, args.world_size, rank, replicas=args.replicate, optimizer=args.optimizer,
                           zero=args.zero_over_replicas, batch=args.batch, model=factory) for rank in ranks]


def _ranks(text: str | None, world_size: int) -> list[int]:
    if world_size < 1:
        raise ValueError(f"-w must be at least 1, got {world_size}")
    if text is None:
        return sorted({0, world_size // 2 - 1 if world_size > 1 else 0, world_size - 1})
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        raise ValueError(f"--ranks must be comma-separated ints, got {text!r}") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"--ranks {bad} are not ranks of a world of {world_size}")
    return ranks


def _batch(text: str) -> tuple[int, int]:
    try:
        b, t = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch takes B,T (two positive ints), got {text!r}") from None
    if b < 1 or t < 1:
        raise argparse.ArgumentTypeError(f"--batch takes B,T (two positive ints), got {text!r}")
    return b, t


def _dtype(name: str | None, flag: str) -> Any:
    if name is None:
        return None
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{flag} must name a float dtype such as float32 or bfloat16, got {name!r}")
    return dtype


def _factory(spec: str) -> Any:
    """The model of ``module:attr``: a factory the simulation calls under fake tensors, or a
    module already built (its parameter metadata then)."""
    import torch

    from zero.plans.meta import param_metas

    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"--model {spec!r} must look like module:attr")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # find modules beside the user, as `python -m` does
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--model {spec!r}: {e}") from None
    return param_metas(obj) if isinstance(obj, torch.nn.Module) else obj


def _print(runs: list[Any], args: argparse.Namespace) -> None:
    from rich.table import Table

    from zero.plans.render import render

    for r in runs:
        d = r.as_dict()
        moment = f" (measured: {d['measured_peak_phase']})" if d.get("measured_peak_phase") else ""
        table = Table(title=f"rank {r.rank} of {r.world_size}: peak in {d['peak_phase']}{moment}, measured "
                            f"{_gib(r.measured_peak_bytes)} vs predicted {_gib(r.predicted_peak_bytes)} GiB "
                            f"({(r.measured_peak_bytes / max(r.predicted_peak_bytes, 1) - 1):+.2%})")
        for col in ("GiB per rank", "predicted", "measured"):
            table.add_column(col, justify="left" if col.startswith("GiB") else "right")
        for name, pair in d["by_category"].items():
            table.add_row(name, _gib(pair["predicted"]), "-" if pair["measured"] is None else _gib(pair["measured"]))
        table.add_row("peak", _gib(r.predicted_peak_bytes), _gib(r.measured_peak_bytes))
        if "sent" in d:  # --engine fsdp2: FSDP2's and zero's collectives, within and across replicas
            for where, pair in d["sent"].items():
                table.add_row(f"sent per step, {where} replicas", _gib(pair["predicted"]), _gib(pair["measured"]))
            table.caption = _batch_caption(d, r.measured_peak_bytes)
            print(render(table, width=100))
            continue
        table.add_row("sent per step, zero's collectives", _gib(d["plan_collective_bytes"]),
                      _gib(d["collective_bytes"]))
        if d["ddp_allreduce_bytes"]:
            table.add_row("sent per step, DDP's all-reduce", _gib(d["ddp_allreduce_bytes"]), "not simulated")
            table.add_row("sent per step, in all", _gib(d["plan_collective_bytes"] + d["ddp_allreduce_bytes"]), "-")
        table.caption = ("sent: the bytes each rank sends (= receives) in a step, as nccl-tests count them: "
                         "all-gather and reduce-scatter (W-1)/W of the buffer, all-reduce 2(W-1)/W, broadcast all. "
                         + (_batch_caption(d, r.measured_peak_bytes) or ""))
        print(render(table, width=100))


def _batch_caption(d: dict, peak: int) -> str | None:
    """With ``--batch``: what the measured column holds that the plan's prediction leaves out."""
    if "batch" not in d:
        return None
    return (f"batch {d['batch'][0]}x{d['batch'][1]}: measured runs the model's forward and backward on fake "
            f"tensors; its activations {_gib(d['activation_bytes'])} GiB ({d['activation_bytes'] / max(peak, 1):.1%} "
            "of its peak), which the plan's prediction (model states and buffers) leaves out")


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"
