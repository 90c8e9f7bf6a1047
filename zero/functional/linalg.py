"""Optax's linear algebra on torch tensors (``optax.power_iteration``,
``matrix_inverse_pth_root``, ``nnls``): the same iterations, eager loops for JAX's ``while_loop``
and ``scan``. Shampoo's own roots are `zero.functional.contrib.kronecker`'s (by eigendecomposition)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import optree
import torch

__all__ = ["power_iteration", "matrix_inverse_pth_root", "nnls"]


def _norm(tree: Any) -> torch.Tensor:
    return torch.sqrt(sum((x * x.conj()).real.sum() for x in optree.tree_leaves(tree)))


def _vdot(a: Any, b: Any) -> torch.Tensor:
    return sum((x.conj() * y).sum() for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


def _normalized(tree: Any) -> Any:
    scale = 1.0 / _norm(tree)
    return optree.tree_map(lambda x: scale * x, tree)


@torch.no_grad()
def power_iteration(matrix: torch.Tensor | Callable[[Any], Any], *, v0: Any = None, num_iters: int = 100,
                    error_tolerance: float = 1e-6, precision: Any = None,
                    key: torch.Generator | int | None = None) -> tuple[torch.Tensor, Any]:
    """The dominant eigenvalue and its unit eigenvector of a symmetric ``matrix`` (or of the linear
    map a callable applies to trees like ``v0``), by power iteration until the residual is below
    ``error_tolerance`` relative to the eigenvalue (``optax.power_iteration``). ``v0`` defaults to
    uniform noise in [-1, 1) from ``key`` (a ``torch.Generator`` or a seed; 0 by default: JAX's
    keys have no torch counterpart, so the start differs from Optax's, not the answer).
    ``precision`` (XLA's matmul precision) is accepted and ignored: torch multiplies exactly so."""
    if callable(matrix):
        if v0 is None:
            raise ValueError("v0 must be provided when `matrix` is a callable.")
        mvp = matrix
    else:
        mvp = lambda v: matrix @ v  # noqa: E731
        if v0 is None:
            gen = key if isinstance(key, torch.Generator) else torch.Generator().manual_seed(int(key or 0))
            v0 = torch.rand(matrix.shape[-1:], generator=gen, dtype=matrix.dtype) * 2 - 1
    v = _normalized(v0)
    z, eig = mvp(v), torch.zeros(())
    for _ in range(num_iters):
        v = _normalized(z)
        z = mvp(v)
        eig = _vdot(v, z)
        residual = optree.tree_map(lambda a, b, e=eig: a - e * b, z, v)
        if bool(torch.abs(_norm(residual) / eig) < error_tolerance):
            break
    return eig, _normalized(z)


@torch.no_grad()
def matrix_inverse_pth_root(matrix: torch.Tensor, p: int, num_iters: int = 100, ridge_epsilon: float = 1e-6,
                            error_tolerance: float = 1e-6, precision: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(matrix + ridge I)^(-1/p)`` of a symmetric positive semi-definite matrix by the coupled
    Newton iteration, and its error ``max |M - I|`` (``optax.matrix_inverse_pth_root``, as in
    Scalable Shampoo; ``p`` in 1, 2, 4, 8). The iteration runs in float32, as Optax's does, and
    stops when the error stops falling; the ridge is relative to the largest eigenvalue."""
    if p not in (1, 2, 4, 8):
        raise ValueError(f"p={p!r}: the coupled Newton iteration takes p in (1, 2, 4, 8)")
    n = matrix.shape[0]
    alpha = -1.0 / p
    f32 = torch.float32
    eye = torch.eye(n, dtype=f32)
    max_ev, _ = power_iteration(matrix, num_iters=100, error_tolerance=1e-6)
    ridge = ridge_epsilon * torch.clamp(torch.as_tensor(max_ev), min=1e-16)
    if n == 1:
        return (matrix + ridge) ** alpha, torch.zeros(())
    damped = (matrix + ridge * torch.eye(n, dtype=matrix.dtype)).to(f32)
    z = (1 + p) / (2 * torch.linalg.matrix_norm(damped))
    m, h = damped * z, eye * z ** (1.0 / p)
    error, old_h, converged = torch.max(torch.abs(m - eye)), h, True
    for _ in range(num_iters):
        if not (bool(error > error_tolerance) and converged):
            break
        step = (1 - alpha) * eye + alpha * m
        new_m = torch.linalg.matrix_power(step, p) @ m
        old_h, h = h, h @ step
        new_error = torch.max(torch.abs(new_m - eye))
        converged, m, error = bool(new_error < error * 1.2), new_m, new_error
    error = torch.max(torch.abs(m - eye))
    return (h if converged else old_h).to(matrix.dtype), error


@torch.no_grad()
def nnls(A: torch.Tensor, b: torch.Tensor, iters: int, unroll: Any = 1, L: Any = None) -> torch.Tensor:  # noqa: N803
    """Non-negative least squares, ``argmin_{x >= 0} |A x - b|^2``, by ``iters`` steps of
    accelerated projected gradient (``optax.nnls``; ``L``: a bound on the largest eigenvalue of
    ``A^T A``, by default the smaller of its Frobenius and 1-norms; ``unroll`` is JAX's and ignored)."""
    if A.dim() != 2 or b.dim() not in (1, 2) or b.shape[0] != A.shape[0]:
        raise ValueError(f"nnls takes A of shape (m, n) and b of shape (m,) or (m, k); got {tuple(A.shape)} and "
                         f"{tuple(b.shape)}")
    Q, q = A.mT @ A, A.mT @ b  # noqa: N806
    if L is None:
        L = torch.minimum(torch.linalg.matrix_norm(Q, "fro"), torch.linalg.matrix_norm(Q, 1)) if Q.numel() else 0.0
    L = torch.where(torch.as_tensor(L) == 0, 1.0, torch.as_tensor(L, dtype=Q.dtype))  # noqa: N806
    x = torch.zeros(A.shape[-1:] + b.shape[1:], dtype=b.dtype)
    p, c = x, 0.0
    for _ in range(iters):
        cn = (1 + math.sqrt(1 + 4 * c ** 2)) / 2
        s = (c - 1) / cn
        xn = torch.clamp(p - (Q @ p - q) / L, min=0)
        p, x, c = xn + s * (xn - x), xn, cn
    return x
