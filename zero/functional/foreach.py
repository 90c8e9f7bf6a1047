"""Running a rule's maths on lists of tensors, with many small CPU tensors packed into one.

A rule's ``update`` writes its maths once, over lists of tensors with ``torch._foreach_*`` ops
(`foreach_map`). On CPU a foreach op is a loop that dispatches one op per tensor, about 2-3 us
each: 2,000 small tensors cost milliseconds per op whatever their size. So the small leaves of
each list are packed into one flat tensor before the maths runs and cut back into leaves after:
the maths then dispatches once for all of them. Leaves that are already consecutive
views of one buffer, as every output of a previous packed step is, pack without a copy; only
fresh inputs (the gradients) are copied. Large leaves, and every leaf on an accelerator (where
foreach ops are multi-tensor kernels), stay as they are; a call whose small leaves are not all
CPU tensors of one dtype per list runs unpacked.

Elementwise maths gives the same numbers either way: packing changes which tensors hold the
elements, not what is computed for each.

Traced calls (`traced`) take other paths, so an update can be differentiated, batched and
compiled as an Optax update is under ``jax.grad``, ``jax.vmap`` and ``jax.jit``:

- under ``torch.func`` (``grad``, ``vmap``, ``jacrev`` ...) nothing is packed (its tensors have no
  storage to pack) and the maths runs tensor by tensor (`ops`): torch has no batching rule
  for foreach ops, and their backward under ``torch.func`` mishandles a tensor scalar;
- under ``torch.compile`` nothing is packed (the compiler fuses the lists itself) and the foreach
  ops run as written, which the compiler lowers to fused loops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import optree
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["PACK_NUMEL", "foreach_map", "map_lists", "elementwise_map", "traced", "functorch_active", "ops",
           "as_scalar_for"]

# A leaf of at most this many elements is packed: copying it into a flat buffer (about 1 ns per
# element) costs less than the per-tensor dispatches it saves across a rule's ops.
PACK_NUMEL = 16384


def foreach_map(fn: Callable[..., Any], tree: Any, *rest: Any, outputs: int = 1) -> Any:
    """``fn`` on the leaves of ``tree`` and of ``rest`` (trees of the same structure), as lists.

    ``fn`` takes one list of tensors per tree and returns a sequence of tensors, or with
    ``outputs=k`` a tuple of ``k`` sequences; each becomes a tree like ``tree``. Its maths must be
    elementwise: the lists it gets may hold packed flat tensors instead of the leaves (see the
    module's docstring). Without leaves, ``fn`` is not called (foreach ops refuse empty lists).
    """
    leaves, treedef = optree.tree_flatten(tree)
    return map_lists(fn, treedef, [leaves] + [treedef.flatten_up_to(other) for other in rest], outputs)


def map_lists(fn: Callable[..., Any], treedef: Any, lists: list[list[Any]], outputs: int = 1) -> Any:
    """`foreach_map` given the trees already flattened: ``lists`` of leaves in ``treedef``'s order."""
    leaves = lists[0]
    if not leaves:
        empty = optree.tree_unflatten(treedef, [])
        return empty if outputs == 1 else (empty,) * outputs
    if traced():
        result = fn(*lists)
        trees = [optree.tree_unflatten(treedef, list(out)) for out in ([result] if outputs == 1 else result)]
        return trees[0] if outputs == 1 else tuple(trees)
    packing = _Packing.of(leaves)
    packed = None if packing is None else packing.pack(lists)
    result = fn(*(lists if packed is None else packed))
    results = [result] if outputs == 1 else list(result)
    if packed is not None:
        cut: dict[int, list] = {}  # one cut per distinct output list: a rule may return one list twice
        for out in results:
            if id(out) not in cut:
                cut[id(out)] = packing.unpack(out)
        results = [cut[id(out)] for out in results]
    trees = [optree.tree_unflatten(treedef, list(out)) for out in results]
    return trees[0] if outputs == 1 else tuple(trees)


def elementwise_map(fn: Callable[..., torch.Tensor], tree: Any, *rest: Any) -> Any:
    """``tree_map(fn, tree, *rest)`` for an elementwise ``fn`` of single tensors, run on packed
    tensors where `foreach_map` packs (few dispatches for many small leaves)."""
    return foreach_map(lambda *lists: [fn(*xs) for xs in zip(*lists)], tree, *rest)


# read once a call of every rule's every op: two attribute lookups fewer each (the compiler knows
# these functions by identity, so it reads them as it reads ``torch.compiler.is_compiling()``)
_compiling = torch.compiler.is_compiling
_interpreter = torch._C._functorch.peek_interpreter_stack


def traced() -> bool:
    """Whether ``torch.compile`` or a ``torch.func`` transform is tracing the caller.

    Rules read this to keep their scalars as tensors (a step count read with ``int()`` would stop
    the compiler, and recompile at every step) and `map_lists` to step aside from packing. Eager
    calls, plain autograd included, are not traced.
    """
    return _compiling() or _interpreter() is not None


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev`` ...) is running."""
    return _interpreter() is not None


def as_scalar_for(scalar: Any, t: torch.Tensor) -> Any:
    """``scalar`` as it may multiply ``t`` without changing its dtype: a 0-d floating tensor is
    cast to ``t``'s floating dtype, as a Python number is read in it (a float64 tensor times a
    float32 tensor of shape ``()`` would give float64); other values as they are."""
    if (isinstance(scalar, torch.Tensor) and scalar.dim() == 0 and scalar.is_floating_point()
            and t.is_floating_point() and scalar.dtype != t.dtype):
        return scalar.to(t.dtype)
    return scalar


def _per_tensor(name: str, args: tuple, kwargs: dict) -> Any:
    """``torch._foreach_<name>(*args, **kwargs)`` as ``torch.<name>`` on each index of its lists.

    Under ``torch.func`` an in-place op (``mul_``) puts its results in the list it was given
    instead of writing to its tensors. The rules modify only lists of their own temporaries in
    place (see `zero.functional.elementwise`), so this is the same step, and it stays pure for
    ``vmap`` (which refuses to write a batched result into an unbatched tensor).
    """
    inplace = name.endswith("_")
    op = name[:-1] if inplace else name
    one = _PER_TENSOR.get(op) or getattr(torch, op)
    lists = args[0]
    out = [one(*(a[i] if isinstance(a, (list, tuple)) else as_scalar_for(a, x) for a in args),
               **{k: as_scalar_for(v, x) for k, v in kwargs.items()}) for i, x in enumerate(lists)]
    if not inplace:
        return out
    if functorch_active() and not torch.compiler.is_compiling():
        for i, t in enumerate(out):
            lists[i] = t
    else:  # a compiled update: the compiler may hold the list as a tuple; it fuses the copies away
        for t, new in zip(lists, out):
            t.copy_(new)
    return None


# foreach ops whose single-tensor form is not ``torch.<op>`` of the same arguments
_PER_TENSOR = {
    "norm": lambda x, ord=2, dtype=None: torch.linalg.vector_norm(x, ord, dtype=dtype),
    "zero": torch.zeros_like,
    "add": lambda x, y, alpha=1: x + alpha * y if isinstance(alpha, torch.Tensor) else torch.add(x, y, alpha=alpha),
    "addcmul": lambda x, a, b, value=1: torch.addcmul(x, a, b, value=value),
    "addcdiv": lambda x, a, b, value=1: torch.addcdiv(x, a, b, value=value),
}

# foreach ops that take a 0-d tensor as their scalar (an overload ``.Tensor``) and whose
# compiled form handles one; others given a tensor scalar run tensor by tensor
_TENSOR_SCALAR = {"mul", "mul_", "div", "div_", "add", "add_", "sub", "sub_", "pow", "pow_", "maximum", "maximum_",
                  "minimum", "minimum_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_"}


def _foreach_op(name: str) -> Callable[..., Any]:
    native = getattr(torch, "_foreach_" + name)

    def op(*args: Any, **kwargs: Any) -> Any:
        if not _compiling():  # eager: torch's op unless a transform runs or a scalar is a tensor
            if _interpreter() is None and not _tensor_in(args, kwargs):
                return native(*args, **kwargs)
            return _per_tensor(name, args, kwargs)
        if not _tensor_in(args, kwargs):
            return native(*args, **kwargs)
        if name in _TENSOR_SCALAR and not kwargs and len({t.dtype for t in args[0]}) == 1:
            return native(args[0], *(as_scalar_for(a, args[0][0]) for a in args[1:]))
        return _per_tensor(name, args, kwargs)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``torch._foreach_{name}``, tensor by tensor where it cannot run (see `ops`)."
    return op


def _tensor_in(args: tuple, kwargs: dict) -> bool:
    """Whether a foreach op's scalar arguments (all but its first list) hold a tensor."""
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            return True
    return bool(kwargs) and any(isinstance(v, torch.Tensor) for v in kwargs.values())


_OPS = ("abs", "add", "add_", "addcmul", "addcmul_", "addcdiv", "addcdiv_", "clamp_max", "clamp_min", "clamp_min_",
        "div", "div_", "exp", "lerp", "lerp_", "maximum", "maximum_", "minimum", "minimum_", "mul", "mul_", "neg",
        "norm", "pow", "pow_", "reciprocal", "rsqrt", "rsqrt_", "sign", "sqrt", "sqrt_", "sub", "sub_", "zero_")

ops = SimpleNamespace(**{name: _foreach_op(name) for name in _OPS})
ops.__doc__ = """torch's foreach ops by their short names (``ops.mul(xs, 2.0)`` is
``torch._foreach_mul(xs, 2.0)``), which every rule calls instead of torch's.

Each runs torch's foreach op where it can, and the same maths tensor by tensor where it cannot:
under ``torch.func`` (torch has no batching rule for foreach ops, and their backward there
mishandles a tensor scalar), and given a 0-d tensor as its scalar (a hyperparameter passed as a
tensor, to be differentiated or swept) unless ``torch.compile`` is tracing an op that takes one.
"""


class _Packing:
    """Which leaves are packed (the small ones, in order), and how to pack and cut lists of them.

    A list is packed when its small leaves are CPU tensors of one dtype, of the sizes of the
    first list's; else the whole call runs unpacked (mixed dtypes within a tree, accelerators,
    leaves autograd tracks). This runs at every update, so it reads few attributes per leaf.
    """

    def __init__(self, leaves: list[torch.Tensor], small: list[int], sizes: list[int]):
        self.leaves, self.small, self.sizes = leaves, small, sizes
        small_set = set(small)
        self.alone = [i for i in range(len(leaves)) if i not in small_set]
        self.one_dim = all(leaves[i].dim() == 1 for i in small)

    @classmethod
    def of(cls, leaves: list[Any]) -> _Packing | None:
        """The packing for lists like ``leaves``, or ``None`` when fewer than two leaves are small."""
        if len(leaves) < 2 or not all(isinstance(t, torch.Tensor) for t in leaves):
            return None
        numels = [t.numel() for t in leaves]
        small = [i for i, n in enumerate(numels) if 0 < n <= PACK_NUMEL]
        if len(small) < 2:
            return None
        return cls(leaves, small, [numels[i] for i in small])

    def pack(self, lists: Sequence[Sequence[Any]]) -> list[list[torch.Tensor]] | None:
        """Each list as one flat tensor of its small leaves, then its other leaves; ``None`` when
        a list cannot be packed."""
        packed = []
        for ts in lists:
            flat = self._flat([ts[i] for i in self.small])
            if flat is None:
                return None
            packed.append([flat] + [ts[i] for i in self.alone])
        return packed

    def unpack(self, packed: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The leaves back from `pack`'s layout: views of the flat tensor, in the leaves' shapes."""
        if len(packed) != 1 + len(self.alone):
            raise ValueError(f"a packed rule returned {len(packed)} tensors for {1 + len(self.alone)} packed inputs")
        out: list[Any] = [None] * len(self.leaves)
        if self.one_dim:  # one split: a single op for any number of leaves
            pieces = packed[0].split(self.sizes)
        else:  # views shaped like the leaves, made in one C++ loop (a Python view per leaf costs 3x more)
            pieces = _unflatten_dense_tensors(packed[0], [self.leaves[i] for i in self.small])
        for i, piece in zip(self.small, pieces):
            out[i] = piece
        for i, t in zip(self.alone, packed[1:]):
            out[i] = t
        return out

    def _flat(self, leaves: list[Any]) -> torch.Tensor | None:
        """``leaves`` as one 1-D tensor: a view when they lie back to back in memory in order (the
        outputs of a packed step do), else a copy; ``None`` when they are unfit to pack."""
        head = leaves[0]
        if not isinstance(head, torch.Tensor) or not head.is_cpu:
            return None
        grad = torch.is_grad_enabled()
        if grad and head.requires_grad:
            return None  # differentiating through an update: leave autograd the leaves
        width, at = head.element_size(), head.data_ptr()
        try:
            for t, n in zip(leaves, self.sizes):
                if t.data_ptr() != at or not t.is_contiguous():
                    break
                at += n * width
            else:
                return head.as_strided((sum(self.sizes),), (1,))
        except (AttributeError, RuntimeError):
            pass  # a leaf that is not a tensor (refused below), or neighbours not in one storage
        try:
            if [t.numel() for t in leaves] != self.sizes or len({t.dtype for t in leaves}) != 1:
                return None
        except AttributeError:  # a leaf that is not a tensor
            return None
        flat = torch.cat(leaves) if self.one_dim else _flatten_dense_tensors(leaves)
        return None if flat.device.type != "cpu" or (grad and flat.requires_grad) else flat
