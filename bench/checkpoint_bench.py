"""Saving and loading a sharded optimizer's checkpoint, three ways, in the same run.

- ``zero_dcp``: zero's `zero.backends.checkpoint.save` / ``load`` (each rank writes and reads its
  own pieces with ``torch.distributed.checkpoint``; a flat plan, so every rank holds 1/W): every
  piece hashed as it is written, every piece verified (each rank its share) before the load;
- ``zero_dcp_async``: ``zero_dcp`` saved with ``async_save=True``: "save s" is what training is
  blocked (the state copied), "written s" when the background write, checksums and swap are done;
- ``zero_dcp_async_kept``: ``zero_dcp_async`` with ``keep_staging=True``, timed at a run's second save
  (the first, untimed, made the kept buffers; a fresh directory each);
- ``zero_dcp_unverified``: the same with DCP's own writer (no checksums) and ``load(verify=False)``;
- ``zero_dcp_nosync``: that, without DCP's default fsync of each file (``torch.save`` does none);
- ``zero_consolidate``: zero's ``consolidate_state_dict(to=0)`` + ``torch.save`` on rank 0;
  loading: every rank ``torch.load``s the file and ``load_state_dict``s it;
- ``torch_consolidate``: the same with torch's ``ZeroRedundancyOptimizer``.

Adam over a stack of ``Linear(width, width)`` (``--layers 24 --width 2048``: 100.7M params) in
fp32 on ``--ranks`` gloo ranks (one thread each), after one step (so the state exists), each system
in fresh processes. Times are the slowest rank's, from a barrier to a barrier (a load's: the median
of ``--loads``); "peak" is each rank's resident memory above what it held before the save (or
load), sampled every 2 ms, the largest over ranks. State per rank
is what its optimizer holds. Every rank's files go to a fresh directory under ``--dir``.

    python bench/checkpoint_bench.py [--layers 24] [--width 2048] [--ranks 4] [--loads 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import checkpoint
from zero.tools.launch import run

SYSTEMS = ("zero_dcp", "zero_dcp_async", "zero_dcp_async_kept", "zero_dcp_unverified", "zero_dcp_nosync",
           "zero_consolidate", "torch_consolidate")


class PeakRSS:
    """Resident memory above the level at entry, its peak sampled by a thread."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def above(self) -> int:
        return self.peak - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(system: str, layers: int, width: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if system == "torch_consolidate":
        opt = TorchZero(model.parameters(), torch.optim.Adam, lr=1e-4)
    else:
        flat = system.startswith("zero_dcp")
        opt = Zero(model.parameters(), torch.optim.Adam, strategy="flat" if flat else None, lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    return model, opt


def save(system: str, model, opt, path: str, rank: int) -> object:
    if system == "zero_dcp":
        checkpoint.save(path, model, opt)
        return None
    if system.startswith("zero_dcp_async"):
        return checkpoint.save(path, model, opt, async_save=True, keep_staging=system.endswith("kept"))
    if system.startswith("zero_dcp"):
        # DCP fsyncs each file by default; torch.save (the consolidating systems) does not
        sync = system == "zero_dcp_unverified"
        checkpoint.save(None, model, opt, storage_writer=dcp.FileSystemWriter(path, sync_files=sync))
        return None
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    return None


def load(system: str, model, opt, path: str) -> None:
    if system.startswith("zero_dcp"):
        checkpoint.load(path, model, opt, verify=system == "zero_dcp")
        return
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])


def timed(fn) -> tuple[float, int, float]:
    """Seconds until every rank's ``fn()`` returned, the peak memory above the start, and (for a
    background save) seconds until its write was done on every rank."""
    dist.barrier()
    with PeakRSS() as rss:
        t = time.perf_counter()
        future = fn()
        dist.barrier()
        elapsed = time.perf_counter() - t
        if future is not None:
            future.result()
        dist.barrier()
        done = time.perf_counter() - t
    return elapsed, rss.above, done


def worker(rank: int, world_size: int, layers: int, width: int, root: str, systems: tuple[str, ...] = SYSTEMS,
           loads_per_system: int = 3) -> dict:
    out = {}
    for system in systems:
        model, opt = build(system, layers, width)
        state = sum(v.nbytes for st in opt.optim.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        path = os.path.join(root, system if system.startswith("zero_dcp") else f"{system}.pt")
        if system == "zero_dcp_async_kept":  # a run's first save, untimed: it makes the buffers the next keeps
            save(system, model, opt, path + "-first", rank).result()
        save_s, save_peak, written_s = timed(functools.partial(save, system, model, opt, path, rank))
        loads = []
        for _ in range(loads_per_system):  # the median of several: one load is ~1 s, within noise
            for p in model.parameters():  # load into a run that has moved on
                p.data.add_(1.0)
            loads.append(timed(functools.partial(load, system, model, opt, path)))
        load_s, load_peak = statistics.median(t for t, _, _ in loads), max(peak for _, peak, _ in loads)
        out[system] = {"save_s": save_s, "written_s": written_s, "load_s": load_s, "save_peak": save_peak,
                       "load_peak": load_peak, "state": state}
        del model, opt
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--loads", type=int, default=3, help="loads timed per system (the median is shown)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="zero-ckpt-bench-", dir=args.dir)
    try:  # each system in fresh processes: the first to run pays for memory the later ones reuse
        per_system = [run(worker, args.ranks, args.layers, args.width, root, (system,), args.loads, timeout=3000,
                          pg_timeout=1800) for system in SYSTEMS]
        rows = [{k: v for got in per_system for k, v in got[r].items()} for r in range(args.ranks)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _print(rows, args)
    return 0


def _print(rows: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    n = args.layers * (args.width * args.width + args.width) / 1e6
    table = Table(title=f"Adam checkpoint, {args.layers} x Linear({args.width},{args.width}) ({n:.1f}M params, fp32), "
                        f"{args.ranks} gloo ranks")
    for col in ("system", "save s", "x torch's", "x zero's consolidate", "load s", "x torch's", "x zero's consolidate",
                "peak save (MB)", "peak load (MB)", "state / rank (MB)"):
        table.add_column(col, justify="left" if col == "system" else "right", no_wrap=True)

    def worst(system, key):
        return max(r[system][key] for r in rows)

    for s in SYSTEMS:
        cells = [s]
        for op in ("save_s", "load_s"):
            cells += [f"{worst(s, op):.2f}", f"{worst(s, op) / worst('torch_consolidate', op):.2f}x",
                      f"{worst(s, op) / worst('zero_consolidate', op):.2f}x"]
        cells += [f"{worst(s, 'save_peak') / 1e6:.0f}", f"{worst(s, 'load_peak') / 1e6:.0f}",
                  f"{worst(s, 'state') / 1e6:.0f}"]
        table.add_row(*cells)
    Console(width=200).print(table)
    Console(width=200).print(
        f"asynchronous save: training blocked {worst('zero_dcp_async', 'save_s'):.2f} s = "
        f"{worst('zero_dcp_async', 'save_s') / worst('zero_dcp', 'save_s'):.2f}x the synchronous save "
        f"({worst('zero_dcp', 'save_s'):.2f} s); written after {worst('zero_dcp_async', 'written_s'):.2f} s; "
        f"with keep_staging=True, a run's second save blocked {worst('zero_dcp_async_kept', 'save_s'):.2f} s = "
        f"{worst('zero_dcp_async_kept', 'save_s') / worst('zero_dcp', 'save_s'):.2f}x\n"
        f"verified load / unverified: {worst('zero_dcp', 'load_s') / worst('zero_dcp_unverified', 'load_s'):.2f}x")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
