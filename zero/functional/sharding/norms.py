"""Norms and finiteness over whole tensors and the whole model when a rank steps pieces: one
partial sum per piece and one ``reduce`` (`global_norm`, `total_norm`, `tensor_norms`, `all_finite`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

from zero.functional.foreach import ops, traced
from zero.functional.sharding.context import Pieces, Sharding, sharded

__all__ = ["global_norm", "total_norm", "tensor_norms", "all_finite", "expand", "total_sums", "inner_products"]


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Sums of squares in at least float32 (bf16 sums lose the small terms), in float64 for float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def global_norm(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all leaves together, over every rank's pieces when sharded.

    As unsharded, it is the norm of the tensors' norms, each rounded to its tensor's dtype.
    """
    found = sharded(leaves, "a global norm")
    if found is None:
        if not leaves:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(ops.norm(leaves)))
    sharding, pieces = found
    norms = _whole_norms(sharding, pieces, leaves, ops.norm)
    for dt in set(sharding.dtypes):  # tensors outside this step have norm 0 and add nothing
        at = [t for t, d in enumerate(sharding.dtypes) if d == dt]
        norms[at] = norms[at].to(dt).double()
    total = torch.linalg.vector_norm(norms)
    dtype = functools.reduce(torch.promote_types, [leaf.dtype for leaf in leaves], torch.float32)
    return total.to(dtype)


def total_norm(leaves: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm(leaves, norm_type)``: the ``norm_type``-norm of the whole
    tensors' norms (``inf``: the largest magnitude), over every rank's pieces when sharded.

    Sharded, per-tensor norms and the total are computed in float64 from one ``reduce`` (for
    ``inf`` one ``reduce_max``), so every rank gets the same number, returned in at least float32.
    """
    p = float(norm_type)
    if not p >= 0:
        raise ValueError(f"norm_type={norm_type!r}: a total norm needs a norm_type >= 0 (or inf)")
    found = sharded(leaves, "a total norm")
    if found is None:
        if not leaves:
            return torch.zeros(())
        norms = [torch.linalg.vector_norm(leaf, p) for leaf in leaves]
        return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), p)
    sharding, pieces = found
    if math.isinf(p) and sharding.reduce_max is None:
        raise ValueError("an inf-norm under this sharding needs the ranks' maximum, which its backend does not give")
    partial = torch.zeros(sharding.n_tensors, dtype=torch.float64)
    for leaf, pc in zip(leaves, pieces):
        if pc.tensors:
            x = leaf.reshape(-1)[:pc.used].abs().double()
            x = x if math.isinf(p) else (x != 0).double() if p == 0 else x.pow(p)
            lengths = torch.tensor(pc.lengths, device=leaf.device)
            per = torch.segment_reduce(x, "max" if math.isinf(p) else "sum", lengths=lengths, initial=0)
            at = torch.tensor(pc.tensors)
            if math.isinf(p):
                partial.scatter_reduce_(0, at, per.cpu(), "amax")
            else:
                partial.index_add_(0, at, per.cpu())
    if math.isinf(p):
        total = sharding.reduce_max(partial).max()
    else:
        norms = sharding.reduce(partial) if p == 0 else sharding.reduce(partial).pow(1 / p)
        total = torch.linalg.vector_norm(norms, p)
    return total.to(functools.reduce(torch.promote_types, sharding.dtypes, torch.float32))


def tensor_norms(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per leaf, the L2 norm of the whole tensor it is (a piece of), broadcastable to the leaf.

    Unsharded: one 0-d norm per leaf. Sharded: a 1-D tensor as long as the leaf, each element
    holding its tensor's norm (padding gets 0).
    """
    found = sharded(leaves, "per-tensor norms")
    if found is None or found[0].whole_params:  # whole tensors here: nothing to ask the other ranks
        return [torch.linalg.vector_norm(leaf) for leaf in leaves]
    sharding, pieces = found
    norms = _whole_norms(sharding, pieces, leaves)
    return [expand(norms, pc, leaf) for leaf, pc in zip(leaves, pieces)]


def _whole_norms(sharding: Sharding, pieces: Sequence[Pieces], leaves: Sequence[torch.Tensor],
                 norms_of: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None) -> torch.Tensor:
    """The norm of every whole tensor (float64, CPU), one ``reduce``: per-piece sums of squares;
    under a whole-param plan (every leaf a whole tensor) the leaves' own norms by ``norms_of``,
    the unsharded step's function, so that the plan's step is the unsharded step bit for bit."""
    if sharding.whole_params and norms_of is not None:
        local = torch.zeros(sharding.n_tensors, dtype=torch.float64)
        held = [(leaf, pc.tensors[0]) for leaf, pc in zip(leaves, pieces) if pc.tensors]
        if held:
            norms = norms_of([leaf for leaf, _ in held])
            local[torch.tensor([t for _, t in held])] = torch.stack([n.to("cpu", torch.float64) for n in norms])
        return sharding.reduce(local)  # each tensor's norm from its owner, zeros elsewhere: exact
    sums = torch.zeros(sharding.n_tensors, dtype=torch.float64)
    for leaf, pc in zip(leaves, pieces):
        if pc.tensors:
            squares = _wide(leaf.reshape(-1)[:pc.used]).square()
            lengths = torch.tensor(pc.lengths, device=leaf.device)
            partial = torch.segment_reduce(squares, "sum", lengths=lengths).to(device="cpu", dtype=torch.float64)
            sums.index_add_(0, torch.tensor(pc.tensors), partial)
    return sharding.reduce(sums).sqrt()


def expand(norms: torch.Tensor, pc: Pieces, leaf: torch.Tensor) -> torch.Tensor:
    per_piece = norms[list(pc.tensors)].to(device=leaf.device, dtype=leaf.dtype)
    lengths = torch.tensor(pc.lengths, dtype=torch.long, device=leaf.device)  # () would make a float tensor
    out = torch.zeros(leaf.numel(), dtype=leaf.dtype, device=leaf.device)
    out[:pc.used] = torch.repeat_interleave(per_piece, lengths)
    return out.view(leaf.shape)


def total_sums(*lists: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per list of leaves (each leaf one of the stepped params' leaves, or a tensor shaped like
    it), the sum of every element of the whole tensors: a 0-d tensor in the leaves' dtype.

    Unsharded: the sum of the leaves' sums (Optax's ``tree.sum``; a dot product is the sum of a
    product's leaves, ``tree.vdot``). Sharded: one sum per whole tensor (its pieces' partial sums
    in float64, padding left out) and one ``reduce`` of every list's together, so a rule's several
    global sums cost one collective, every rank gets the same numbers, and the tensors' sums are
    added in the tensors' order, in their dtypes: where each rank holds whole tensors (a whole-param
    plan) the step is the unsharded step's bit for bit.
    """
    # (a rank with no params in this step still joins the ranks' sum: the others wait for it)
    found = sharded(lists[0], "a sum over the whole model") if lists else None
    if found is None:
        return [_summed([leaf.sum() for leaf in leaves]) for leaves in lists]
    sharding, pieces = found
    per_tensor = torch.zeros(len(lists), sharding.n_tensors, dtype=torch.float64)
    held = torch.zeros(sharding.n_tensors, dtype=torch.float64)  # which tensors this step has, on any rank
    for j, leaves in enumerate(lists):
        if len(leaves) != len(pieces):
            raise ValueError(f"a sum over the whole model got {len(leaves)} leaves for {len(pieces)} stepped params")
        for leaf, pc in zip(leaves, pieces):
            if pc.tensors:
                if leaf.is_complex():
                    raise ValueError("a sum over the whole model of complex pieces is not supported: sum their real "
                                     "parts (a real inner product), or use a whole-param plan")
                _add_pieces(per_tensor[j], leaf, pc)
                held[list(pc.tensors)] = 1.0
    total = sharding.reduce(torch.cat([per_tensor.reshape(-1), held]))
    sums, present = total[:-sharding.n_tensors].view(len(lists), -1), total[-sharding.n_tensors:] > 0
    at = [t for t in range(sharding.n_tensors) if present[t]]
    return [_summed([sums[j, t].to(_dtype_of(leaves, sharding.dtypes[t])) for t in at])
            for j, leaves in enumerate(lists)]


def inner_products(*pairs: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Per pair of leaf lists ``(xs, ys)``, the real part of ``<x, y>`` over the whole model (Optax's
    ``tree.real(tree.vdot(x, y))``): `total_sums` of the products, every pair in one collective."""
    def real(t: torch.Tensor) -> torch.Tensor:
        return t.real if t.is_complex() else t

    return total_sums(*[[real(x.conj() * y) for x, y in zip(xs, ys)] for xs, ys in pairs])


def _add_pieces(into: torch.Tensor, leaf: torch.Tensor, pc: Pieces) -> None:
    """Each piece's sum into its tensor's slot: a whole tensor summed in its own dtype (as unsharded),
    pieces of one in float64."""
    flat, start = leaf.reshape(-1), 0
    for t, n in zip(pc.tensors, pc.lengths):
        part = flat[start:start + n]
        whole = len(pc.tensors) == 1 and part.numel() == leaf.numel()
        into[t] += float(part.sum()) if whole else float(part.to(torch.float64).sum())
        start += n


def _summed(sums: list[torch.Tensor]) -> torch.Tensor:
    if not sums:
        return torch.zeros(())
    return functools.reduce(torch.add, sums)


def _dtype_of(leaves: Sequence[torch.Tensor], default: torch.dtype) -> torch.dtype:
    return functools.reduce(torch.promote_types, [leaf.dtype for leaf in leaves]) if leaves else default


def all_finite(leaves: Sequence[torch.Tensor]) -> bool | torch.Tensor:
    """Whether every element of every leaf is finite, on every rank when sharded: a bool, or a
    0-d bool tensor when traced (`zero.functional.foreach.traced`), for a rule to select with."""
    bad = torch.stack([(~torch.isfinite(leaf)).sum() for leaf in leaves]).sum() if leaves else torch.zeros(())
    found = sharded(leaves, "a finiteness check")
    if found is not None:
        bad = found[0].reduce(bad.to(torch.float64))
    return bad == 0 if traced() else int(bad) == 0
