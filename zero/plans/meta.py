"""Parameter metadata: what a plan needs to know about a parameter, and nothing more.

`param_metas` reads it from torch tensors, param-group dicts, `nn.Module`s, JAX pytrees or a
plain mapping of shapes. Torch and JAX are only touched when the input is one of theirs (found
through `sys.modules`, never imported here), so planning a model needs neither library.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from zero.plans.checks import check_int

__all__ = ["ParamMeta", "param_metas", "param_groups", "itemsize"]

_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype given by name (``"float32"``, ``"bfloat16"`` ...)."""
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_ITEMSIZE)}") from None


@dataclass(frozen=True)
class ParamMeta:
    """What the plan layer knows about one parameter.

    ``dtype`` and ``device`` are strings (``"float32"``, ``"cuda:0"``) so metadata is hashable,
    JSON-friendly and independent of the framework it came from.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    device: str = "cpu"
    group: int = 0
    requires_grad: bool = True
    numel: int = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        shape = tuple(self.shape)
        for k, d in enumerate(shape):
            check_int(f"parameter {self.name!r}: shape[{k}]", d)
        check_int(f"parameter {self.name!r}: group", self.group)
        # Sizes are read constantly while planning 100k-tensor models: compute them once.
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "numel", math.prod(shape))
        object.__setattr__(self, "nbytes", self.numel * itemsize(self.dtype))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "device": self.device, "group": self.group, "requires_grad": self.requires_grad}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ParamMeta:
        return cls(d["name"], tuple(d["shape"]), d.get("dtype", "float32"), d.get("device", "cpu"),
                   d.get("group", 0), d.get("requires_grad", True))


def param_metas(obj: Any, *, device: str | None = None) -> list[ParamMeta]:
    """Metadata of every parameter in ``obj``, in the order an optimizer would see them.

    ``obj`` may be an iterable of tensors, a list of param-group dicts (``group`` is the dict's
    index), an ``nn.Module`` (names from ``named_parameters``), a JAX pytree of arrays or
    ``jax.ShapeDtypeStruct`` (names from key paths), or a mapping ``name -> shape`` (or
    ``name -> {"shape": ..., "dtype": ..., "requires_grad": ..., "group": ...}``).
    ``device`` overrides every parameter's device, e.g. to plan meta tensors as ``"cuda:0"``.
    """
    metas = _dispatch(obj)
    if not metas:
        raise ValueError(f"no parameters found in {type(obj).__name__} (empty input)")
    if device is not None:
        metas = [ParamMeta(m.name, m.shape, m.dtype, device, m.group, m.requires_grad) for m in metas]
    return metas


def _dispatch(obj: Any) -> list[ParamMeta]:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        return _from_tensors([(name, p, 0) for name, p in obj.named_parameters()])
    if _is_jax_tree(obj):
        return _from_jax(obj)
    if isinstance(obj, Mapping):
        return _from_mapping(obj)
    groups = param_groups(obj)
    return _from_tensors([(None, t, g) for g, group in enumerate(groups) for t in group["params"]])


def param_groups(params: Any) -> list[dict[str, Any]]:
    """``params`` as torch optimizers take them, normalised to a list of group dicts.

    ``params`` is an iterable of tensors (one group) or of param-group dicts; a group's
    ``"params"`` may be a single tensor or any iterable, and comes back as a list, so generators
    are read exactly once. Other keys of a group are kept. Which items are tensors is checked by
    `param_metas`; this only fixes the structure, and raises ``TypeError`` / ``ValueError``
    naming the group or position that does not fit.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or param-group dicts, not a single tensor")
    if isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Iterable):
        raise TypeError(f"cannot read parameters: got {type(params).__name__}, expected tensors, "
                        "param-group dicts, an nn.Module, a JAX pytree or a name -> shape mapping")
    items = list(params)
    if not any(isinstance(x, Mapping) for x in items):
        return [{"params": items}] if items else []
    for k, group in enumerate(items):
        if not isinstance(group, Mapping):
            raise TypeError(f"params mixes tensors and param-group dicts (params[{k}] is a "
                            f"{type(group).__name__}): pass one or the other")
        if "params" not in group:
            raise ValueError(f"param group {k} has no 'params' key")
    return [{**g, "params": _group_params(g["params"], torch)} for g in items]


def _group_params(params: Any, torch: Any) -> list:
    if torch is not None and isinstance(params, torch.Tensor):
        return [params]  # torch.optim accepts a bare tensor in a group
    if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        return [params]  # reported by position in param_metas
    return list(params)


def _from_tensors(entries: list[tuple[str | None, Any, int]]) -> list[ParamMeta]:
    torch = sys.modules.get("torch")
    seen: dict[int, int] = {}
    metas = []
    for i, (name, t, group) in enumerate(entries):
        label = name if name is not None else f"params[{i}]"
        if torch is None or not isinstance(t, torch.Tensor):
            raise TypeError(f"{label} is a {type(t).__name__}, not a torch.Tensor")
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(f"{label} is a sparse tensor ({t.layout}); only dense parameters are supported")
        if id(t) in seen:
            raise ValueError(f"{label} is the same tensor as params[{seen[id(t)]}] (duplicate parameter)")
        seen[id(t)] = i
        metas.append(ParamMeta(name if name is not None else str(i), tuple(t.shape),
                               str(t.dtype).removeprefix("torch."), str(t.device), group,
                               bool(t.requires_grad)))
    return metas


def _from_mapping(mapping: Mapping) -> list[ParamMeta]:
    metas = []
    for name, spec in mapping.items():
        if isinstance(spec, Mapping):
            if "shape" not in spec:
                raise ValueError(f"parameter {name!r}: spec {dict(spec)!r} has no 'shape'")
            metas.append(ParamMeta.from_dict({"name": str(name), **spec}))
        elif isinstance(spec, int) and not isinstance(spec, bool):
            metas.append(ParamMeta(str(name), (spec,)))
        elif isinstance(spec, (list, tuple)):
            metas.append(ParamMeta(str(name), tuple(spec)))
        else:
            raise TypeError(f"parameter {name!r}: expected a shape, got {type(spec).__name__}")
    return metas


def _is_jax_leaf(x: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def _is_jax_tree(obj: Any) -> bool:
    jax = sys.modules.get("jax")
    if jax is None or isinstance(obj, (str, bytes, Iterator)):  # an iterator (model.parameters()) is no pytree
        return False
    leaves = jax.tree_util.tree_leaves(obj)
    return bool(leaves) and all(_is_jax_leaf(x) for x in leaves)


def _from_jax(tree: Any) -> list[ParamMeta]:
    import jax

    metas = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path)
        if not _is_jax_leaf(leaf):
            raise TypeError(f"leaf {name} is a {type(leaf).__name__}, not a jax array or ShapeDtypeStruct")
        metas.append(ParamMeta(name, tuple(int(d) for d in leaf.shape), str(leaf.dtype), _jax_device(leaf)))
    return metas


def _jax_device(leaf: Any) -> str:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return "meta"  # an abstract ShapeDtypeStruct: no storage anywhere
    device = min(sharding.device_set, key=lambda d: d.id)
    return "cpu" if device.platform == "cpu" else f"cuda:{device.id}"
