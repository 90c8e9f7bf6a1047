"""The whole-matrix kernels of the Kronecker-factored rules (SOAP, Shampoo): a factor's
eigenbasis, its refresh by one power iteration and QR, and its inverse p-th root.

Each is the one function that does its work, called once per factor: tests count their calls
(`CALLS`) to show that each matrix's preconditioner is computed on one rank of a group only.
The rules call them through this module (``kronecker.eigenbasis``), so a test may wrap them.
Beside them, what both rules share: a factor's statistic (`factor_of`), the rotation into and out
of the bases (`rotate`), the choice of a traced step (`pick`) and routing by name (`labels`).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from zero.functional import sharding
from zero.functional.contrib.newton_schulz import matrix_axes
from zero.functional.contrib.routing import check_cut, dims_per_leaf

__all__ = ["CALLS", "eigenbasis", "refreshed_basis", "inverse_root", "factor_of", "factor_updated", "rotate", "pick",
           "labels"]

CALLS: Counter = Counter()  # kernel name -> eager runs in this process


def _count(kernel: str, m: torch.Tensor, matrices: int = 1) -> None:
    # a compiled graph runs without calling back here; meta tensors are a plan asking what the rule needs whole
    if not torch.compiler.is_compiling() and m.device.type != "meta":
        CALLS[kernel] += matrices


def _unfolded(g: torch.Tensor, axis: int) -> torch.Tensor:
    """``G_(axis)``: ``g`` as a matrix, a row per index of ``axis`` (every other axis along it)."""
    return g.movedim(axis, 0).reshape(g.shape[axis], -1)


def factor_of(g: torch.Tensor, axis: int) -> torch.Tensor:
    """``G_(axis) G_(axis)^T``: the Gram matrix of ``g`` unfolded along ``axis`` (the
    statistic of that axis' Kronecker factor), summed over every other axis."""
    unfolded = _unfolded(g, axis)
    return unfolded @ unfolded.T


def factor_updated(f: torch.Tensor, g: torch.Tensor, axis: int, decay: float, weight: float,
                   into: bool = False) -> torch.Tensor:
    """``decay * f + weight * G_(axis) G_(axis)^T``: a factor's statistic after ``g``, in one
    ``addmm`` (the product and both scalings in one BLAS call, where `factor_of` and the sum take
    three kernels and two temporaries: Shampoo's step over many small matrices is mostly those).
    ``into``: written into ``f`` (the same bits; a state the caller gave up, see ``owned``)."""
    unfolded = _unfolded(g, axis)
    if into:
        return f.addmm_(unfolded, unfolded.T, beta=decay, alpha=weight)
    return torch.addmm(f, unfolded, unfolded.T, beta=decay, alpha=weight)


def rotate(x: torch.Tensor, bases: tuple[torch.Tensor, ...], back: bool = False) -> torch.Tensor:
    """``x`` with each axis multiplied by its basis (``Q^T x`` along the axis; ``Q x`` with
    ``back``), an empty basis leaving its axis as it is. Axes are taken first and moved last, so
    after every axis ``x`` has its own shape again. A matrix with both bases is two ``mm``s
    (``Q0^T x Q1``; back ``Q0 x Q1^T``), the transposes read in place where ``tensordot`` would
    copy each into a fresh layout first."""
    if x.ndim == 2 and len(bases) == 2 and bases[0].numel() and bases[1].numel():
        q0, q1 = bases
        return q0 @ x @ q1.T if back else q0.T @ x @ q1
    for q in bases:
        if q.numel():
            x = torch.tensordot(x, q, dims=[[0], [1 if back else 0]])
        else:
            x = x.permute([*range(1, x.ndim), 0])
    return x


def _each_alone(decompose, m: torch.Tensor) -> torch.Tensor:
    """``decompose`` of each matrix of a batch ``(..., n, n)`` alone, stacked. LAPACK's last bits
    depend on where a matrix lies in memory (seen on an AMD EPYC: a batch's second 7x7 QR one
    float32 ulp off the same matrix's alone), and a rank-deficient factor's eigenbasis is
    arbitrary within its null space, so a bit there moves the steps after it by O(1). Decomposed
    one by one, each in its own buffer, a matrix gets the same bits however many same-shape
    matrices share its batch (which the plan decides) and as the reference decomposes it."""
    if m.ndim == 2:
        return decompose(m)
    alone = [decompose(x) for x in m.reshape(-1, *m.shape[-2:]).unbind(0)]
    return torch.stack(alone).reshape(*m.shape[:-2], *alone[0].shape)


def eigenbasis(m: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of symmetric ``m`` (or of each of a batch, ``(B, n, n)``), by decreasing
    eigenvalue (columns). A tiny ridge (1e-30) keeps ``eigh`` from failing on an exactly zero
    factor; in float32 when ``m``'s dtype has no ``eigh`` (bfloat16)."""
    _count("eigenbasis", m, math.prod(m.shape[:-2]))
    work = m if m.dtype in (torch.float32, torch.float64) else m.float()
    ridge = 1e-30 * torch.eye(m.shape[-1], dtype=work.dtype, device=m.device)
    q = _each_alone(lambda x: torch.linalg.eigh(x + ridge)[1], work)
    return torch.flip(q, dims=[-1]).to(m.dtype).contiguous()  # one layout each step: no recompiles


def refreshed_basis(m: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power iteration from basis ``q`` towards ``m``'s eigenvectors, orthonormalised by QR
    (in float32, as the SOAP authors' code does: torch's QR has no bfloat16, and the basis'
    orthogonality matters more than its last bits), and the order of its columns: by the
    estimated eigenvalues ``diag(q^T m q)``, decreasing. The caller permutes the second moment
    along that axis by the same order. ``m`` and ``q`` may be batches ``(B, n, n)`` (an order each)."""
    _count("refreshed_basis", m, math.prod(m.shape[:-2]))
    product = m @ q
    order = torch.argsort((q * product).sum(dim=-2), descending=True)  # (each of a batch: its own order)
    basis = _each_alone(lambda x: torch.linalg.qr(x)[0],
                        product.gather(-1, order.unsqueeze(-2).expand_as(product)).to(torch.float32))
    return basis.to(product.dtype).contiguous(), order


def inverse_root(m: torch.Tensor, p: int) -> torch.Tensor:
    """``m^(-1/p)`` of symmetric positive semi-definite ``m`` (a batch of them) by its singular
    value decomposition, in at least float32 (each of a batch alone: `_each_alone`)."""
    _count("inverse_root", m)
    dtype = torch.float64 if m.dtype == torch.float64 else torch.float32

    def root(x: torch.Tensor) -> torch.Tensor:
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        return (u * s.pow(-1.0 / p).unsqueeze(-2)) @ vh

    return _each_alone(root, m.to(dtype)).to(m.dtype)


def pick(pred, a, b):
    """``a`` where ``pred`` else ``b``: a Python choice when eager (``pred`` a bool), ``torch.where``
    when traced, over tensors or matching tuples of them (both outcomes were then computed: a
    compiled or vmapped step holds every branch in one graph)."""
    if isinstance(pred, bool):
        return a if pred else b
    if isinstance(a, tuple):
        return tuple(torch.where(pred, x, y) for x, y in zip(a, b))
    return torch.where(pred, a, b)


def labels(dimension_numbers: Any, tree: Any, leaves: list[torch.Tensor], what: str) -> list | None:
    """Per leaf of ``tree``, the dimension numbers ``dimension_numbers`` (a function of the params,
    or a tree of `MuonDimensionNumbers` with None for the leaves without factors, as Muon's) give
    it; None when it is None (every leaf by the rule's own defaults). Under a hybrid plan a flat
    shard labelled, or holding a piece of a param labelled by name, is a ``ValueError`` naming it
    (its pieces would step without their factors)."""
    if dimension_numbers is None:
        return None
    cut = sharding.cut_tensors(leaves)
    if cut is not None and any(cut):
        check_cut(dimension_numbers, tree, cut, what, "preconditioned (with Kronecker factors)",
                  "shards step without factors")
    return dims_per_leaf(dimension_numbers, tree)


def named_axes(shape: tuple[int, ...], dims: Any) -> set[int]:
    """The axes of a tensor of ``shape`` that dimension numbers ``dims`` name (its matrix's rows
    and columns); none for None."""
    return set() if dims is None else set(matrix_axes(len(shape), dims))
