"""SOAP and Shampoo steps: each matrix preconditioned once by its owner (zero's ZeRO, a plan
balanced by the rule's step flops) against every rank preconditioning every matrix (each rank's
own `zero.functional.Optimizer` over all params, as under DDP), on gloo ranks; and the step in one
process against ``pytorch_optimizer``'s ``SOAP`` and ``ScalableShampoo`` (SVD roots) on the same
model and gradients.

The model is `muon_bench`'s GPT blocks (``--layers``, ``--width``, without the embeddings, whose
long axis SOAP leaves unfactored). Times are medians over ``--repeat`` steps (the slowest rank's
for the ranks), each system taking turns with its reference, one intra-op thread per rank, with the
bases and roots refreshed every ``--every`` steps (their amortised cost in every step's median is
not: a refresh step's time is its own row). State: tensor bytes per rank.
Usage: python bench/kronecker_bench.py [--ranks 4] [--repeat 9] [--layers 4] [--width 256] [--every 10]
       python bench/kronecker_bench.py --matrices 200 --size 64   (one process: SOAP beside AdamW and Muon)
       python bench/kronecker_bench.py --matrices 20 --size 256 --rules shampoo --turn 5   (five steps a turn)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from muon_bench import Block  # noqa: E402
from torch import nn  # noqa: E402

import zero  # noqa: E402
import zero.functional as F  # noqa: E402

RULES = ("soap", "shampoo", "adamw", "muon")  # the rules of the one-process bench (--matrices)


def blocks(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleList([Block(width) for _ in range(layers)])


def rule(name: str, every: int) -> F.GradientTransformation:
    if name == "soap":
        return F.contrib.soap(3e-3, weight_decay=0.01, precondition_frequency=every)
    return F.contrib.shampoo(1e-3, graft_type="rmsprop", start_preconditioning_step=1,
                             preconditioning_compute_steps=every, block_size=512)


def cost(name: str, every: int) -> str:
    return (f"soap(precondition_frequency={every})" if name == "soap" else
            f"shampoo(preconditioning_compute_steps={every}, graft_type='rmsprop')")


def with_grads(model: nn.Module, step: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    return model


def timed(pair: list, repeat: int, every: int, barrier, turn: int = 1) -> list[tuple[float, float]]:
    """Per system of ``pair`` (step functions), the median plain step and the median refresh step
    (ms), taking turns every ``turn`` steps (1: step by step); the first ``every`` steps warm up
    (the first gathers)."""
    plain, refresh = [[] for _ in pair], [[] for _ in pair]
    last = every * repeat
    for start in range(1, last + 1, turn):
        for i, step in enumerate(pair):
            for k in range(start, min(start + turn, last + 1)):
                barrier()
                t0 = time.perf_counter()
                step()
                (refresh if k % every == 0 else plain)[i].append(time.perf_counter() - t0)
    return [(statistics.median(p[every:]) * 1e3, statistics.median(r[1:] or r) * 1e3)
            for p, r in zip(plain, refresh)]


def worker(rank: int, world_size: int, name: str, layers: int, width: int, repeat: int, every: int) -> dict:
    import torch.distributed as dist

    from zero.backends import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    owned_m, every_m = with_grads(blocks(layers, width)), with_grads(blocks(layers, width))
    plan = zero.make_plan(zero.param_metas(owned_m), world_size, "balanced", "step_flops", cost(name, every))
    owned = ZeroRedundancyOptimizer(owned_m.named_parameters(), rule(name, every), plan=plan)
    everyone = F.Optimizer(every_m.named_parameters(), rule(name, every))
    times = timed([owned.step, everyone.step], repeat, every, dist.barrier)
    return {"times": times, "state": [owned.optim.state_nbytes(), everyone.state_nbytes()],
            "planned": plan.ranks[rank].state_bytes}


def one_process(name: str, layers: int, width: int, repeat: int, every: int) -> list[tuple[float, float]]:
    from pytorch_optimizer import SOAP, ScalableShampoo
    from pytorch_optimizer.optimizer.utils.graft import LayerWiseGrafting

    torch.set_num_threads(1)
    ours_m, ref_m = with_grads(blocks(layers, width)), with_grads(blocks(layers, width))
    ours = F.Optimizer(ours_m.named_parameters(), rule(name, every))
    ref = (SOAP(ref_m.parameters(), lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01, precondition_frequency=every)
           if name == "soap" else
           ScalableShampoo(ref_m.parameters(), lr=1e-3, graft_type=LayerWiseGrafting.RMSPROP,
                           start_preconditioning_step=1, preconditioning_compute_steps=every, block_size=512,
                           use_svd=True))
    return timed([ours.step, ref.step], repeat, every, lambda: None)


def same_shape(matrices: int, size: int, repeat: int, every: int, rules: list[str], turn: int) -> dict[str, tuple]:
    """One process, ``matrices`` matrices of ``size`` x ``size`` (one thread): zero's SOAP and Shampoo
    against pytorch_optimizer's, with zero's AdamW and Muon against torch's fastest beside them (those of
    ``rules``); per rule the two (plain, refresh) medians."""
    from pytorch_optimizer import SOAP, ScalableShampoo
    from pytorch_optimizer.optimizer.utils.graft import LayerWiseGrafting

    torch.set_num_threads(1)

    def params():
        gen = torch.Generator().manual_seed(0)
        ps = [nn.Parameter(torch.randn(size, size, generator=gen)) for _ in range(matrices)]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        return ps

    pairs = {"soap": lambda: (F.Optimizer(params(), F.contrib.soap(3e-3, weight_decay=0.01,
                                                                   precondition_frequency=every)),
                              SOAP(params(), lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01,
                                   precondition_frequency=every)),
             "shampoo": lambda: (F.Optimizer(params(), rule("shampoo", every)),
                                 ScalableShampoo(params(), lr=1e-3, graft_type=LayerWiseGrafting.RMSPROP,
                                                 start_preconditioning_step=1, preconditioning_compute_steps=every,
                                                 block_size=512, use_svd=True)),
             "adamw": lambda: (F.Optimizer(params(), F.adamw(1e-3)), torch.optim.AdamW(params(), lr=1e-3, fused=True)),
             "muon": lambda: (F.Optimizer(params(), F.contrib.muon(1e-3)), torch.optim.Muon(params(), lr=1e-3))}
    return {name: timed([a.step, b.step], repeat, every, lambda: None, turn)
            for name, (a, b) in ((name, pairs[name]()) for name in rules)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--matrices", type=int, help="only one process on this many same-shape square matrices")
    parser.add_argument("--size", type=int, default=64, help="their side (with --matrices)")
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES), help="(with --matrices)")
    parser.add_argument("--turn", type=int, default=1,
                        help="steps each system takes in a row (with --matrices; 1: turns step by step)")
    args = parser.parse_args()
    if args.matrices:
        print(f"{args.matrices} matrices of {args.size} x {args.size}, one process, one thread; bases and roots every "
              f"{args.every} steps; medians (ms) of the plain steps and of {args.repeat} refresh steps")
        for name, ((ours, ours_r), (ref, ref_r)) in same_shape(args.matrices, args.size, args.repeat, args.every,
                                                               args.rules, args.turn).items():
            peer = {"soap": "pytorch_optimizer SOAP", "shampoo": "pytorch_optimizer ScalableShampoo",
                    "adamw": "torch AdamW(fused=True)", "muon": "torch Muon"}[name]
            print(f"  {name:7s} zero {ours:7.2f} / {ours_r:7.2f}   {peer} {ref:7.2f} / {ref_r:7.2f}   "
                  f"{ours / ref:.2f}x / {ours_r / ref_r:.2f}x")
        return 0
    from zero.tools.launch import run

    print(f"{args.layers} GPT blocks of width {args.width}, bases/roots every {args.every} steps, "
          f"{args.ranks} gloo ranks; medians of {args.repeat} refresh steps and the plain steps between")
    for name in ("soap", "shampoo"):
        ranks = run(worker, args.ranks, name, args.layers, args.width, args.repeat, args.every, timeout=1800)
        own_plain = max(r["times"][0][0] for r in ranks)
        own_ref = max(r["times"][0][1] for r in ranks)
        all_plain = max(r["times"][1][0] for r in ranks)
        all_ref = max(r["times"][1][1] for r in ranks)
        state = [r["state"][0] for r in ranks]
        assert state == [r["planned"] for r in ranks], (state, [r["planned"] for r in ranks])
        print(f"\n{name}, {args.ranks} ranks        plain step ms   refresh step ms   state per rank MiB (max)")
        print(f"  owned once (zero)     {own_plain:12.1f}   {own_ref:15.1f}   {max(state) / 2**20:10.2f}")
        print(f"  every rank, all       {all_plain:12.1f}   {all_ref:15.1f}   {ranks[0]['state'][1] / 2**20:10.2f}")
        print(f"  ratio                 {own_plain / all_plain:12.2f}x  {own_ref / all_ref:14.2f}x  "
              f"{max(state) / ranks[0]['state'][1]:10.2f}x")
        (ours, ours_r), (ref, ref_r) = one_process(name, args.layers, args.width, args.repeat, args.every)
        print(f"  one process: zero {ours:.1f} / {ours_r:.1f} ms, pytorch_optimizer {ref:.1f} / {ref_r:.1f} ms: "
              f"{ours / ref:.2f}x / {ours_r / ref_r:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
