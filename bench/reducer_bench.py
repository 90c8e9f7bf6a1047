"""ZeRO-2's gradient reduction by `MeanReducer` (float32 reduce-scatter) and by `Int8Reducer`
(int8 codes, one scale per block: ZeRO++'s qgZ), in the same run: bytes on the wire per step,
and the loss curves of the same training.

The model is a small causal transformer language model (2 layers, width 128, 4 heads) trained
with AdamW on a synthetic corpus with structure to learn (each sequence a noisy repetition of a
random motif), 2 gloo ranks, each on its own batches, both runs from the same initial params and
data. Reported: each step's loss (rank 0's batch), the largest gap between the two curves, the
mean of the last 20 losses, and the gradient bytes each rank sends per step (nccl-tests' bus bytes).

    python bench/reducer_bench.py [--steps 300] [--plot bench/figures/reducer_loss.png]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import zero
from zero.backends import Int8Reducer, MeanReducer, comm
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.tools.launch import run

VOCAB, SEQ, WIDTH = 64, 32, 128


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.blocks(self.embed(tokens) + self.pos[:tokens.shape[1]], mask=mask, is_causal=True))


def batch(step: int, rank: int, size: int = 16) -> torch.Tensor:
    """Sequences that repeat a random motif of 4-8 tokens, with one token in ten replaced at random."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    rows = []
    for _ in range(size):
        motif = torch.randint(0, VOCAB, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g)
        row = motif.repeat(SEQ // len(motif) + 2)[:SEQ + 1]
        noise = torch.rand(SEQ + 1, generator=g) < 0.1
        rows.append(torch.where(noise, torch.randint(0, VOCAB, (SEQ + 1,), generator=g), row))
    return torch.stack(rows)


def train(rank: int, world_size: int, which: str, steps: int) -> dict:
    torch.set_num_threads(1)
    model = TinyLM()
    plan = zero.make_plan(zero.param_metas(model), world_size, "flat")
    reducer = Int8Reducer() if which == "int8" else MeanReducer()
    opt = Zero(model.parameters(), torch.optim.AdamW, plan=plan, reduce_scatter_grads=True, reducer=reducer,
               lr=1e-3, weight_decay=0.01)
    losses, sent = [], 0
    for step in range(steps):
        tokens = batch(step, rank)
        with comm.recording() as made:
            loss = nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        sent = sum(c.bus_bytes for c in made if c.kind in ("reduce_scatter_sum", "all_to_all"))
    return {"losses": losses, "grad_bytes_sent": sent, "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--plot", help="draw both loss curves to this PNG")
    args = ap.parse_args()
    out = {which: run(train, 2, which, args.steps, timeout=3600)[0] for which in ("fp32", "int8")}
    fp32, int8 = out["fp32"]["losses"], out["int8"]["losses"]
    gap = max(abs(a - b) for a, b in zip(fp32, int8))
    tail = lambda xs: sum(xs[-20:]) / 20  # noqa: E731
    print(f"params {out['fp32']['params']:,}, 2 ranks, {args.steps} steps")
    for which in ("fp32", "int8"):
        r = out[which]
        print(f"{which}: first loss {r['losses'][0]:.4f}, mean of the last 20 {tail(r['losses']):.4f}, "
              f"gradient bytes each rank sends per step {r['grad_bytes_sent']:,}")
    at = max(range(len(fp32)), key=lambda k: abs(fp32[k] - int8[k]))
    print(f"int8 / fp32 bytes: {out['int8']['grad_bytes_sent'] / out['fp32']['grad_bytes_sent']:.3f}; "
          f"largest gap between the curves {gap:.4f} (at step {at}); last-20 mean gap {tail(int8) - tail(fp32):+.4f}")
    if args.plot:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(fp32, label="MeanReducer (float32 reduce-scatter)")
        ax.plot(int8, label="Int8Reducer (int8 codes, a scale per 256)", alpha=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (rank 0's batch)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
