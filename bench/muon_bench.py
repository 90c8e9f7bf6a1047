"""Muon's optimizer step on gloo ranks: each matrix orthogonalised once in the group (zero's ZeRO
with a plan balanced by Newton-Schulz flops) against every rank orthogonalising every matrix.

The model is GPT-style: ``--layers`` blocks of attention (qkv, proj) and MLP (fc, proj) matrices
of width ``--width``, with layer norms and biases, and token and position embeddings. Muon
steps the blocks' matrices; AdamW the embeddings, norms and biases (as torch's Muon docs and
Moonlight route them). Rows, each timed on every rank and reported for the slowest:

- zero's ZeroRedundancyOptimizer, ``contrib.muon``, plan ``balanced`` by ``step_flops``;
- the same with a plan balanced by elements (``sorted_greedy``, ``numel``: torch's rule);
- a hybrid plan: the Muon matrices whole (balanced by flops), the rest flat-sharded
  (``make_plan(..., "flat", whole=...)``);
- every rank runs ``contrib.muon`` on all params (Moonlight's distributed Muon orthogonalises
  each gathered matrix on every rank; this row is that work without its gathers, so it flatters
  the reference);
- every rank runs ``torch.optim.Muon`` on the matrices and ``AdamW`` on the rest (DDP's way).

Gradients are random (the step alone is timed); each rank runs with one intra-op thread.
Usage: python bench/muon_bench.py [--ranks 2 4] [--repeat 5] [--width 256] [--layers 12] [--no-torch]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import zero  # noqa: E402
import zero.functional as F  # noqa: E402
from zero.plans.costs import cost_of  # noqa: E402

MUON = cost_of("muon")
FLOPS_KEYS = ("flops", "numel flops", "hybrid flops")  # each plan's flops per rank, beside the timings


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (this benchmark times the step alone; fsdp2_bench runs it)
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.softmax(q @ k.mT / q.shape[-1] ** 0.5, dim=-1) @ v)
        return x + self.fc_proj(torch.nn.functional.gelu(self.fc(self.ln_2(x))))


def gpt(layers: int, width: int, vocab: int = 4096, context: int = 512) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.wte, model.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
    model.h = nn.ModuleList([Block(width) for _ in range(layers)])
    model.ln_f = nn.LayerNorm(width)
    return model


def is_muons(name: str, shape) -> bool:
    """The blocks' matrices: not the embeddings, norms or biases."""
    return len(shape) == 2 and name.startswith("h.")


def muon_tx() -> F.GradientTransformation:
    def dims(tree):  # torch's Linear weights are (out, in)
        return {n: F.contrib.MuonDimensionNumbers(1, 0) if is_muons(n, p.shape) else None for n, p in tree.items()}
    return F.contrib.muon(0.02, weight_decay=0.01, adam_learning_rate=3e-4, muon_weight_dimension_numbers=dims)


def muon_flops(meta: zero.ParamMeta) -> int:
    """Muon's cost model for this routing: its matrices by Newton-Schulz matmuls, the rest by elements."""
    return MUON.step_flops(meta) if is_muons(meta.name, meta.shape) else meta.numel


def with_grads(model: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    return model


def median_ms(step, repeat: int) -> float:
    import torch.distributed as dist

    step()  # warm-up: state allocation
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def zero_step(model: nn.Module, weight) -> tuple:
    from zero.backends import ZeroRedundancyOptimizer

    metas = zero.param_metas(model)
    world = torch.distributed.get_world_size()
    if weight == "hybrid":  # loads: the whole matrices' flops plus each rank's flat elements
        plan = zero.make_plan(metas, world, "flat", muon_flops, "muon", whole=lambda m: is_muons(m.name, m.shape))
        flops = [r.load for r in plan.ranks]
    else:
        plan = zero.make_plan(metas, world, "balanced" if weight == "flops" else "sorted_greedy",
                              muon_flops if weight == "flops" else "numel", "muon")
        flops = [sum(muon_flops(metas[i]) for i in plan.partition.params_of(r)) for r in range(world)]
    opt = ZeroRedundancyOptimizer(model.named_parameters(), muon_tx(), plan=plan)
    return opt.step, flops


def torch_step(model: nn.Module):
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_muons(n, p.shape)], lr=0.02, weight_decay=0.01)
    adamw = torch.optim.AdamW([p for n, p in named if not is_muons(n, p.shape)], lr=3e-4, weight_decay=0.0)

    def step():
        muon.step()
        adamw.step()
    return step


def worker(rank: int, world_size: int, layers: int, width: int, repeat: int, with_torch: bool) -> dict:
    torch.set_num_threads(1)
    out = {}
    step, out["flops"] = zero_step(with_grads(gpt(layers, width)), "flops")
    out["zero ZeRO, plan balanced by Newton-Schulz flops"] = median_ms(step, repeat)
    step, out["numel flops"] = zero_step(with_grads(gpt(layers, width)), "numel")
    out["zero ZeRO, plan balanced by elements (torch's rule)"] = median_ms(step, repeat)
    step, out["hybrid flops"] = zero_step(with_grads(gpt(layers, width)), "hybrid")
    out["zero ZeRO, hybrid plan (matrices whole by flops, the rest flat)"] = median_ms(step, repeat)
    every = F.Optimizer(with_grads(gpt(layers, width)).named_parameters(), muon_tx())
    out["every rank: contrib.muon on every matrix (Moonlight's NS work)"] = median_ms(every.step, repeat)
    if with_torch:  # bfloat16 Newton-Schulz on every device: on CPU 15-30x our float32 time
        out["every rank: torch.optim.Muon + AdamW (DDP)"] = median_ms(torch_step(with_grads(gpt(layers, width))),
                                                                      repeat)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--no-torch", action="store_true", help="leave out torch.optim.Muon (minutes on CPU)")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from zero.tools.launch import run

    n = sum(p.numel() for p in gpt(args.layers, args.width).parameters())
    table = Table(title=f"Muon step, GPT-style {args.layers} layers x width {args.width} ({n / 1e6:.1f}M params), "
                        "ms for the slowest rank")
    for column in ("ranks", "system", "ms", "vs every rank (zero's Muon)", "busiest / mean flops"):
        table.add_column(column, justify="left" if column in ("system",) else "right")
    for world_size in args.ranks:
        ranks = run(worker, world_size, args.layers, args.width, args.repeat, not args.no_torch, timeout=1800)
        slowest = {k: max(r[k] for r in ranks) for k in ranks[0] if k not in FLOPS_KEYS}
        ref = slowest["every rank: contrib.muon on every matrix (Moonlight's NS work)"]
        for system, ms in slowest.items():
            key = ("flops" if "Newton-Schulz" in system else "numel flops" if "elements" in system
                   else "hybrid flops" if "hybrid" in system else None)
            balance = f"{max(ranks[0][key]) / statistics.mean(ranks[0][key]):.3f}" if key else ""
            table.add_row(str(world_size), system, f"{ms:.1f}", f"{ms / ref:.2f}x", balance)
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
