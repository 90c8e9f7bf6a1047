"""Newton-Schulz orthogonalisation, the whole-matrix kernel of Muon (``optax.contrib``'s
``orthogonalize_via_newton_schulz``, ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz``).

A weight of any rank is read as a batch of matrices by `MuonDimensionNumbers`: the reduction
axes become the rows, the output axes the columns, every other axis a batch axis. Each matrix
is rescaled (``preconditioning``), then mapped ``ns_steps`` times by the quintic
``f(X) = c0 X + (c1 A + c2 A A) X`` with ``A = X X^H``, which drives its singular values towards
one. `newton_schulz` is the one function that does this work, called once per leaf: ZeRO tests
count its calls to show each matrix is orthogonalised once in a group of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["MuonDimensionNumbers", "is_dimension_numbers", "split_axes", "PRECONDITIONINGS", "as_matrices", "fans",
           "newton_schulz", "orthogonalize_via_newton_schulz", "ns_dtype", "check_coeffs", "torch_newton_schulz",
           "orthogonalize", "matrix_axes"]

PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")


class MuonDimensionNumbers(NamedTuple):
    """Which axes of a weight are its matrix's rows (``reduction_axis``: the axes ``x @ W`` sums
    over) and columns (``output_axis``); the other axes are batch axes, each slice orthogonalised
    alone (``optax.contrib.MuonDimensionNumbers``). The default reads a 2-D weight as Optax's
    ``(in, out)``; a torch ``Linear`` weight ``(out, in)`` is ``MuonDimensionNumbers(1, 0)``, and
    the orthogonalisation is the same either way (it commutes with transposition)."""

    reduction_axis: Sequence[int] | int = 0
    output_axis: Sequence[int] | int = 1


def is_dimension_numbers(x: Any) -> bool:
    """Whether ``x`` is a `MuonDimensionNumbers` (or any named tuple with its two fields, such as
    Optax's, so trees written for Optax work unchanged)."""
    return isinstance(x, tuple) and hasattr(x, "reduction_axis") and hasattr(x, "output_axis")


def _axes(ndim: int, axes: Sequence[int] | int) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(a % ndim for a in axes)


def matrix_axes(ndim: int, dims: Any) -> tuple[int, ...]:
    """The reduction and output axes of `MuonDimensionNumbers` ``dims`` over ``ndim`` axes."""
    return _axes(ndim, dims.reduction_axis) + _axes(ndim, dims.output_axis)


def split_axes(shape: torch.Size, dims: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(batch, reduction, output) axes of a weight of ``shape``; ``ValueError`` when they are not
    disjoint or the weight is not at least a matrix."""
    if len(shape) < 2:
        raise ValueError(f"Muon orthogonalises matrices: a tensor of shape {tuple(shape)} has rank < 2 "
                         "(route it to Adam: muon() does so for the leaves that are not matrices)")
    dims = MuonDimensionNumbers() if dims is None else dims
    red, out = _axes(len(shape), dims.reduction_axis), _axes(len(shape), dims.output_axis)
    if set(red) & set(out):
        raise ValueError(f"reduction axes {red} and output axes {out} overlap (dimension numbers {dims!r}, "
                         f"shape {tuple(shape)})")
    batch = tuple(a for a in range(len(shape)) if a not in red and a not in out)
    return batch, red, out


def fans(shape: torch.Size, dims: Any) -> tuple[int, int]:
    """(fan_in, fan_out): the products of the reduction and of the output axes."""
    _, red, out = split_axes(shape, dims)
    return math.prod([shape[a] for a in red]), math.prod([shape[a] for a in out])  # lists: torch.compile


def as_matrices(x: torch.Tensor, dims: Any):
    """``x`` as a ``(batch, rows, cols)`` stack of matrices, and the function that maps such a
    stack back to ``x``'s shape."""
    batch, red, out = split_axes(x.shape, dims)
    order = batch + red + out
    sizes = [x.shape[a] for a in order]
    ends = (len(batch), len(batch) + len(red))
    stacked = x.permute(order).reshape(math.prod(sizes[:ends[0]]), math.prod(sizes[ends[0]:ends[1]]),
                                       math.prod(sizes[ends[1]:]))
    inverse = [order.index(a) for a in range(x.ndim)]
    return stacked, lambda y: y.reshape(sizes).permute(inverse)


def ns_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype Newton-Schulz runs in: bfloat16 for real 16/32-bit tensors on CUDA, as the
    reference implementations do (tensor cores; the iteration tolerates it), else ``x``'s own
    (float64 and complex keep their precision; on CPU bfloat16 matmuls are slower, not faster)."""
    if x.is_cuda and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.bfloat16
    return x.dtype


def _precondition(x: torch.Tensor, how: str, eps: float):
    """The rescaled stack, and for AOL / Schatten the first step's Gram matrices already scaled
    (their first iteration reuses them)."""
    if how == "frobenius":
        return x / (torch.linalg.matrix_norm(x, keepdim=True) + eps), None
    if how == "spectral":
        return x / (torch.linalg.matrix_norm(x, ord=2, keepdim=True) + eps), None
    if how == "aol":
        a = x @ x.mH
        s = torch.rsqrt(a.abs().sum(-1).clamp(min=eps)).unsqueeze(-1).to(x.dtype)
        return x * s, a * s * s.mT
    a = x @ x.mT  # schatten: Optax's Gram here is not conjugated
    s = torch.rsqrt(torch.linalg.matrix_norm(a, keepdim=True).clamp(min=eps)).to(x.dtype)
    return x * s, a * s * s


def newton_schulz(x: torch.Tensor, coeffs: torch.Tensor, ns_steps: int, preconditioning: str = "frobenius",
                  eps: float = 1e-8) -> torch.Tensor:
    """Orthogonalise a ``(batch, rows, cols)`` stack: rescale, then ``ns_steps`` quintic steps
    with ``coeffs`` (a row of three, or one row per step). Wide matrices are iterated as they are,
    tall ones transposed, so the Gram matrix ``X X^H`` is the smaller square."""
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT.contiguous()  # a transposed view would make every matmul read strided (1.5x slower on CPU)
    c = coeffs.to(x.dtype)
    rows = c.expand(ns_steps, 3) if c.ndim == 1 else c
    x, gram = _precondition(x, preconditioning, eps)
    for i in range(rows.shape[0]):
        a = gram if i == 0 and gram is not None else x @ x.mH
        b = rows[i, 1] * a + rows[i, 2] * (a @ a)
        x = rows[i, 0] * x + b @ x
    return x.mT if tall else x


def check_coeffs(ns_coeffs: Any, ns_steps: int) -> torch.Tensor:
    """The coefficients as a float64 tensor of shape (3,) or (n, 3), the last ``ns_steps`` rows
    of a table; ``ValueError`` for another shape or a table with more rows than steps."""
    coeffs = torch.as_tensor(ns_coeffs, dtype=torch.float64)
    if coeffs.ndim not in (1, 2) or coeffs.shape[-1] != 3:
        raise ValueError(f"ns_coeffs must have shape (3,) or (n, 3), got {tuple(coeffs.shape)}")
    if coeffs.ndim == 2:
        if coeffs.shape[0] > ns_steps:
            raise ValueError(f"ns_coeffs has {coeffs.shape[0]} rows but ns_steps is {ns_steps}: not enough steps "
                             "to use every row")
        coeffs = coeffs[-ns_steps:]
    return coeffs


def orthogonalize_via_newton_schulz(x: torch.Tensor, ns_coeffs: Any, ns_steps: int = 5,
                                    preconditioning: str = "frobenius", eps: float = 1e-8,
                                    dimension_numbers: MuonDimensionNumbers | None = None) -> torch.Tensor:
    """``x`` orthogonalised slice by slice (``optax.contrib.orthogonalize_via_newton_schulz``):
    a matrix, or any tensor with ``dimension_numbers`` saying which axes are the matrix's."""
    if x.ndim != 2 and not is_dimension_numbers(dimension_numbers):
        raise ValueError(f"a tensor of shape {tuple(x.shape)} needs dimension_numbers to be read as matrices")
    if preconditioning not in PRECONDITIONINGS:
        raise ValueError(f"unknown preconditioning {preconditioning!r}; choose one of {PRECONDITIONINGS}")
    coeffs = torch.as_tensor(ns_coeffs)
    if coeffs.ndim > 2 or coeffs.shape[-1] != 3:
        raise ValueError(f"Newton-Schulz coefficients must have shape (3,) or (n, 3), got {tuple(coeffs.shape)}")
    return orthogonalize(x, coeffs, ns_steps, preconditioning, eps, None if x.ndim == 2 else dimension_numbers)


def orthogonalize(x: torch.Tensor, coeffs: torch.Tensor, ns_steps: int, preconditioning: str, eps: float,
                  dims: Any) -> torch.Tensor:
    """``x`` read as matrices by ``dims``, orthogonalised in `ns_dtype` by one `newton_schulz`
    run, in ``x``'s shape and dtype (arguments already checked)."""
    stacked, back = as_matrices(x, dims)
    return back(newton_schulz(stacked.to(ns_dtype(stacked)), coeffs, ns_steps, preconditioning, eps).to(x.dtype))


def torch_newton_schulz(g: torch.Tensor, coeffs: tuple[float, float, float], ns_steps: int,
                        eps: float) -> torch.Tensor:
    """``torch.optim.Muon``'s orthogonalisation of a matrix, op for op: in bfloat16 on every
    device, the norm clamped below by ``eps`` (not added to it), each step two ``addmm``. Returns
    bfloat16, as torch's does."""
    a, b, c = coeffs
    x = g.bfloat16()
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x
