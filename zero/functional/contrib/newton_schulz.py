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
           "orthogonalize", "matrix_axes", "heads_of", "NS_METHODS", "check_method",
           "split_heads", "join_heads", "block_shape", "head_axis", "first_axis_heads"]

PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
NS_METHODS = ("standard", "gram")


class MuonDimensionNumbers(NamedTuple):
    """Which axes of a weight are its matrix's rows (``reduction_axis``: the axes ``x @ W`` sums
    over) and columns (``output_axis``); the other axes are batch axes, each slice orthogonalised
    alone (``optax.contrib.MuonDimensionNumbers``). The default reads a 2-D weight as Optax's
    ``(in, out)``; a torch ``Linear`` weight ``(out, in)`` is ``MuonDimensionNumbers(1, 0)``, and
    the orthogonalisation is the same either way (it commutes with transposition).

    ``heads`` (zero's field; Optax's have none, read as 1) cuts the output axis into that many
    equal blocks, each orthogonalised alone, as Optax's Muon on the weight reshaped with a head
    axis in front: a torch ``(H * d, D)`` projection with ``MuonDimensionNumbers(1, 0, heads=H)``
    is ``(H, d, D)`` with dimension numbers ``(2, 1)``; a fused QKV weight takes ``heads=3 * H``.
    The shape scaling (`scale_by_shape`) then uses a block's shape, ``fan_out = H * d / H``."""

    reduction_axis: Sequence[int] | int = 0
    output_axis: Sequence[int] | int = 1
    heads: int = 1


def is_dimension_numbers(x: Any) -> bool:
    """Whether ``x`` is a `MuonDimensionNumbers` (or any named tuple with its two fields, such as
    Optax's, so trees written for Optax work unchanged)."""
    return isinstance(x, tuple) and hasattr(x, "reduction_axis") and hasattr(x, "output_axis")


def heads_of(dims: Any) -> int:
    """The head blocks dimension numbers cut the output axis into (1 for None and Optax's)."""
    return 1 if dims is None else getattr(dims, "heads", 1)


def head_axis(ndim: int, dims: Any) -> int:
    """The axis heads cut: the first output axis of a tensor of ``ndim`` axes."""
    return _axes(ndim, dims.output_axis)[0]


def first_axis_heads(x: torch.Tensor, d: Any) -> int | None:
    """The heads dimension numbers ``d`` cut the first axis of the whole tensor ``x`` is (or is a
    piece of) into, or None when they cut another axis, or none: the axis a plan may cut at head
    edges, and the one its per-head costs read (torch's output rows)."""
    if d is None or heads_of(d) < 2:
        return None
    first = d.output_axis if isinstance(d.output_axis, int) else d.output_axis[0]
    # a piece may be a flat run (1-D): only a literal first axis is known to be the whole tensor's
    return heads_of(d) if first == 0 or (x.ndim > 1 and head_axis(x.ndim, d) == 0) else None


def split_heads(x: torch.Tensor, dims: Any) -> torch.Tensor:
    """``x`` as ``(heads, *block)``: its output axis cut into the heads' blocks, the head axis
    moved in front (a view)."""
    h, o = heads_of(dims), head_axis(x.ndim, dims)
    return x.unflatten(o, (h, x.shape[o] // h)).movedim(o, 0)


def join_heads(blocks: torch.Tensor, dims: Any) -> torch.Tensor:
    """The inverse of `split_heads`: ``(heads, *block)`` back to one tensor."""
    o = head_axis(blocks.ndim - 1, dims)
    return blocks.movedim(0, o).flatten(o, o + 1)


def block_shape(shape: tuple[int, ...], dims: Any) -> tuple[int, ...]:
    """The shape of one head's block of a tensor of ``shape`` (``shape`` itself without heads)."""
    h = heads_of(dims)
    if h == 1:
        return tuple(shape)
    o = head_axis(len(shape), dims)
    return tuple(n // h if a == o else n for a, n in enumerate(shape))


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
    heads = heads_of(dims)
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r} (dimension numbers {dims!r})")
    if heads > 1 and shape[out[0]] % heads:
        raise ValueError(f"heads={heads} does not divide the output axis {out[0]} of shape {tuple(shape)} (dimension "
                         f"numbers {dims!r}): each head needs the same number of rows")
    return batch, red, out


def fans(shape: torch.Size, dims: Any) -> tuple[int, int]:
    """(fan_in, fan_out): the products of the reduction and of the output axes (of one head's
    block when the dimension numbers have heads)."""
    _, red, out = split_axes(shape, dims)
    return math.prod([shape[a] for a in red]), math.prod([shape[a] for a in out]) // heads_of(dims)  # lists: compile


def as_matrices(x: torch.Tensor, dims: Any):
    """``x`` as a ``(batch, rows, cols)`` stack of matrices, and the function that maps such a
    stack back to ``x``'s shape. With ``heads`` the columns of each matrix are cut into that many
    blocks, stacked after its batch index (heads of one batch slice together)."""
    batch, red, out = split_axes(x.shape, dims)
    order = batch + red + out
    sizes = [x.shape[a] for a in order]
    ends = (len(batch), len(batch) + len(red))
    b, r, c = math.prod(sizes[:ends[0]]), math.prod(sizes[ends[0]:ends[1]]), math.prod(sizes[ends[1]:])
    stacked = x.permute(order).reshape(b, r, c)
    inverse = [order.index(a) for a in range(x.ndim)]
    h = heads_of(dims)
    if h == 1:
        return stacked, lambda y: y.reshape(sizes).permute(inverse)
    blocks = stacked.view(b, r, h, c // h).transpose(1, 2).reshape(b * h, r, c // h)
    return blocks, lambda y: y.reshape(b, h, r, c // h).transpose(1, 2).reshape(sizes).permute(inverse)


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
                  eps: float = 1e-8, method: str = "standard", restarts: tuple[int, ...] = ()) -> torch.Tensor:
    """Orthogonalise a ``(batch, rows, cols)`` stack: rescale, then ``ns_steps`` quintic steps
    with ``coeffs`` (a row of three, or one row per step). Wide matrices are iterated as they are,
    tall ones transposed, so the Gram matrix ``X X^H`` is the smaller square. ``method="gram"``
    runs the steps on the Gram matrix (`_gram_steps`) for matrices that are not square (a square
    one gains nothing from it, and the Gram package iterates those as standard too)."""
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT.contiguous()  # a transposed view would make every matmul read strided (1.5x slower on CPU)
    c = coeffs.to(x.dtype)
    rows = c.expand(ns_steps, 3) if c.ndim == 1 else c
    x, gram = _precondition(x, preconditioning, eps)
    if method == "gram" and x.shape[-2] != x.shape[-1]:
        x = _gram_steps(x, gram, rows, restarts)
    else:
        for i in range(rows.shape[0]):
            a = gram if i == 0 and gram is not None else x @ x.mH
            b = rows[i, 1] * a + rows[i, 2] * (a @ a)
            x = rows[i, 0] * x + b @ x
    return x.mT if tall else x


def _gram_steps(x: torch.Tensor, gram: torch.Tensor | None, rows: torch.Tensor, restarts: tuple[int, ...]):
    """The standard steps' result by Gram Newton-Schulz: every step polynomial
    ``p_i(R) = a_i + b_i R + c_i R^2`` is a polynomial in ``R_0 = X X^H``, so they commute; ``Q``
    gathers their product and ``R_i = p_i R_{i-1} p_i`` follows the iterate's Gram matrix, on
    ``rows x rows`` squares only. At a restart (and the end) ``X <- Q X``; restarting resets ``Q``
    to the identity and recomputes ``R`` from ``X``, which keeps low precision from drifting."""
    r = gram if gram is not None else x @ x.mH
    eye = torch.eye(x.shape[-2], dtype=x.dtype, device=x.device)
    q, n = None, rows.shape[0]
    for i in range(n):
        a, b, c = rows[i, 0], rows[i, 1], rows[i, 2]
        if i in restarts:
            x = q @ x
            r, q = x @ x.mH, None
        z = b * r + c * (r @ r)
        q = z + a * eye if q is None else q @ z + a * q
        if i + 1 < n and i + 1 not in restarts:  # the next step reads R (a restart recomputes it)
            rz = r @ z + a * r
            r = z @ rz + a * rz
    return q @ x


def check_method(ns_method: str, ns_restarts: Any, ns_steps: int) -> tuple[int, ...]:
    """The restart steps of ``ns_method`` (``ValueError`` for an unknown method, restarts given to
    the standard iteration, which has none, or a restart outside ``1 .. ns_steps - 1``).
    ``None``: the Gram package's default, a restart before the third step."""
    if ns_method not in NS_METHODS:
        raise ValueError(f"unknown ns_method {ns_method!r}; choose one of {NS_METHODS}")
    if ns_method == "standard":
        if ns_restarts:
            raise ValueError(f"ns_restarts={ns_restarts!r} applies to ns_method='gram' only: the standard iteration "
                             "multiplies X every step and has nothing to restart")
        return ()
    restarts = ((2,) if ns_steps > 2 else ()) if ns_restarts is None else tuple(ns_restarts)
    bad = [i for i in restarts if isinstance(i, bool) or not isinstance(i, int) or not 0 < i < ns_steps]
    if bad:
        raise ValueError(f"ns_restarts must be steps in 1 .. ns_steps - 1 = {ns_steps - 1}, got {bad[0]!r}")
    return tuple(sorted(set(restarts)))


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
                                    dimension_numbers: MuonDimensionNumbers | None = None, *,
                                    ns_method: str = "standard", ns_restarts: Any = None) -> torch.Tensor:
    """``x`` orthogonalised slice by slice (``optax.contrib.orthogonalize_via_newton_schulz``):
    a matrix, or any tensor with ``dimension_numbers`` saying which axes are the matrix's (and
    its heads). ``ns_method="gram"`` iterates on the Gram matrix, restarting before the steps in
    ``ns_restarts`` (default: the third), the same polynomial as the standard iteration."""
    restarts = check_method(ns_method, ns_restarts, ns_steps)
    if x.ndim != 2 and not is_dimension_numbers(dimension_numbers):
        raise ValueError(f"a tensor of shape {tuple(x.shape)} needs dimension_numbers to be read as matrices")
    if preconditioning not in PRECONDITIONINGS:
        raise ValueError(f"unknown preconditioning {preconditioning!r}; choose one of {PRECONDITIONINGS}")
    coeffs = ns_coeffs if isinstance(ns_coeffs, torch.Tensor) else torch.as_tensor(ns_coeffs, dtype=torch.float64)
    if coeffs.ndim > 2 or coeffs.shape[-1] != 3:
        raise ValueError(f"Newton-Schulz coefficients must have shape (3,) or (n, 3), got {tuple(coeffs.shape)}")
    dims = dimension_numbers if is_dimension_numbers(dimension_numbers) else None
    return orthogonalize(x, coeffs, ns_steps, preconditioning, eps, dims, ns_method, restarts)


def orthogonalize(x: torch.Tensor, coeffs: torch.Tensor, ns_steps: int, preconditioning: str, eps: float,
                  dims: Any, method: str = "standard", restarts: tuple[int, ...] = ()) -> torch.Tensor:
    """``x`` read as matrices by ``dims``, orthogonalised in `ns_dtype` by one `newton_schulz`
    run, in ``x``'s shape and dtype (arguments already checked)."""
    stacked, back = as_matrices(x, dims)
    out = newton_schulz(stacked.to(ns_dtype(stacked)), coeffs, ns_steps, preconditioning, eps, method, restarts)
    return back(out.to(x.dtype))


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
