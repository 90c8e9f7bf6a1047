"""Optax's catalogue in zero (#66): each new rule's step on 200 tensors beside Optax's (jitted,
on JAX arrays) and ``pytorch_optimizer``'s torch class where it has the rule, in one run; and each
rule's state per rank under ZeRO-1 (a flat plan) at 4 ranks against one process.

    .venv/bin/python bench/catalogue_bench.py [--elements 4e6] [--tensors 200] [--repeat 7] [--no-memory]

Step times are medians of ``--repeat`` steps after a warm-up, float32, on this machine's CPU
threads; zero's is ``zero.functional.Optimizer.step`` (in place, as a torch user runs it), Optax's
``jax.jit(update + apply_updates)``, the torch class's ``step``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import zero  # noqa: E402
import zero.functional as F  # noqa: E402
from zero.tools.launch import run  # noqa: E402

C = F.contrib


def _po(name: str, **kw):
    def make(params):
        import pytorch_optimizer as po

        return getattr(po, name)(params, **kw)
    return make


# rule -> (zero's, Optax's (a function of the optax module), pytorch_optimizer's or None)
RULES = {
    "adopt": (lambda: C.adopt(1e-3), lambda o: o.contrib.adopt(1e-3), _po("ADOPT", lr=1e-3)),
    "ademamix": (lambda: C.ademamix(1e-3), lambda o: o.contrib.ademamix(1e-3), _po("AdEMAMix", lr=1e-3)),
    "simplified_ademamix": (lambda: C.simplified_ademamix(1e-3), lambda o: o.contrib.simplified_ademamix(1e-3),
                            _po("SimplifiedAdEMAMix", lr=1e-3)),
    "schedule_free_adamw": (lambda: C.schedule_free_adamw(1e-3), lambda o: o.contrib.schedule_free_adamw(1e-3),
                            _po("ScheduleFreeAdamW", lr=1e-3)),
    "schedule_free_sgd": (lambda: C.schedule_free_sgd(1e-3), lambda o: o.contrib.schedule_free_sgd(1e-3),
                          _po("ScheduleFreeSGD", lr=1e-3)),
    "prodigy": (lambda: C.prodigy(), lambda o: o.contrib.prodigy(), _po("Prodigy")),
    "dadapt_adamw": (lambda: C.dadapt_adamw(), lambda o: o.contrib.dadapt_adamw(), _po("DAdaptAdam")),
    "madgrad": (lambda: C.madgrad(1e-3), lambda o: o.contrib.madgrad(1e-3), _po("MADGRAD", lr=1e-3)),
    "dog": (lambda: C.dog(), lambda o: o.contrib.dog(), None),
    "dowg": (lambda: C.dowg(), lambda o: o.contrib.dowg(), None),
    "cocob": (lambda: C.cocob(), lambda o: o.contrib.cocob(), None),
    "acprop": (lambda: C.acprop(1e-3), lambda o: o.contrib.acprop(1e-3), None),
    "lbfgs (no line search)": (lambda: F.lbfgs(1e-3, linesearch=None), lambda o: o.lbfgs(1e-3, linesearch=None),
                               None),
    "galore (rank 16)": (lambda: C.galore(1e-3, rank=16), lambda o: o.contrib.galore(1e-3, rank=16), None),
}


def shapes(elements: float, tensors: int) -> list[tuple[int, ...]]:
    """Half matrices (rows 64 to 512), half vectors, ``elements`` in all."""
    gen = torch.Generator().manual_seed(0)
    each = int(elements) // tensors
    out = []
    for k in range(tensors):
        if k % 2:
            out.append((each,))
        else:
            rows = int(torch.randint(64, 513, (1,), generator=gen))
            out.append((rows, max(1, each // rows)))
    return out


def _median(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def step_times(name: str, dims: list, repeat: int) -> tuple[float, float, float | None]:
    import jax
    import jax.numpy as jnp
    import optax

    ours_make, optax_make, peer = RULES[name]
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in dims]
    grads = [torch.randn(s, generator=gen) * 1e-2 for s in dims]
    for p, g in zip(params, grads):
        p.grad = g
    opt = F.Optimizer(params, ours_make())
    ours = _median(opt.step, repeat)
    peer_ms = None
    if peer is not None:
        theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p, g in zip(theirs, grads):
            p.grad = g
        popt = peer(theirs)
        peer_ms = _median(popt.step, repeat)
    otx = optax_make(optax)
    jp, jg = [jnp.asarray(p.detach().numpy()) for p in params], [jnp.asarray(g.numpy()) for g in grads]
    state = otx.init(jp)

    @jax.jit
    def jstep(p, s):
        u, s = otx.update(jg, s, p)
        return optax.apply_updates(p, u), s

    box = [jp, state]

    def run_jax():
        box[0], box[1] = jstep(box[0], box[1])
        jax.block_until_ready(box[0])

    return ours, _median(run_jax, repeat), peer_ms


def _state_bytes(rank: int, world_size: int, name: str, dims: list) -> int:
    gen = torch.Generator().manual_seed(1)
    named = [(f"p{k}", torch.nn.Parameter(torch.randn(s, generator=gen))) for k, s in enumerate(dims)]
    make = RULES[name][0]
    if world_size == 1:
        opt = F.Optimizer(named, make())
    else:
        plan = zero.make_plan(zero.param_metas(named), world_size, "flat", whole=(
            [n for n, p in named if p.dim() == 2] if name.startswith("galore") else ()))
        opt = zero.ZeroRedundancyOptimizer(named, make(), plan=plan)
    for _, p in named:
        p.grad = torch.ones_like(p) * 1e-3
    opt.step()
    local = opt if world_size == 1 else opt.optim
    return local.state_nbytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=float, default=4e6)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()
    dims = shapes(args.elements, args.tensors)
    print(f"{args.tensors} tensors, {sum(torch.Size(s).numel() for s in dims) / 1e6:.1f}M float32 elements, "
          f"{torch.get_num_threads()} threads")
    print(f"{'rule':26} {'zero ms':>8} {'optax ms':>9} {'zero/optax':>10} {'torch peer ms':>13} {'zero/peer':>9}")
    for name in RULES:
        ours, optax_ms, peer = step_times(name, dims, args.repeat)
        peer_txt = f"{peer:13.1f} {ours / peer:9.2f}" if peer is not None else f"{'-':>13} {'-':>9}"
        print(f"{name:26} {ours:8.1f} {optax_ms:9.1f} {ours / optax_ms:10.2f} {peer_txt}")
    if args.no_memory:
        return
    small = shapes(4e5, 40)
    print(f"\nstate per rank under ZeRO-1 (a flat plan; GaLore's matrices whole), 4 ranks, {len(small)} tensors, "
          f"{sum(torch.Size(s).numel() for s in small) / 1e6:.1f}M elements")
    print(f"{'rule':26} {'one process':>12} {'largest rank':>13} {'ratio':>7}")
    for name in RULES:
        one = run(_state_bytes, 1, name, small)[0]
        per_rank = run(_state_bytes, 4, name, small)
        print(f"{name:26} {one:12,d} {max(per_rank):13,d} {max(per_rank) / one:7.3f}")


if __name__ == "__main__":
    main()
