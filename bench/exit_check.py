"""Do ranks abort at exit? ``--runs`` launches of ``--ranks`` ranks under torchrun, each resuming a
sharded checkpoint, training a few steps, saving one and exiting as a user's script does (no
``destroy_process_group``, plain interpreter exit). A run fails when torchrun reports a rank's
non-zero exit (SIGABRT: ``terminate called without an active exception``).

``--kind zero``: DDP + `zero.ZeroRedundancyOptimizer` (flat plan) with zero's `checkpoint.save`
/ ``load``. ``--kind plain``: the same loop with torch alone (DDP, ``torch.optim.AdamW``, DCP's
``get_state_dict`` / ``dcp.save`` / ``dcp.load``): the reproducer without zero.

    python bench/exit_check.py --runs 100 --ranks 3 --kind zero
    python bench/exit_check.py --runs 100 --ranks 3 --kind plain
    python bench/exit_check.py --runs 100 --ranks 3 --kind zero --destroy

``--destroy``: each rank calls ``dist.destroy_process_group()`` after its save, as torch asks of
every script. ``--exit-now``: then ends with ``zero.tools.launch.exit_now()`` (its output flushed,
``os._exit``: no interpreter finalization for a gloo thread to race with).

    python bench/exit_check.py --runs 100 --ranks 3 --kind plain --destroy --exit-now
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time


def worker(kind: str, load: str | None, save: str, steps: int, destroy: bool, exit_now: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    ddp = DDP(model)
    if kind == "zero":
        import zero
        from zero.backends import checkpoint

        opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, strategy="flat", lr=1e-2)
        saver, loader = (lambda p: checkpoint.save(p, model, opt)), (lambda p: checkpoint.load(p, model, opt))
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def saver(path):
            m, o = get_state_dict(model, opt)
            dcp.save({"model": m, "optim": o}, checkpoint_id=path)

        def loader(path):
            m, o = get_state_dict(model, opt)
            dcp.load({"model": m, "optim": o}, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=m, optim_state_dict=o)

    if load:
        loader(load)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        opt.zero_grad()
        ddp(torch.randn(8, 64, generator=gen)).square().mean().backward()
        opt.step()
    saver(save)
    print(f"rank {dist.get_rank()} done", flush=True)
    if destroy:
        dist.destroy_process_group()
    if exit_now:
        from zero.tools.launch import exit_now as end

        end()


def launch(kind: str, ranks: int, load: str | None, save: str, destroy: bool,
           exit_now: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_port=0",
           "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", __file__, "--worker", "--kind", kind, "--save", save]
    if load:
        cmd += ["--load", load]
    if destroy:
        cmd.append("--destroy")
    if exit_now:
        cmd.append("--exit-now")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--kind", choices=("zero", "plain"), default="zero")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--destroy", action="store_true", help="destroy the process group before exit")
    ap.add_argument("--exit-now", action="store_true", help="end with zero.tools.launch.exit_now() (os._exit)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--load", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.kind, args.load, args.save, args.steps, args.destroy, args.exit_now)
        return 0
    root = tempfile.mkdtemp(prefix="zero-exit-check-")
    try:
        first = launch(args.kind, args.ranks, None, os.path.join(root, "start"), args.destroy, args.exit_now)
        if first.returncode:
            print(first.stderr[-3000:])
            return 1
        failed, start = [], time.perf_counter()
        for run in range(args.runs):
            out = launch(args.kind, args.ranks, os.path.join(root, "start"), os.path.join(root, f"run{run}"),
                         args.destroy, args.exit_now)
            aborted = "terminate called" in out.stderr
            if out.returncode or aborted:
                failed.append((run, out.returncode, aborted))
            shutil.rmtree(os.path.join(root, f"run{run}"), ignore_errors=True)
        kind = f"{args.kind}{' --destroy' if args.destroy else ''}{' --exit-now' if args.exit_now else ''}"
        print(f"{kind}: {args.runs} runs of {args.ranks} ranks under torchrun, each resuming a checkpoint, "
              f"{args.steps} steps, a save, a plain exit: {len(failed)} failed "
              f"({time.perf_counter() - start:.0f} s)")
        for run, rc, aborted in failed:
            print(f"  run {run}: exit code {rc}{', terminate called without an active exception' if aborted else ''}")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
