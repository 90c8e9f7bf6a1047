"""``zero bench``: run the benchmark scripts of a source checkout, with progress, and print their tables.

The scripts live in ``bench/`` beside the package (they are not installed); each prints ratio
tables against the reference measured in the same run (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

__all__ = ["SCRIPTS", "main"]

SCRIPTS = {"plan": "plan_bench.py", "functional": "functional_bench.py", "zero": "zero_bench.py",
           "rpc": "rpc_bench.py"}


def bench_dir() -> Path:
    folder = Path(__file__).resolve().parents[2] / "bench"
    if not folder.is_dir():
        raise ValueError(f"zero bench runs the scripts of a source checkout ({folder} is missing): "
                         "clone the repository and run it there")
    return folder


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zero bench", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", metavar="NAME", help=f"which benchmarks: {', '.join(SCRIPTS)} (default: all)")
    p.add_argument("--args", default="", help="extra arguments passed to every script, e.g. '--repeat 5'")
    return p


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    parser = _parser()
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SCRIPTS]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(SCRIPTS)}")
    names = args.names or list(SCRIPTS)
    folder = bench_dir()
    console = Console()
    failed = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as bar:
        overall = bar.add_task(f"{len(names)} benchmark(s)", total=len(names))
        for name in names:
            task = bar.add_task(f"bench/{SCRIPTS[name]}", total=None)
            res = subprocess.run([sys.executable, str(folder / SCRIPTS[name]), *args.args.split()],
                                 capture_output=True, text=True)
            bar.remove_task(task)
            bar.console.print(res.stdout.rstrip(), soft_wrap=True, markup=False, highlight=False)
            if res.returncode:
                failed.append(name)
                bar.console.print(f"[red]bench/{SCRIPTS[name]} failed[/red]:\n{res.stderr[-2000:]}")
            bar.advance(overall)
    return 1 if failed else 0
