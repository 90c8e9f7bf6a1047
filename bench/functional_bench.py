"""Optimizer step speed: zero.functional vs torch.optim, side by side in one run.

20M float32 elements in 200 tensors (uneven sizes). Reports ns/element, the implied memory
traffic (Adam reads p, g, m, v and writes p, m, v: 28 bytes/element; SGD with momentum reads
p, g, b and writes p, b: 20) against a measured copy bandwidth, and each path's time relative
to torch's fused kernel and to its foreach implementation.
Usage: python bench/functional_bench.py [--rule adam|sgd|adamw|adagrad] [--elements 20e6]
[--tensors 200] [--repeat 15]; ``--table`` times every rule on two shapes, every path, in one run;
``--scheduler`` times Adam with and without an lr that changes every step; ``--python`` times the
fused path on 200 tensors of 2M elements in all, where its per-step Python shows beside the kernel.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import zero.functional as F  # noqa: E402

# rule -> (torch class, its options, the zero.functional alias, bytes moved per element)
RULES = {
    "adam": (torch.optim.Adam, {"lr": 1e-3}, lambda: F.adam(1e-3), 28),
    "sgd": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}, lambda: F.sgd(1e-3, momentum=0.9), 20),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}, lambda: F.adamw(1e-3), 28),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}, lambda: F.adagrad(1e-2), 20),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-2}, lambda: F.rmsprop(1e-2), 20),
    # torch's NAdam (momentum decay) and RAdam beside Optax's nadam and radam: the same families,
    # not the same formulas, so their pure rows compare rules of like cost, not one rule
    "nadam": (torch.optim.NAdam, {"lr": 1e-3}, lambda: F.nadam(1e-3), 28),
    "radam": (torch.optim.RAdam, {"lr": 1e-3}, lambda: F.radam(1e-3), 28),
    "adamax": (torch.optim.Adamax, {"lr": 1e-3}, lambda: F.adamax(1e-3), 28),
    # torch keeps the maximum of the raw second moment, Optax of the debiased one
    "amsgrad": (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True}, lambda: F.amsgrad(1e-3), 36),
}
FUSED = {"adam", "sgd", "adamw", "adagrad", "amsgrad"}  # torch has a fused kernel (CPU and CUDA) for these
SHAPES = {"200 uneven tensors, 20M elements": (20e6, 200), "2,000 small tensors, 2M elements": (2e6, 2000)}


def make_params(elements: int, tensors: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(tensors, generator=gen) + 0.5
    sizes = (weights / weights.sum() * elements).long().clamp(min=1)
    return [torch.randn(int(n), generator=gen) for n in sizes]


def timeit(fn, repeat: int) -> float:
    fn()  # warm-up: state allocation, first-touch page faults
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(steps: dict, repeat: int) -> dict:
    """Median seconds per step of each path, the paths taking turns step by step (as
    bench/zero_bench.py does), so that the machine's drift hits every path alike, in an order
    shuffled each round (seeded): a step runs slower or faster by which path touched memory just
    before it (BENCHMARKS, "eighth session")."""
    for step in steps.values():
        step()  # warm-up: state allocation, first-touch page faults
    times = {path: [] for path in steps}
    order, rng = list(steps.items()), random.Random(0)
    for _ in range(repeat):
        rng.shuffle(order)
        for path, step in order:
            t0 = time.perf_counter()
            step()
            times[path].append(time.perf_counter() - t0)
    return {path: statistics.median(ts) for path, ts in times.items()}


def torch_step(params, grads, cls, **kw):
    ps = [p.clone().requires_grad_() for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    opt = cls(ps, **kw)
    return opt.step


def ours_step(params, grads, tx):
    ps = [p.clone().requires_grad_() for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    return F.Optimizer(ps, tx).step


def pure_step(params, grads, tx):
    box = {"params": [p.clone() for p in params]}
    box["state"] = tx.init(box["params"])

    def step():
        updates, box["state"] = tx.update(grads, box["state"], box["params"])
        box["params"] = F.apply_updates(box["params"], updates)

    return step


def table_paths(rule: str, params, grads) -> dict:
    """The paths of the --table run, as makers of step functions."""
    cls, options, alias, _ = RULES[rule]
    name = cls.__name__
    paths = {f"torch {name}()": lambda: torch_step(params, grads, cls, foreach=False, **options),
             f"torch {name}(foreach=True)": lambda: torch_step(params, grads, cls, foreach=True, **options)}
    if rule in FUSED:
        paths[f"torch {name}(fused=True)"] = lambda: torch_step(params, grads, cls, fused=True, **options)
    paths[f"zero from_torch({name})"] = lambda: ours_step(params, grads, F.from_torch(cls, **options))
    paths[f"zero {rule} (Optax's)"] = lambda: ours_step(params, grads, alias())
    paths[f"zero {rule}: pure update"] = lambda: pure_step(params, grads, alias())
    return paths


def run_table(repeat: int) -> None:
    """Every rule x both shapes x every path: ms/step, ns/element, and ratios to torch's fastest."""
    table = Table(title=f"optimizer step, float32 on CPU, {torch.get_num_threads()} threads; medians of {repeat}")
    for col in ("rule", "model", "path", "ms/step", "ns/elem", "x torch's fastest", "x torch foreach",
                "x copy limit"):
        table.add_column(col, justify="right")
    for shape, (elements, tensors) in SHAPES.items():
        params = make_params(int(elements), tensors)
        grads = [torch.randn_like(p) for p in params]
        n = sum(p.numel() for p in params)
        src, dst = torch.randn(n), torch.empty(n)
        copy_s = timeit(lambda dst=dst, src=src: dst.copy_(src), repeat)  # 8 bytes/element: the physical limit
        for rule in RULES:
            moved = RULES[rule][3]
            results = interleaved({path: make() for path, make in table_paths(rule, params, grads).items()}, repeat)
            torch_times = {p: t for p, t in results.items() if p.startswith("torch")}
            fastest = min(torch_times.values())
            foreach = next(t for p, t in torch_times.items() if "foreach" in p)
            for path, t in results.items():
                table.add_row(rule, shape, path, f"{t * 1e3:.2f}", f"{t / n * 1e9:.2f}", f"{t / fastest:.2f}",
                              f"{t / foreach:.2f}", f"{t / (copy_s * moved / 8):.2f}")
            Console().print(f"{shape}: {rule} done", style="dim")
    Console(width=200).print(table)


def scheduled_step(params, grads, make_optimizer, scheduled: bool):
    """A step of ``make_optimizer(params)``, with a ``LambdaLR`` moving the lr after every step."""
    ps = [p.clone().requires_grad_() for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    opt = make_optimizer(ps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (1 + k)) if scheduled else None

    def step():
        opt.step()
        if scheduler is not None:
            scheduler.step()

    return step


def run_scheduler(repeat: int) -> None:
    """Adam on 2,000 small tensors, with and without an lr that changes every step."""
    params = make_params(int(2e6), 2000)
    grads = [torch.randn_like(p) for p in params]
    makers = {"torch Adam(fused=True)": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
              "zero Optimizer(from_torch(Adam))": lambda ps: F.Optimizer(ps, F.from_torch(torch.optim.Adam, lr=1e-3))}
    steps = {f"{name}{', LambdaLR' if on else ''}": scheduled_step(params, grads, make, on)
             for name, make in makers.items() for on in (False, True)}
    for path, t in interleaved(steps, repeat).items():
        Console().print(f"{path}: {t * 1e3:.2f} ms/step")


def run_schedule(repeat: int, elements: int) -> None:
    """``Optimizer(adamw(...))`` on 200 float32 tensors: a constant learning rate, Optax's schedule
    (evaluated each step) and a ``LambdaLR`` moving the group's lr, interleaved (issue #52's rows)."""
    params = make_params(elements, 200)
    grads = [torch.randn_like(p) for p in params]
    schedule = F.warmup_cosine_decay_schedule(1e-4, 1e-3, 10, 10_000)
    makers = {"constant": lambda ps: F.Optimizer(ps, F.adamw(1e-3, weight_decay=0.1)),
              "schedule": lambda ps: F.Optimizer(ps, F.adamw(schedule, weight_decay=0.1))}
    steps = {"adamw(1e-3)": scheduled_step(params, grads, makers["constant"], False),
             "adamw(warmup_cosine_decay_schedule)": scheduled_step(params, grads, makers["schedule"], False),
             "adamw(1e-3), LambdaLR": scheduled_step(params, grads, makers["constant"], True)}
    results = interleaved(steps, repeat)
    constant = results["adamw(1e-3)"]
    for path, t in results.items():
        Console().print(f"{path}: {t * 1e3:.3f} ms/step, {t / constant:.2f}x the constant one")


def run_python(repeat: int) -> None:
    """SGD (momentum 0 and 0.9) and Adam on 200 float32 tensors, 2M elements: the kernel is short
    here, so what a step adds around it in Python shows (issue #39's row). Each zero path is given
    against the faster of torch's fused and foreach steps (issue #68: "torch's fastest")."""
    params = make_params(int(2e6), 200)
    grads = [torch.randn_like(p) for p in params]
    steps, rows = {}, []
    cases = (("SGD", "sgd", {"lr": 1e-2}), ("SGD momentum 0.9", "sgd", {"lr": 1e-2, "momentum": 0.9}),
             ("Adam", "adam", {"lr": 1e-3}))
    for label, rule, options in cases:
        cls = RULES[rule][0]
        optax_rule = F.adam(options["lr"]) if rule == "adam" else F.sgd(options["lr"], momentum=options.get("momentum"))
        theirs = [(label, f"torch {cls.__name__}(fused=True)"), (label, f"torch {cls.__name__}(foreach=True)")]
        steps[theirs[0]] = torch_step(params, grads, cls, fused=True, **options)
        steps[theirs[1]] = torch_step(params, grads, cls, foreach=True, **options)
        steps[(label, f"zero Optimizer(from_torch({cls.__name__}))")] = ours_step(params, grads,
                                                                                F.from_torch(cls, **options))
        steps[(label, f"zero Optimizer({rule}) (Optax's)")] = ours_step(params, grads, optax_rule)
        rows.append((label, theirs))
    results = interleaved(steps, repeat)
    for label, theirs in rows:
        best = min(results[key] for key in theirs)
        for (row, path), t in results.items():
            if row == label:
                Console().print(f"{label}: {path}: {t * 1e3:.3f} ms/step, {t / best:.2f}x torch's fastest")


def run_fixed(repeat: int) -> None:
    """A step's fixed cost: SGD (momentum 0.9) and AdamW on 2 and 20 tensors of 64 elements, where
    the kernel is negligible and caches stay warm; best of ``repeat`` rounds of 500 steps, zero's
    ``from_torch`` against torch's fused class. Each also with ``lr`` set anew before every step
    (a scheduler's new float), which a step must read."""
    for label, cls, options in (("SGD momentum 0.9", torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
                                ("AdamW", torch.optim.AdamW, {"lr": 1e-3})):
        for n, moved in ((2, False), (20, False), (2, True)):
            params = [torch.randn(64) for _ in range(n)]
            grads = [torch.randn(64) for _ in range(n)]
            steps = {"zero": ours_step(params, grads, F.from_torch(cls, **options)),
                     "torch": torch_step(params, grads, cls, fused=True, **options)}
            rates = [options["lr"] * (1 + 1e-4 * k) for k in range(500)] if moved else []
            best = {path: _best_round(step, rates, repeat) for path, step in steps.items()}
            what = f"{n} tensors" + (", lr anew each step" if moved else "")
            Console().print(f"{label}, {what}: zero {best['zero'] * 1e6:.1f} us, torch's fused "
                            f"{best['torch'] * 1e6:.1f} us, {best['zero'] / best['torch']:.2f}x")


def _best_round(step, rates: list[float], repeat: int) -> float:
    """The best of ``repeat`` rounds of 500 steps, in seconds a step; with ``rates``, each step's
    group ``lr`` first set to the next of them (``step`` is a bound ``Optimizer.step``)."""
    group = step.__self__.param_groups[0]
    step()
    rounds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for k in range(500):
            if rates:
                group["lr"] = rates[k]
            step()
        rounds.append((time.perf_counter() - t0) / 500)
    return min(rounds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rule", choices=sorted(FUSED), default="adam")
    ap.add_argument("--elements", type=float, default=20e6)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--plot", help="also draw the ms/step of each path to this PNG")
    ap.add_argument("--table", action="store_true",
                    help="every rule x {200 uneven tensors, 2,000 small ones} x every path (issue #15's table)")
    ap.add_argument("--scheduler", action="store_true",
                    help="Adam on 2,000 small tensors with and without an lr scheduler stepping every step")
    ap.add_argument("--schedule", action="store_true",
                    help="AdamW on 200 tensors (--elements in all): constant, scheduled, LambdaLR")
    ap.add_argument("--fixed", action="store_true",
                    help="a step's fixed cost: SGD and AdamW on 2 and 20 tiny tensors, caches warm")
    ap.add_argument("--python", action="store_true",
                    help="SGD and Adam on 200 tensors, 2M elements: the fused path's per-step Python")
    args = ap.parse_args()
    if args.python:
        run_python(args.repeat)
        return
    if args.fixed:
        run_fixed(args.repeat)
        return
    if args.schedule:
        run_schedule(args.repeat, int(args.elements))
        return
    if args.scheduler:
        run_scheduler(args.repeat)
        return
    if args.table:
        run_table(args.repeat)
        return
    n = int(args.elements)
    params = make_params(n, args.tensors)
    grads = [torch.randn_like(p) for p in params]
    n = sum(p.numel() for p in params)
    src, dst = torch.randn(n), torch.empty(n)
    copy_s = timeit(lambda: dst.copy_(src), args.repeat)
    copy_gbs = 8 * n / copy_s / 1e9  # a copy reads and writes 4 bytes per element
    cls, options, alias, moved = RULES[args.rule]
    name = cls.__name__
    paths = {
        f"torch {name}(fused=True)": torch_step(params, grads, cls, fused=True, **options),
        f"torch {name}(foreach=True)": torch_step(params, grads, cls, foreach=True, **options),
        f"zero Optimizer({args.rule})": ours_step(params, grads, alias()),
        f"zero Optimizer(from_torch({name}))": ours_step(params, grads, F.from_torch(cls, **options)),
        "zero pure update + apply_updates": pure_step(params, grads, alias()),
    }
    results = {path: timeit(fn, args.repeat) for path, fn in paths.items()}
    base = results[f"torch {name}(fused=True)"]
    foreach = results[f"torch {name}(foreach=True)"]
    table = Table(title=f"{name}({options}) step on {n / 1e6:.1f}M float32 elements in {len(params)} tensors, "
                        f"{torch.get_num_threads()} threads; copy bandwidth {copy_gbs:.1f} GB/s")
    for col in ("path", "ms/step", "ns/element", f"GB/s ({moved} B/elem)", "x fused", "x foreach"):
        table.add_column(col, justify="right")
    for path, s in results.items():
        table.add_row(path, f"{s * 1e3:.1f}", f"{s / n * 1e9:.3f}", f"{moved * n / s / 1e9:.1f}",
                      f"{s / base:.2f}", f"{s / foreach:.2f}")
    Console(width=160).print(table)
    if args.plot:
        from figure import grouped_bars

        grouped_bars(args.plot, f"{name} step, {n / 1e6:.0f}M float32 elements in {len(params)} tensors (CPU)",
                     {"ms/step": {name: s * 1e3 for name, s in results.items()}}, "ms per step (lower is better)")


if __name__ == "__main__":
    main()
