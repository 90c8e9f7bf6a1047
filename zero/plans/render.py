"""Rich tables for plans (rich is imported only when something is printed)."""

from __future__ import annotations

from collections.abc import Sequence

from zero.plans.footprint import footprint
from zero.plans.mesh_padding import mesh_state_bytes

__all__ = ["plan_table", "compare_table", "diff_table", "render", "mib"]


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def strategy(plan) -> str:
    """The plan's strategy, with a hybrid's whole params counted, the quantization blocks its
    flat buffers are cut at (a low-bit optimizer's) and the params cut at head edges."""
    name = f"{plan.strategy} + {len(plan.whole)} whole" if plan.hybrid else plan.strategy
    blocks = sorted({b.block for b in plan.flat.buffers if b.block}) if plan.flat is not None else []
    if blocks:
        cut = sum(len(b.params) for b in plan.flat.buffers if b.block)
        name += f" ({cut} params cut at blocks of {', '.join(map(str, blocks))})"
    if plan.split_heads:
        name += f" ({len(plan.cut_at_heads)} params cut at head edges)"
    return name


def plan_table(plan, max_rows: int = 16):
    """Per rank, in MiB: what it holds (masters, optimizer state; in all under ZeRO-1 and ZeRO-2),
    its flat shards' padding, and what it sends per step (the params' sync as the executor runs
    it, as nccl-tests count bytes: `zero.plans.accounting.bus_bytes`)."""
    from rich.table import Table

    masters = f", {plan.master_dtype} masters" if plan.master_dtype else ""
    title = (f"{strategy(plan)} on {plan.world_size} ranks, weight={plan.weight}, optimizer={plan.optimizer}"
             f"{masters}; MiB per rank\nbusiest rank / mean {plan.max_over_mean:.4f}, / best possible "
             f"{plan.max_over_bound:.4f}, fingerprint {plan.fingerprint}")
    # as wide as the title's longest line, so that a narrow table never breaks a figure from its label
    t = Table(title=title, min_width=max(map(len, title.splitlines())))
    for col in ("rank", "params", "load", "masters", "state", "ZeRO-1", "ZeRO-2", "padding", "sent"):
        t.add_column(col, justify="right")
    ranks = plan.ranks
    shown = ranks if len(ranks) <= max_rows else ranks[: max_rows // 2] + (None,) + ranks[-(max_rows // 2):]
    for r in shown:
        if r is None:
            t.add_row(*["..."] * 9)
            continue
        t.add_row(str(r.rank), str(r.params), f"{r.load:,}", mib(r.master_bytes), mib(r.state_bytes),
                  mib(r.total_bytes), mib(r.total_bytes_grads_sharded), mib(r.padding_bytes),
                  mib(footprint(plan, r.rank).collective_bytes))
    t.caption = ("ZeRO-1 / ZeRO-2: params, gradients (whole / sharded), masters and state; sent: the params' sync "
                 "in a step, bytes each rank sends (nccl-tests' count; DDP's all-reduce not included). Busiest "
                 "rank: " + ", ".join(f"{name} {mib(n)}" for name, n in plan.stage_bytes().items()))
    # a mesh shards evenly: every device holds the busiest rank's rows (a plan cutting heads it does not run)
    if (plan.flat is None or plan.hybrid) and not plan.split_heads:
        t.caption += (f"; on a JAX mesh (zero.backends.jax_mesh) every device holds "
                      f"{mib(mesh_state_bytes(plan)[0])} of optimizer state, rows padded to the busiest rank's")
    return t


def compare_table(plans: Sequence):
    """One row per plan: the figures that tell strategies apart (MiB; sent: as `plan_table`)."""
    from rich.table import Table

    first = plans[0]
    t = Table(title=f"{len(first.metas)} tensors on {first.world_size} ranks, optimizer={first.optimizer}; MiB per "
                    "rank")
    for col in ("strategy", "weight", "max/mean", "max/best", "max state", "max sent", "fingerprint"):
        t.add_column(col, justify="right", no_wrap=True)
    for p in plans:
        sent = max(footprint(p, r).collective_bytes for r in {0, p.world_size - 1})
        t.add_row(strategy(p), p.weight, f"{p.max_over_mean:.4f}", f"{p.max_over_bound:.4f}",
                  mib(max(r.state_bytes for r in p.ranks)), mib(sent), p.fingerprint[:8])
    t.caption = "sent: the params' sync in a step, bytes each rank sends (nccl-tests' count)"
    return t


def diff_table(diff, max_rows: int = 16):
    """The state each pair of ranks must move, then each rank's change in bytes."""
    from rich.console import Group
    from rich.table import Table

    a, b = diff.a, diff.b
    moves = Table(title=f"{a.strategy}/{a.weight} on {a.world_size} ranks -> {b.strategy}/{b.weight} on "
                        f"{b.world_size}: {len(diff.changed)} of {len(a.metas)} params change placement, "
                        f"{mib(diff.moved_bytes)} MiB of state moves")
    for col in ("from rank (a)", "to rank (b)", "state MiB"):
        moves.add_column(col, justify="right")
    shown = sorted(diff.moves, key=lambda m: -m[2])[:max_rows]
    for src, dst, n in shown:
        moves.add_row(str(src), str(dst), mib(n))
    moves.caption = _cut("transfers (the largest)", len(shown), len(diff.moves),
                         f", {mib(sum(n for _, _, n in shown))} of {mib(diff.moved_bytes)} MiB")
    deltas = Table(title="per-rank change (b - a)")
    for col in ("rank", "state MiB", "total MiB"):
        deltas.add_column(col, justify="right")
    for r, state, total in diff.rank_deltas[:max_rows]:
        deltas.add_row(str(r), mib(state), mib(total))
    deltas.caption = _cut("ranks (the first)", min(max_rows, len(diff.rank_deltas)), len(diff.rank_deltas))
    return Group(moves, deltas)


def _cut(what: str, shown: int, total: int, extra: str = "") -> str | None:
    """A table's caption when it shows only some rows: how many, and how to see them all."""
    if shown == total:
        return None
    return (f"{shown} of {total} {what} shown{extra}; all of them: table(max_rows={total}), "
            f"or zero plan --diff A B --rows {total}")


def render(renderable, width: int = 100) -> str:
    from rich.console import Console

    # force_jupyter=False: in a notebook rich would also display the table as HTML, then the caller prints the text
    console = Console(width=width, record=True, file=_Null(), force_jupyter=False)
    console.print(renderable)
    return console.export_text()


class _Null:
    def write(self, _s):
        return 0

    def flush(self):
        pass
