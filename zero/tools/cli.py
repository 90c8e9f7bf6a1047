"""The ``zero`` command line: ``zero plan`` prints, compares and saves plans."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from zero.plans.accounting import OPTIMIZERS
from zero.plans.costs import cost_of
from zero.plans.diff import diff_plans
from zero.plans.meta import param_metas
from zero.plans.plan import PLAN_STRATEGIES, WEIGHTS, Plan, make_plan
from zero.plans.presets import PRESETS, preset

__all__ = ["main", "load_metas", "subcommands"]


def _parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, argparse.Action]:
    """The ``zero`` parser, and its subcommands' action (whose ``choices`` name them)."""
    parser = argparse.ArgumentParser(prog="zero", description="zero: sharded optimizers whose plans are values. "
                                     "Plan a model's sharding, run the ZeRO demo, or run the benchmarks.")
    parser.add_argument("--version", action="version", version=f"zero {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the plan for a model's parameters")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS), help="a built-in shape list")
    src.add_argument("--shapes", type=Path, help="JSON file: {name: shape} or {name: {shape, dtype, ...}}")
    src.add_argument("--model", help="module:attr naming an nn.Module or a factory (built on meta)")
    src.add_argument("--diff", nargs=2, type=Path, metavar=("A.json", "B.json"),
                     help="what changes from plan A to plan B (saved with --json): owners, state moved, costs")
    p.add_argument("-w", "--world-size", type=int, default=8)
    p.add_argument("--strategy", choices=PLAN_STRATEGIES, default="sorted_greedy")
    p.add_argument("--weight", choices=WEIGHTS, default="numel",
                   help="what to balance: elements, optimizer-state bytes, or the work of each step "
                        "(step_flops; with --optimizer muon, Newton-Schulz matmuls)")
    p.add_argument("--optimizer", type=_optimizer_name, default="adam", metavar="NAME",
                   help=f"whose state to count: {', '.join(sorted(OPTIMIZERS))}; a low-bit one with another "
                        "block size as adamw8bit/128")
    p.add_argument("--alignment", type=int, default=1, help="flat shard alignment (elements)")
    p.add_argument("--split-heads", action="store_true",
                   help="with --strategy flat: cut the matrices --optimizer steps by heads (muon(heads=...)) at "
                        "head edges, every rank holding an equal share of their heads, instead of keeping them whole")
    p.add_argument("--master-dtype", help="the optimizer steps master copies in this dtype (e.g. float32 for a "
                                          "bf16 model): counts them and their state per rank")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--compare", action="store_true", help="every strategy side by side (prints only)")
    out.add_argument("--json", type=Path, help="save the plan as JSON here")
    p.add_argument("--rows", type=int, default=16, help="ranks (and, with --diff, transfers) shown in the tables")
    p.add_argument("--engine", choices=("zero", "fsdp2"), default="zero",
                   help="zero: zero's own ZeRO plans; fsdp2: the plan of zero.functional.Optimizer over FSDP2's "
                        "sharded params (each rank's rows, the params stepped whole by an owner, state and "
                        "exchange bytes per rank)")
    c = sub.add_parser("checkpoint", help="look into a sharded checkpoint (torch.distributed.checkpoint's format, "
                                          "or a JAX mesh's Orbax one), verify it, or convert one into the other")
    c.add_argument("action", choices=("show", "verify", "train", "convert"),
                   help="show: each saved tensor, its shape, dtype, bytes and chunks; verify: every piece against its "
                        "checksum, without loading (exit 1 if any differs or the metadata is damaged); convert: "
                        "PATH into DST in the format --to names; train: see zero checkpoint train -h")
    c.add_argument("path", type=Path, help="the checkpoint's directory")
    c.add_argument("dst", type=Path, nargs="?", help="convert: the directory to write")
    c.add_argument("--to", choices=("orbax", "dcp"), help="convert: the format to write")
    c.add_argument("--names", choices=("torch", "optax"), default="torch",
                   help="convert --to dcp: the optimizer state under torch.optim's names (Adam, AdamW, SGD) or Optax's "
                        "paths (a zero.functional rule)")
    c.add_argument("--json", action="store_true", help="print JSON (for scripts) instead of a table")
    c.add_argument("--rows", type=int, default=40, help="tensors shown in the table")
    sub.add_parser("demo", help="the ZeRO tutorial on 2 gloo ranks: ZeRO vs plain Adam (see zero demo -h)",
                   add_help=False)
    sub.add_parser("bench", help="run the benchmark scripts of a source checkout (see zero bench -h)",
                   add_help=False)
    sub.add_parser("simulate", help="ranks of a large job running the real step under torch's fake process group: "
                   "memory and collectives measured vs the plan's prediction (see zero simulate -h)", add_help=False)
    return parser, sub


def load_metas(args: argparse.Namespace):
    """Parameter metadata from whichever source the arguments name."""
    if args.preset:
        return preset(args.preset)
    if args.shapes:
        try:
            shapes = json.loads(args.shapes.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--shapes {args.shapes}: not valid JSON ({e})") from None
        if not isinstance(shapes, dict):
            raise ValueError(f"--shapes {args.shapes} holds a JSON {type(shapes).__name__}; it must map each param's "
                             'name to its shape, e.g. {"w": [300, 20], "b": [20]} (or to {"shape": [...], '
                             '"dtype": "bfloat16"})')
        return param_metas(shapes)
    module_name, _, attr = args.model.partition(":")
    if not attr:
        raise ValueError(f"--model {args.model!r} must look like module:attr")
    import torch

    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # find modules beside the user, as `python -m` does
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--model {args.model!r}: cannot import {module_name!r} ({e})") from None
    if not hasattr(module, attr):
        raise ValueError(f"--model {args.model!r}: module {module_name!r} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if not isinstance(obj, torch.nn.Module):
        with torch.device("meta"):  # plan a model of any size without allocating it
            obj = obj()
    return param_metas(obj)


def _optimizer_name(name: str) -> str:
    """An optimizer name `zero.make_plan` knows (argparse reports the ValueError's words)."""
    try:
        cost_of(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def _fsdp2_plan(args: argparse.Namespace, metas: list) -> int:
    from zero.plans.fsdp2 import make_fsdp2_plan

    given = [flag for flag, value, default in (("--strategy", args.strategy, "sorted_greedy"),
                                                ("--weight", args.weight, "numel"), ("--alignment", args.alignment, 1),
                                                ("--master-dtype", args.master_dtype, None),
                                                ("--compare", args.compare, False), ("--json", args.json, None),
                                                ("--split-heads", args.split_heads, False))
             if value != default]
    if given:
        raise SystemExit(f"zero plan --engine fsdp2: {', '.join(given)} shape zero's own plans, not FSDP2's layout")
    plan = make_fsdp2_plan(metas, args.world_size, args.optimizer)
    print(plan.table())
    _warn_imbalance([plan.state_bytes(r) for r in range(plan.ranks)], [plan.owned(r) for r in range(plan.ranks)],
                    plan.metas, plan.optimizer)
    return 0


def _warn_imbalance(states: list[int], owned: list, metas: tuple, optimizer: str) -> None:
    from zero.plans.balance import state_imbalance

    said = state_imbalance(states, owned, metas, optimizer)
    if said:
        print(said, file=sys.stderr)


def _plan(args: argparse.Namespace) -> int:
    from zero.plans.render import compare_table, render

    if args.diff:
        a, b = (Plan.from_json(_read(path)) for path in args.diff)
        print(render(diff_plans(a, b).table(args.rows)))
        return 0
    metas = load_metas(args)
    if args.engine == "fsdp2":
        return _fsdp2_plan(args, metas)
    if args.compare:
        matrices = cost_of(args.optimizer).keeps_whole  # Muon: whole matrices, and work to balance
        weights = ("numel", "state_bytes", "step_flops") if matrices else ("numel", "state_bytes")
        plans = [make_plan(metas, args.world_size, s, w, args.optimizer, args.alignment,
                           master_dtype=args.master_dtype)
                 for s in PLAN_STRATEGIES for w in weights
                 if s != "flat" or (w == "numel" and not matrices)]
        print(render(compare_table(plans)))
        return 0
    plan = make_plan(metas, args.world_size, args.strategy, args.weight, args.optimizer, args.alignment,
                     master_dtype=args.master_dtype, split_heads=args.split_heads)
    print(render(plan.table(args.rows)))
    owned = [[] for _ in range(plan.world_size)]
    for i, r in enumerate(plan.partition.owner if plan.partition is not None else ()):
        if r >= 0:
            owned[r].append(i)
    _warn_imbalance([r.state_bytes for r in plan.ranks], owned, plan.metas, plan.optimizer)
    if args.json:
        args.json.write_text(plan.to_json())
        print(f"saved {args.json}")
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    from rich.table import Table

    from zero.plans.render import render

    if args.action == "convert":
        return _convert(args)
    if args.action == "verify":
        return _verify(args.path)
    if (args.path / "zero" / "metadata").exists():
        return _show_orbax(args, render, Table)
    from zero.backends.checkpoint import describe  # torch loads only here

    rows = describe(args.path)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    tensors = [r for r in rows if r["kind"] == "tensor"]
    table = Table(title=f"{args.path}: {len(tensors)} tensors, {sum(r['bytes'] for r in tensors) / 2**20:.2f} MiB, "
                        f"{len(rows) - len(tensors)} other entries")
    _key_column(table, tensors[:args.rows])
    for col in ("shape", "dtype", "bytes", "chunks", "complete"):
        table.add_column(col, justify="left" if col == "chunks" else "right")
    for r in tensors[:args.rows]:
        chunks = ", ".join(f"{tuple(c['offsets'])}+{tuple(c['sizes'])} in {c['file']}" for c in r["chunks"][:3])
        more = f" (+{len(r['chunks']) - 3})" if len(r["chunks"]) > 3 else ""
        table.add_row(r["key"], str(tuple(r["shape"])), r["dtype"], str(r["bytes"]),
                      f"{len(r['chunks'])}: {chunks}{more}", "yes" if r["complete"] else "NO")
    print(render(table))
    if len(tensors) > args.rows:
        print(f"... {len(tensors) - args.rows} more tensors (--rows, or --json for all)")
    return 0


def _key_column(table, rows) -> None:
    """The key column, wide enough for its keys (up to 60 columns): a key is what a user searches for, so the
    other columns wrap first."""
    table.add_column("key", no_wrap=True, min_width=min(60, max((len(r["key"]) for r in rows), default=3)))


def _verify(path: Path) -> int:
    """Every piece of the checkpoint at ``path`` against its checksum: 0 when all match, 1 if not
    (a damaged or unfinished metadata file included); no directory there is a usage error (2)."""
    if not path.is_dir():
        raise ValueError(f"no checkpoint at {str(path)!r}: not a directory")
    try:
        errors, count = _checked(path)
    except ValueError as e:  # the metadata itself is damaged, or the save never finished
        errors, count = [str(e)], None
    for e in errors:
        print(f"DAMAGED: {e}")
    if errors:
        print(f"{path}: {len(errors)} problems found")
        return 1
    print(f"{path}: {count} match their checksums (xxh3_64)" if count else
          f"{path}: no checksums (saved by DCP or FSDP2 directly, or an older zero): every file is there and long "
          "enough, but the bytes cannot be verified")
    return 0


def _checked(path: Path) -> tuple[list[str], str | None]:
    """The problems found in the checkpoint at ``path``, and how many pieces have checksums (None: none)."""
    if (path / "zero" / "metadata").exists():
        from zero.backends import orbax_format as orbax  # jax loads only here

        meta = orbax.read_meta(path)
        sums = meta.get("checksums")
        return orbax.verify(path, meta), f"{sum(len(p) for p in sums.values())} pieces of {len(sums)} arrays" \
            if sums else None
    from zero.backends.checkpoint import integrity, read_metadata  # torch loads only here

    metadata = read_metadata(path)
    everything = integrity.pieces(path, metadata)
    return integrity.verify(path, metadata), f"{len(everything)} pieces in {len({p.file for p in everything})} " \
        "files" if integrity.has_checksums(path) else None


def _convert(args: argparse.Namespace) -> int:
    if args.dst is None or args.to is None:
        raise ValueError("convert needs a destination and a format: zero checkpoint convert SRC DST --to orbax|dcp")
    from zero.backends.checkpoint import convert  # torch and jax load only here

    if args.to == "orbax":
        meta = convert.to_orbax(args.path, args.dst)
        print(f"wrote {args.dst}: {len(meta['names'])} params, state {[n['path'] for n in meta['nodes']]} (Orbax, "
              "for zero.backends.jax_mesh.restore)")
    else:
        convert.to_dcp(args.path, args.dst, names=args.names)
        print(f"wrote {args.dst} (DCP, for zero.backends.checkpoint.load; state under {args.names} names)")
    return 0


def _show_orbax(args: argparse.Namespace, render, Table) -> int:
    import json as _json

    from zero.backends.checkpoint.convert import orbax_entries

    with open(args.path / "zero" / "metadata") as f:
        meta = _json.load(f)
    rows = list(orbax_entries(meta))
    if args.json:
        print(json.dumps({"layout": meta["layout"], "plan": meta["plan"] is not None, "entries": rows}, indent=1))
        return 0
    saved = "per param" if meta["layout"] == "params" else "in a plan's buffers, one chunk a device"
    mib = sum(r["bytes"] for r in rows) / 2**20
    table = Table(title=f"{args.path}: Orbax (zero.backends.jax_mesh), {len(meta['names'])} params, state "
                        f"{[n['path'] for n in meta['nodes']]} {saved}, {mib:.2f} MiB")
    _key_column(table, rows[:args.rows])
    for col in ("shape", "dtype", "bytes"):
        table.add_column(col, justify="right")
    for r in rows[:args.rows]:
        table.add_row(r["key"], str(tuple(r["shape"])), r["dtype"], str(r["bytes"]))
    print(render(table))
    if len(rows) > args.rows:
        print(f"... {len(rows) - args.rows} more entries (--rows, or --json for all)")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("zero")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read plan {path}: {e.strerror}") from None


def subcommands() -> list[str]:
    """The ``zero`` command's subcommands (``plan``, ``simulate`` ...), as ``zero -h`` lists them."""
    return list(_parsers()[1].choices)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from zero.tools.arguments import demo_parser

        demo_parser().parse_args(argv[1:])  # a usage error before torch loads
        from zero.tools.demo import main as demo  # torch loads only here, for the demo

        return demo(argv[1:])
    if argv[:2] == ["checkpoint", "train"]:
        from zero.tools.resume import main as train  # torch loads only here

        try:
            return train(argv[2:])
        except ValueError as e:
            print(f"zero checkpoint train: error: {e}", file=sys.stderr)
            return 2
    if argv[:1] == ["simulate"]:
        from zero.tools.simulate import main as simulate  # torch loads only here

        return simulate(argv[1:])
    if argv[:1] == ["bench"]:
        from zero.tools.bench import main as bench

        try:
            return bench(argv[1:])
        except ValueError as e:
            print(f"zero bench: error: {e}", file=sys.stderr)
            return 2
    args = _parser().parse_args(argv)
    try:
        return {"plan": _plan, "checkpoint": _checkpoint}[args.command](args)
    except (ValueError, TypeError, OSError) as e:
        print(f"zero {args.command}: error: {e}", file=sys.stderr)
        return 2
