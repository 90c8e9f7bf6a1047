"""Muon: momentum orthogonalised by Newton-Schulz (mirrors ``optax.contrib.muon``,
``scale_by_muon``, ``scale_by_shape`` and ``MuonState``, argument for argument).

Muon updates a matrix by the orthogonalised (nesterov) momentum of its gradients, scaled by
its shape; the params that are not matrices go to AdamW. The orthogonalisation needs each
matrix whole (`zero.functional.contrib.newton_schulz`): under a sharded optimizer each matrix
belongs to one rank (a whole-param plan, or a hybrid plan: flat, with the matrices whole), and
`weight="step_flops"` plans balance that work.
``torch.optim.Muon``'s rule (its momentum without bias correction, bfloat16 Newton-Schulz, its
learning-rate adjustments) is `zero.functional.from_torch` ``("Muon", ...)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import quantize as Q
from zero.functional import sharding
from zero.functional import transforms as T
from zero.functional.aliases import ScalarOrSchedule, alias
from zero.functional.aliases.adam import adamw
from zero.functional.base import (
    GradientTransformation,
    Spec,
    as_dtype,
    check_non_negative,
    check_positive,
    check_unit,
    count_inc,
    count_zero,
    stateless_tx,
    step_count,
    tree_leaves,
    tree_map,
    zeros_like,
)
from zero.functional.combine import chain
from zero.functional.contrib.newton_schulz import (
    PRECONDITIONINGS,
    MuonDimensionNumbers,
    check_coeffs,
    check_method,
    fans,
    first_axis_heads,
    heads_of,
    orthogonalize,
)
from zero.functional.contrib.routing import DimensionNumbers, check_cut, check_labelled, dims_per_leaf, local_dims
from zero.functional.elementwise import debias, moment

__all__ = ["MuonState", "scale_by_muon", "scale_by_shape", "muon", "muon_8bit", "NS_COEFFS_PRESETS",
           "MU_BLOCK_SIZE"]

DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)
# Polar Express (Amsel et al., arXiv:2505.16932, Table/Algorithm 1's five steps), each step's (a, b, c)
# divided by (1.05, 1.05^3, 1.05^5) for safety, as the gram-newton-schulz package ships them
_POLAR_EXPRESS = ((8.28721201814563, -23.595886519098837, 17.300387312530933),
                  (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
                  (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
                  (3.3184196573706015, -2.488488024314874, 0.51004894012372),
                  (2.300652019954817, -1.6689039845747493, 0.4188073119525673))
NS_COEFFS_PRESETS = {
    "standard": DEFAULT_NS_COEFFS,
    "dion": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
             (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    "polar_express": tuple((a / 1.05, b / 1.05**3, c / 1.05**5) for a, b, c in _POLAR_EXPRESS),
}
MU_BLOCK_SIZE = 2048  # 8-bit Muon's block of momentum elements sharing one scale (arXiv:2509.23106)


class MuonState(NamedTuple):
    """State of ``scale_by_muon`` (``optax.contrib.MuonState``).

    Fields:
        count: steps taken, 0-d int32.
        mu: the momentum, a pytree like the params (in ``mu_dtype``).
        ns_coeffs: the Newton-Schulz coefficients, shape (3,) or (ns_steps, 3).
    """

    count: torch.Tensor
    mu: Any
    ns_coeffs: torch.Tensor


def scale_by_muon(ns_coeffs: Any = DEFAULT_NS_COEFFS, ns_steps: int = 5, beta: float = 0.95, eps: float = 1e-8,
                  mu_dtype: torch.dtype | str | None = None, *, nesterov: bool = True, adaptive: bool = False,
                  preconditioning: str = "frobenius", weight_dimension_numbers: DimensionNumbers = None,
                  ns_method: str = "standard", ns_restarts: Any = None,
                  mu_block_size: int = MU_BLOCK_SIZE) -> GradientTransformation:
    r"""Muon's rescaling (mirrors ``optax.contrib.scale_by_muon``).

    .. math::
        m_t = \beta m_{t-1} + (1 - \beta) g_t, \quad
        u_t = \mathrm{NS}(\hat m_t), \quad
        \hat m_t = \beta \frac{m_t}{1 - \beta^{t+1}} + (1 - \beta) \frac{g_t}{1 - \beta^t}
        \ \text{(nesterov)}, \ \text{else}\ \frac{m_t}{1 - \beta^t}

    where NS orthogonalises each matrix (`orthogonalize_via_newton_schulz`).

    Args:
        ns_coeffs: the quintic's coefficients ``(a, b, c)``, or one triple per step.
        ns_steps: Newton-Schulz steps (a table of triples uses its last ``ns_steps`` rows).
        beta: the momentum's decay, in [0, 1).
        eps: added to the rescaling's denominator.
        mu_dtype: the momentum's dtype (``None``: the updates'), or ``"int8"``: 8-bit Muon, the
            momentum kept in blockwise linear int8 codes (``mu_block_size`` elements a float32
            scale, in each whole matrix's own element order: the same bits on any rank count),
            dequantized to float32 for the step and quantized again after it.
        nesterov: the look-ahead momentum above.
        adaptive: scale each update by ``<m_hat, u>`` (the dual norm of the momentum).
        preconditioning: the rescaling before the steps: ``"frobenius"``, ``"spectral"``,
            ``"aol"`` or ``"schatten"``.
        weight_dimension_numbers: how each leaf reads as matrices (`MuonDimensionNumbers`, a
            tree of them, or a function of the updates returning one); ``None``: every leaf is
            a 2-D matrix. A `MuonDimensionNumbers` with ``heads`` orthogonalises each head's
            block of the output axis alone.
        ns_method: ``"standard"`` or ``"gram"`` (Gram Newton-Schulz: the same polynomial iterated
            on ``X X^H``, cheaper for matrices far from square; square ones iterate as standard).
        ns_restarts: the Gram iteration's restart steps (``None``: before the third).
        mu_block_size: the block of ``mu_dtype="int8"``.

    Returns:
        A transformation with state `MuonState`. Every leaf it sees must be whole: under a flat
        plan, which steps pieces of tensors, it is a ``ValueError``.
    """
    int8 = mu_dtype in ("int8", torch.int8)
    mu_dtype = None if int8 else as_dtype(mu_dtype, "mu_dtype")
    check_unit("beta", beta)
    check_non_negative("eps", eps)
    check_positive("ns_steps", ns_steps)
    check_positive("mu_block_size", mu_block_size)
    if preconditioning not in PRECONDITIONINGS:
        raise ValueError(f"unknown preconditioning {preconditioning!r}; choose one of {PRECONDITIONINGS}")
    coeffs = check_coeffs(ns_coeffs, ns_steps)
    restarts = check_method(ns_method, ns_restarts, ns_steps)

    def init(params):
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in tree_leaves(params)) else torch.float32
        mu = tree_map(lambda p: Q.linear_zeros(p, mu_block_size), params) if int8 else zeros_like(params, mu_dtype)
        return MuonState(count_zero(), mu, coeffs.to(dtype))

    def momentum(g, m):
        if not int8:
            return moment(g, m, beta, 1)
        return moment(g.to(torch.promote_types(g.dtype, torch.float32)), Q.dequantize_linear(m, mu_block_size), beta, 1)

    def update(updates, state, params=None):
        leaves, treedef = optree.tree_flatten(updates)
        dims = dims_per_leaf(weight_dimension_numbers, updates)
        # whole matrices, or whole heads of them where a plan cut them at head edges (not 8-bit
        # Muon's codes, whose blocks lie in each whole matrix)
        firsts = [None if int8 else first_axis_heads(x, d) for x, d in zip(leaves, dims)]
        held = sharding.whole_heads(leaves, "scale_by_muon (Newton-Schulz on whole matrices)", firsts)
        held = [None if f is None else kept for f, kept in zip(firsts, held)]  # None: a whole leaf, as it is
        count = count_inc(state.count)
        mu = [momentum(g, m) for g, m in zip(leaves, treedef.flatten_up_to(state.mu))]
        c = step_count(count)
        if nesterov:
            hat = [beta * debias(m, beta, c + 1) + (1 - beta) * debias(g, beta, c) for m, g in zip(mu, leaves)]
        else:
            hat = [debias(m, beta, c) for m in mu]
        out = [_held_orthogonalized(h, d, kept, state.ns_coeffs) for h, d, kept in zip(hat, dims, held)]
        if adaptive:
            out = [torch.sum(h.conj() * o) * o for h, o in zip(hat, out)]
        if int8:  # the step ran in float32 (at least): the updates take the gradients' dtype
            out = [o.to(g.dtype) for o, g in zip(out, leaves)]
        if int8:
            mu = [Q.quantize_linear(m, mu_block_size) for m in mu]
        elif mu_dtype is not None:
            mu = [m.to(mu_dtype) for m in mu]
        return treedef.unflatten(out), MuonState(count, treedef.unflatten(mu), state.ns_coeffs)

    def _held_orthogonalized(h, d, kept, coeffs):
        """A leaf orthogonalised as the matrices it is, or (``kept``: ``(k, shape)``) as the ``k``
        heads of its first axis it holds, read in ``shape``."""
        if kept is None or kept == (heads_of(d), tuple(h.shape)):  # a whole tensor
            return orthogonalize(h, coeffs, ns_steps, preconditioning, eps, d, ns_method, restarts)
        k, shape = kept
        if not k:  # a piece of no heads (a rank FSDP2 gave no rows, or none a head starts in)
            return h.clone()
        d = MuonDimensionNumbers(d.reduction_axis, d.output_axis, k)
        out = orthogonalize(h.reshape(shape), coeffs, ns_steps, preconditioning, eps, d, ns_method, restarts)
        return out.reshape(h.shape)

    spec = Spec("scale_by_muon", {"ns_coeffs": ns_coeffs, "ns_steps": ns_steps, "beta": beta, "eps": eps,
                                  "mu_dtype": mu_dtype, "nesterov": nesterov, "adaptive": adaptive,
                                  "preconditioning": preconditioning,
                                  "weight_dimension_numbers": weight_dimension_numbers, "ns_method": ns_method,
                                  "ns_restarts": ns_restarts, "mu_block_size": mu_block_size})
    return GradientTransformation(init, update, spec=spec)


def scale_by_shape(weight_dimension_numbers: DimensionNumbers = None,
                   consistent_rms: float | None = None) -> GradientTransformation:
    """Scale each matrix's update by its shape (``optax.contrib.scale_by_shape``): by
    ``sqrt(max(1, fan_out / fan_in))`` (Keller Jordan's width scaling) or, with
    ``consistent_rms``, by ``sqrt(max(fan_in, fan_out)) * consistent_rms`` (Moonlight's, which
    gives updates the RMS of AdamW's at ``0.2``)."""

    def scale_of(shape, dims):
        fan_in, fan_out = fans(shape, dims)
        if consistent_rms is not None:
            return math.sqrt(max(fan_in, fan_out)) * consistent_rms
        return math.sqrt(max(1.0, fan_out / fan_in))

    def update(updates, state, params=None):
        leaves, treedef = optree.tree_flatten(updates)
        dims = dims_per_leaf(weight_dimension_numbers, updates)
        shapes = sharding.whole_shapes(leaves)  # a piece of heads scales as its whole matrix
        return treedef.unflatten([scale_of(s, d) * u for u, d, s in zip(leaves, dims, shapes)]), state

    spec = Spec("scale_by_shape", {"weight_dimension_numbers": weight_dimension_numbers,
                                   "consistent_rms": consistent_rms})
    return stateless_tx(update)._replace(spec=spec)


def _labels(dimension_numbers: DimensionNumbers) -> Callable[[Any], Any]:
    """Per leaf, ``"muon"`` or ``"adam"``: by the dimension numbers (None: Adam), or without them
    by rank (matrices: Muon). Under a hybrid plan the matrices are whole and the flat shards
    (1-D, pieces of the other params) go to Adam; a shard holding a piece of a matrix is a
    ``ValueError``, not a matrix stepped by Adam."""
    def labels(tree):
        if dimension_numbers is None:  # by rank: a flat shard's pieces are 1-D, so every matrix must be whole
            sharding.whole_tensors(tree_leaves(tree), "muon's routing of matrices", needs=lambda shape: len(shape) == 2)
            return tree_map(lambda x: "muon" if x.ndim == 2 else "adam", tree)
        cut = sharding.cut_tensors(tree_leaves(tree))
        if cut is not None and any(cut):
            if callable(dimension_numbers):  # a label wrong in itself is named before its pieces are
                whole = sharding.whole_tree()[0]
                check_labelled(local_dims(dimension_numbers, whole), whole)
            check_cut(dimension_numbers, tree, cut, pieces_ok=lambda d: heads_of(d) > 1)
        dims = dims_per_leaf(dimension_numbers, tree)
        if not any(cut or ()) and not sharding.pieces_unknown():  # whole leaves (a step's init checks nothing)
            check_labelled(dims, tree)
        return optree.tree_structure(tree).unflatten(["adam" if d is None else "muon" for d in dims])
    return labels


@alias
def muon(learning_rate: ScalarOrSchedule, ns_coeffs: Any = DEFAULT_NS_COEFFS, ns_steps: int = 5,
         beta: float = 0.95, eps: float = 1e-8, weight_decay: ScalarOrSchedule = 0.0, weight_decay_mask: Any = None,
         mu_dtype: torch.dtype | str | None = None, *, nesterov: bool = True, adaptive: bool = False,
         preconditioning: str = "frobenius", adam_b1: float = 0.9, adam_b2: float = 0.999,
         adam_eps_root: float = 0.0, adam_weight_decay: ScalarOrSchedule = 0.0,
         adam_learning_rate: ScalarOrSchedule | None = None, muon_weight_dimension_numbers: DimensionNumbers = None,
         consistent_rms: float | None = None, ns_method: str = "standard", ns_restarts: Any = None,
         mu_block_size: int = MU_BLOCK_SIZE) -> GradientTransformation:
    r"""Muon for the matrices, AdamW for the rest (mirrors ``optax.contrib.muon``).

    .. math::
        u_t = -\eta \big( s(W)\, \mathrm{NS}(\hat m_t) + \lambda W \big)

    on each matrix ``W`` (`scale_by_muon`, then `scale_by_shape`'s ``s``, decoupled decay and
    the learning rate); every other leaf takes ``adamw(adam_learning_rate, adam_b1, adam_b2,
    eps, adam_eps_root, weight_decay=adam_weight_decay, nesterov=nesterov)``.

    Args:
        learning_rate: a float or a schedule.
        ns_coeffs: the Newton-Schulz coefficients, a table of them, or a preset's name
            (``"standard"``, ``"dion"``, ``"polar_express"``; see ``NS_COEFFS_PRESETS``).
        ns_steps, beta, eps, nesterov, adaptive, preconditioning: as in `scale_by_muon`.
        mu_dtype: as in `scale_by_muon` (``"int8"``: 8-bit Muon; the AdamW of the other leaves
            then keeps its moments in their own dtype).
        ns_method, ns_restarts, mu_block_size: as in `scale_by_muon`.
        weight_decay, weight_decay_mask: decoupled decay of the matrices, and where.
        adam_b1, adam_b2, adam_eps_root, adam_weight_decay, adam_learning_rate: the AdamW of the
            other leaves (``adam_learning_rate=None``: ``learning_rate``).
        muon_weight_dimension_numbers: which leaves are Muon's and how they read as matrices: a
            `MuonDimensionNumbers` tree (None: Adam) or a function of the params returning one;
            ``None``: the 2-D leaves, each ``(in, out)``. ``heads=H`` makes a weight H matrices
            (per-head Muon: each attention head's rows of Q, K, V orthogonalised alone).
        consistent_rms: see `scale_by_shape`.

    Returns:
        ``partition({"muon": ..., "adam": ...})``, whose state is Optax's
        (``PartitionState`` of ``MaskedState`` s). ``torch.optim.Muon`` takes a different step
        (no bias correction, ``lr * weight_decay`` decay, shape ``(out, in)``): see `from_torch`.

    Reference: Jordan et al., Muon: An optimizer for hidden layers in neural networks, 2024;
    Liu et al., Muon is Scalable for LLM Training, 2025.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.muon(0.1)
        >>> params = {"w": torch.eye(2) * 3, "b": torch.ones(2)}
        >>> u, _ = tx.update({"w": torch.eye(2), "b": torch.ones(2)}, tx.init(params), params)
        >>> [round(x, 3) for x in u["w"].diagonal().tolist()]  # the matrix: Newton-Schulz of I / sqrt(2)
        [-0.111, -0.111]
        >>> u["b"]  # the vector: AdamW, nesterov as Muon's momentum
        tensor([-0.1474, -0.1474])
    """
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in NS_COEFFS_PRESETS:
            raise ValueError(f"unknown ns_coeffs preset {ns_coeffs!r}; choose one of {sorted(NS_COEFFS_PRESETS)}")
        ns_coeffs = NS_COEFFS_PRESETS[ns_coeffs]
    dims = MuonDimensionNumbers() if muon_weight_dimension_numbers is None else muon_weight_dimension_numbers
    matrices = chain(
        scale_by_muon(ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov, adaptive=adaptive,
                      preconditioning=preconditioning, weight_dimension_numbers=dims, ns_method=ns_method,
                      ns_restarts=ns_restarts, mu_block_size=mu_block_size),
        scale_by_shape(dims, consistent_rms),
        T.add_decayed_weights(weight_decay, weight_decay_mask),
        T.scale_by_learning_rate(learning_rate))
    adam_mu_dtype = None if mu_dtype in ("int8", torch.int8) else mu_dtype
    others = adamw(learning_rate if adam_learning_rate is None else adam_learning_rate, adam_b1, adam_b2, eps,
                   adam_eps_root, adam_mu_dtype, adam_weight_decay, nesterov=nesterov)
    return T.partition({"muon": matrices, "adam": others}, _labels(muon_weight_dimension_numbers))


@alias
def muon_8bit(learning_rate: ScalarOrSchedule, ns_coeffs: Any = DEFAULT_NS_COEFFS, ns_steps: int = 5,
              beta: float = 0.95, eps: float = 1e-8, weight_decay: ScalarOrSchedule = 0.0,
              weight_decay_mask: Any = None, *, nesterov: bool = True, adaptive: bool = False,
              preconditioning: str = "frobenius", adam_b1: float = 0.9, adam_b2: float = 0.999,
              adam_eps_root: float = 0.0, adam_weight_decay: ScalarOrSchedule = 0.0,
              adam_learning_rate: ScalarOrSchedule | None = None,
              muon_weight_dimension_numbers: DimensionNumbers = None, consistent_rms: float | None = None,
              ns_method: str = "standard", ns_restarts: Any = None,
              mu_block_size: int = MU_BLOCK_SIZE) -> GradientTransformation:
    """8-bit Muon (Gupta et al., arXiv:2509.23106): `muon` with ``mu_dtype="int8"``, each
    matrix's momentum in blockwise linear int8 codes (``mu_block_size`` elements a float32 scale:
    about 1.002 bytes an element, a quarter of float32's), the other leaves' AdamW at full
    precision. Every argument is `muon`'s."""
    return muon(learning_rate, ns_coeffs, ns_steps, beta, eps, weight_decay, weight_decay_mask, "int8",
                nesterov=nesterov, adaptive=adaptive, preconditioning=preconditioning, adam_b1=adam_b1,
                adam_b2=adam_b2, adam_eps_root=adam_eps_root, adam_weight_decay=adam_weight_decay,
                adam_learning_rate=adam_learning_rate, muon_weight_dimension_numbers=muon_weight_dimension_numbers,
                consistent_rms=consistent_rms, ns_method=ns_method, ns_restarts=ns_restarts,
                mu_block_size=mu_block_size)
