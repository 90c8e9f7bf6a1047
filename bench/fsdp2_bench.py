"""zero's rules over FSDP2's params: whole iterations of a GPT-style model (~10M params) under
``fully_shard`` on gloo ranks, each row against its reference in the same run.

- AdamW: ``zero.functional.Optimizer(model.parameters(), F.adamw(...))`` against
  ``torch.optim.AdamW(foreach=True)`` on the same model (forward, backward, step, zero_grad).
- Muon (``contrib.muon``, matrices by Newton-Schulz, the rest by AdamW): each matrix stepped once
  by its owner (zero's FSDP2 plan, one exchange per direction per dtype) against every rank
  gathering every param and gradient (``full_tensor()``) and stepping them all whole, as a rule that
  needs whole matrices does when nothing owns them: time, optimizer state per rank, bytes sent.
- 8-bit AdamW: ``contrib.adamw_8bit`` against torchao's ``AdamW8bit`` (when installed): time,
  state per rank, and whether the params after 5 steps are the same bits at 1 and 2 ranks.

"step MiB sent": what the optimizer's own collectives send per rank (zero's recorder; the
gathering reference's all-gathers counted from its tensors); FSDP2's own traffic is the same in
every row and left out.

Times are medians over ``--repeat`` iterations, the slowest rank's, each system taking turns with its
reference (forward and backward dominate an iteration on CPU); one intra-op thread per rank.
Usage: python bench/fsdp2_bench.py [--ranks 2] [--repeat 5] [--width 256] [--layers 12] [--step-only]
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
from muon_bench import Block  # noqa: E402  (the same GPT block, here with its forward run)
from torch import nn  # noqa: E402

import zero.functional as F  # noqa: E402


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, vocab: int = 4096, context: int = 128):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.h = nn.ModuleList([Block(width) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.mT


def sharded(layers: int, width: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = GPT(layers, width)
    for block in model.h:
        fully_shard(block)
    return fully_shard(model)


def muon_tx() -> F.GradientTransformation:
    def dims(tree):  # the blocks' matrices by Newton-Schulz ((out, in) Linear weights), the rest by AdamW
        return {n: F.contrib.MuonDimensionNumbers(1, 0) if p.ndim == 2 and n.startswith("h.") else None
                for n, p in tree.items()}
    return F.contrib.muon(0.02, weight_decay=0.01, adam_learning_rate=3e-4, muon_weight_dimension_numbers=dims)


class GatherEverything(torch.optim.Optimizer):
    """Every rank gathers every param and gradient whole and steps them all with ``tx``, keeping
    its own rows: what a rule that needs whole matrices costs when no rank owns them."""

    def __init__(self, model: nn.Module, tx: F.GradientTransformation):
        self.named = list(model.named_parameters())
        self.whole = [(n, p.detach().full_tensor()) for n, p in self.named]
        super().__init__([p for _, p in self.named], {})
        self.inner = F.Optimizer(self.whole, tx)

    @torch.no_grad()
    def step(self):
        for (_, p), (_, w) in zip(self.named, self.whole):
            w.copy_(p.full_tensor())
            w.grad = p.grad.full_tensor()
        self.inner.step()
        for (_, p), (_, w) in zip(self.named, self.whole):
            p.to_local().copy_(w.narrow(0, *_rows(p)))


def _rows(p) -> tuple[int, int]:
    from zero.plans.fsdp2 import chunk_rows

    return chunk_rows(p.shape[0], p.device_mesh.size())[p.device_mesh.get_local_rank()]


def state_bytes(opt) -> int:
    """Bytes of optimizer state on this rank (a zero.functional.Optimizer's states, or a torch optimizer's)."""
    inner = getattr(opt, "inner", opt)
    if isinstance(inner, F.Optimizer):
        tensors = [x for k in range(len(inner.param_groups)) for st in inner.set_states(k).values()
                   for x in torch.utils._pytree.tree_leaves(st)]
    else:
        tensors = [x for st in inner.state.values() for x in st.values()]
    return sum(_nbytes(x.to_local() if hasattr(x, "to_local") else x) for x in tensors
               if isinstance(x, torch.Tensor) and x.dim())


def _nbytes(x: torch.Tensor) -> int:
    """Bytes a state tensor holds: a torchao quantized state's codes and scales (its ``nbytes`` is
    the full-precision tensor it stands for)."""
    if hasattr(x, "codes"):
        return x.codes.nbytes + x.scale.nbytes
    return x.nbytes


def iterations_ms(pair: list, repeat: int, batch: int = 8, context: int = 128,
                  step_only: bool = False) -> list[tuple[float, int]]:
    """Per (model, optimizer) of ``pair``, taking turns: the median ms of forward, backward, step
    and zero_grad (``step_only``: of the step alone, the first backward's gradients taken again
    each time), and the bytes zero's collectives sent in one iteration."""
    import torch.distributed as dist

    from zero.backends import comm

    gen = torch.Generator().manual_seed(dist.get_rank())
    idx = torch.randint(0, 4096, (batch, context), generator=gen)

    def once(model, opt):
        if step_only:
            return opt.step()
        model(idx).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()

    times, sent = [[] for _ in pair], [0] * len(pair)
    for model, opt in pair:
        if step_only:
            model(idx).logsumexp(-1).mean().backward()
        once(model, opt)  # warm-up: state, the plan
    for _ in range(repeat):
        for k, (model, opt) in enumerate(pair):
            dist.barrier()
            t0 = time.perf_counter()
            with comm.recording() as made:
                once(model, opt)
            times[k].append(time.perf_counter() - t0)
            sent[k] = sum(c.bus_bytes for c in made)
    return [(statistics.median(t) * 1e3, b) for t, b in zip(times, sent)]


def gathered_bytes(model: nn.Module) -> int:
    """Bytes a rank receives gathering every param and gradient whole ((W - 1) / W of each, twice)."""
    w = torch.distributed.get_world_size()
    return sum(2 * p.numel() * p.element_size() * (w - 1) // w for p in model.parameters())


PAIRS = {  # each system beside its reference, taking turns
    "AdamW": ({"torch.optim.AdamW(foreach=True)": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4,
                                                                              weight_decay=0.01, foreach=True),
               "zero.functional.Optimizer(F.adamw)": lambda m: F.Optimizer(m.parameters(),
                                                                          F.adamw(3e-4, weight_decay=0.01))}),
    "Muon": ({"every rank gathers every matrix": lambda m: GatherEverything(m, muon_tx()),
              "each matrix by its owner (zero)": lambda m: F.Optimizer(m.named_parameters(), muon_tx())}),
    "8-bit AdamW": ({"torchao AdamW8bit": lambda m: _torchao(m),
                     "zero contrib.adamw_8bit": lambda m: F.Optimizer(m.parameters(),
                                                                     F.contrib.adamw_8bit(3e-4, weight_decay=0.01))}),
}


def worker(rank: int, world_size: int, layers: int, width: int, repeat: int, step_only: bool = False) -> dict:
    rows = {}
    for kind, systems in PAIRS.items():
        pair, names = [], [f"{kind}: {name}" for name in systems]
        try:
            for make in systems.values():
                model = sharded(layers, width)
                pair.append((model, make(model)))
            timed = iterations_ms(pair, repeat, step_only=step_only)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run on FSDP2's params: say why
            rows.update({n: (float("nan"), 0, 0, f"{type(e).__name__}: {str(e)[:80]}") for n in names})
            continue
        for name, (model, opt), (ms, sent) in zip(names, pair, timed):
            if "gathers every" in name:
                sent = gathered_bytes(model)
            rows[name] = (ms, state_bytes(opt), sent, "")
    return rows


def _torchao(model: nn.Module):
    from torchao.optim import AdamW8bit

    return AdamW8bit(model.parameters(), lr=3e-4, weight_decay=0.01)


def low_bit_params(rank: int, world_size: int, layers: int, width: int, which: str) -> list[torch.Tensor]:
    """The params after 5 steps of an 8-bit AdamW on fixed gradients, on ``world_size`` ranks."""
    model = sharded(layers, width) if world_size > 1 else GPT(layers, width)
    opt = F.Optimizer(model.parameters(), F.contrib.adamw_8bit(3e-4)) if which == "zero" else _torchao(model)
    for k in range(5):
        gen = torch.Generator().manual_seed(k)
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen)
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor
                g = distribute_tensor(g, p.device_mesh, p.placements)
            p.grad = g
        opt.step()
    return [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]


def same_bits(layers: int, width: int, which: str) -> str:
    from zero.tools.launch import run

    try:
        one = run(low_bit_params, 1, layers, width, which, timeout=1800)[0]
        two = run(low_bit_params, 2, layers, width, which, timeout=1800)[0]
    except Exception as e:  # noqa: BLE001
        return f"cannot run: {str(e).splitlines()[-1][:60]}"
    differ = sum(not torch.equal(a, b) for a, b in zip(one, two))
    return "same bits" if not differ else f"{differ} of {len(one)} params differ"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--step-only", action="store_true", help="time the optimizer's step alone (fixed gradients)")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from zero.tools.launch import run

    n = sum(p.numel() for p in GPT(args.layers, args.width).parameters())
    ranks = run(worker, args.ranks, args.layers, args.width, args.repeat, args.step_only, timeout=3000)
    what = "the optimizer's step alone" if args.step_only else "one iteration"
    table = Table(title=f"FSDP2 at {args.ranks} gloo ranks, GPT-style {args.layers} x {args.width} "
                        f"({n / 1e6:.1f}M params): {what}, the slowest rank")
    for column in ("system", "ms", "vs reference", "state MiB / rank", "step MiB sent / rank", "note"):
        table.add_column(column, justify="left" if column in ("system", "note") else "right")
    refs = {kind: f"{kind}: {next(iter(systems))}" for kind, systems in PAIRS.items()}
    for name in ranks[0]:
        ms = max(r[name][0] for r in ranks)
        ref = max(r[refs[name.split(":")[0]]][0] for r in ranks)
        state, sent = max(r[name][1] for r in ranks), max(r[name][2] for r in ranks)
        note = ranks[0][name][3]
        if name.startswith("8-bit"):
            note = note or same_bits(args.layers, args.width, "zero" if "zero" in name else "torchao") + \
                " at 1 and 2 ranks"
        table.add_row(name, f"{ms:.1f}", f"{ms / ref:.2f}x", f"{state / 2**20:.2f}", f"{sent / 2**20:.2f}", note)
    Console(width=180).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
