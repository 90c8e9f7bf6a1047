"""Parameter metadata: what a plan needs to know about a parameter, and nothing more.

`param_metas` reads it from torch tensors, param-group dicts, `nn.Module`s, JAX pytrees or a
plain mapping of shapes. Torch and JAX are only touched when the input is one of theirs (found
through `sys.modules`, never imported here), so planning a model needs neither library.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from zero.plans.checks import check_int

__all__ = ["ParamMeta", "dotted", "param_metas", "param_groups", "itemsize", "gc_paused"]

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


class _Fields(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    group: int
    requires_grad: bool
    numel: int
    nbytes: int


class ParamMeta(_Fields):
    """What the plan layer knows about one parameter.

    ``dtype`` and ``device`` are strings (``"float32"``, ``"cuda:0"``) so metadata is hashable,
    JSON-friendly and independent of the framework it came from. ``numel`` and ``nbytes`` are
    derived from the rest when it is built.

    A metadata list for a 100k-tensor model is built, compared and hashed constantly while
    planning, so this is an immutable tuple (about 1 us to build, against 5 us for the frozen
    dataclass it replaced); equality and hashing are the fields'.
    """

    __slots__ = ()

    def __new__(cls, name: str, shape: Iterable[int], dtype: str = "float32", device: str = "cpu",
                group: int = 0, requires_grad: bool = True) -> ParamMeta:
        shape = tuple(shape)
        for d in shape:
            if type(d) is not int or d < 0:  # the common case costs two comparisons per dim
                _check_shape(name, shape)
        if type(group) is not int or group < 0:
            check_int(f"parameter {name!r}: group", group)
        return _built(name, shape, dtype, device, group, requires_grad, itemsize(dtype))

    def __repr__(self) -> str:
        return (f"ParamMeta(name={self.name!r}, shape={self.shape!r}, dtype={self.dtype!r}, "
                f"device={self.device!r}, group={self.group!r}, requires_grad={self.requires_grad!r})")

    def __getnewargs__(self) -> tuple:  # pickled as built: numel and nbytes are derived again
        return self.name, self.shape, self.dtype, self.device, self.group, self.requires_grad

    def _replace(self, **changes: Any) -> ParamMeta:  # through __new__, so numel/nbytes follow
        return ParamMeta(**{**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "device": self.device, "group": self.group, "requires_grad": self.requires_grad}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ParamMeta:
        return cls(d["name"], tuple(d["shape"]), d.get("dtype", "float32"), d.get("device", "cpu"),
                   d.get("group", 0), d.get("requires_grad", True))


def _built(name: str, shape: tuple[int, ...], dtype: str, device: str, group: int, requires_grad: bool,
           dtype_size: int) -> ParamMeta:
    """A `ParamMeta` from fields already checked (or read from a framework's own shape)."""
    numel = math.prod(shape)
    return tuple.__new__(ParamMeta, (name, shape, dtype, device, group, requires_grad, numel, numel * dtype_size))


def _check_shape(name: str, shape: tuple) -> None:
    for k, d in enumerate(shape):
        check_int(f"parameter {name!r}: shape[{k}]", d)


def param_metas(obj: Any, *, device: str | None = None) -> list[ParamMeta]:
    """Metadata of every parameter in ``obj``, in the order an optimizer would see them.

    ``obj`` may be an iterable of tensors, a list of param-group dicts (``group`` is the dict's
    index), an ``nn.Module`` (names from ``named_parameters``), a JAX pytree of arrays or
    ``jax.ShapeDtypeStruct`` (names from key paths), or a mapping ``name -> shape`` (or
    ``name -> {"shape": ..., "dtype": ..., "requires_grad": ..., "group": ...}``).
    ``device`` overrides every parameter's device, e.g. to plan meta tensors as ``"cuda:0"``.
    """
    with gc_paused():
        metas = _dispatch(obj)
    if not metas:
        raise ValueError(f"no parameters found in {type(obj).__name__} (empty input)")
    if device is not None:
        metas = [m._replace(device=device) for m in metas]
    return metas


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector while building many small objects.

    Building 100k metas or plan entries allocates enough to set off full collections, each of
    which walks the whole heap (a loaded model's tensors too) and together cost more than the
    building itself. What is built here holds no reference cycles, so nothing is left for the
    collector to find; its thresholds are unchanged, so it runs again as usual afterwards.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _dispatch(obj: Any) -> list[ParamMeta]:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        return _from_tensors([(name, p, 0) for name, p in obj.named_parameters()])
    leaves = _jax_leaves(obj)
    if leaves is not None:
        return _from_jax(leaves)
    if isinstance(obj, Mapping):
        return _from_mapping(obj)
    groups = param_groups(obj)
    return _from_tensors([(names[i] if names else None, t, g) for g, group in enumerate(groups)
                          for names in [group.get("param_names")] for i, t in enumerate(group["params"])])


def param_groups(params: Any) -> list[dict[str, Any]]:
    """``params`` as torch optimizers take them, normalised to a list of group dicts.

    ``params`` is an iterable of tensors (one group) or of param-group dicts, or an ``nn.Module``
    (one group of its ``named_parameters()``); a group's
    ``"params"`` may be a single tensor or any iterable, and comes back as a list, so generators
    are read exactly once. Named params (``(name, tensor)`` pairs) come back as the tensors and
    the group's ``"param_names"``, as torch keeps them. Other keys of a group are kept. Which
    items are tensors is checked by `param_metas`; this only fixes the structure, and raises
    ``TypeError`` / ``ValueError`` naming the group or position that does not fit.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or param-group dicts, not a single tensor")
    if torch is not None and isinstance(params, torch.nn.Module):
        return [_named({"params": list(params.named_parameters())})]  # one group, named as torch names them
    if isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Iterable):
        raise TypeError(f"cannot read parameters: got {type(params).__name__}, expected tensors, "
                        "(name, tensor) pairs, param-group dicts or an nn.Module")
    items = list(params)
    if not any(isinstance(x, Mapping) for x in items):
        return [_named({"params": items})] if items else []
    for k, group in enumerate(items):
        if not isinstance(group, Mapping):
            raise TypeError(f"params mixes tensors and param-group dicts (params[{k}] is a "
                            f"{type(group).__name__}): pass one or the other")
        if "params" not in group:
            raise ValueError(f"param group {k} has no 'params' key")
    return [_named({**g, "params": _group_params(g["params"], torch)}) for g in items]


def _named(group: dict[str, Any]) -> dict[str, Any]:
    """A group of ``(name, param)`` pairs (``model.named_parameters()``, as torch optimizers take
    them) as its params and their ``"param_names"``; other groups as they are."""
    pairs = group["params"]
    if not pairs or not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in pairs):
        return group
    return {**group, "params": [p for _, p in pairs], "param_names": [n for n, _ in pairs]}


def _group_params(params: Any, torch: Any) -> list:
    if torch is not None and isinstance(params, torch.Tensor):
        return [params]  # torch.optim accepts a bare tensor in a group
    if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        return [params]  # reported by position in param_metas
    return list(params)


def _from_tensors(entries: list[tuple[str | None, Any, int]]) -> list[ParamMeta]:
    tensors = [t for _, t, _ in entries]
    _check_tensors(entries, tensors)
    # Column by column: each attribute read is one tight loop, and dtype and device names are made
    # once per distinct value. A torch shape holds non-negative ints already: no need to check it.
    shapes = [tuple(t.shape) for t in tensors]
    dtypes = [t.dtype for t in tensors]
    devices = [t.device for t in tensors]
    trainable = [t.requires_grad for t in tensors]
    dtype_names = {d: str(d).removeprefix("torch.") for d in set(dtypes)}
    sizes = {d: itemsize(name) for d, name in dtype_names.items()}
    device_names = {d: str(d) for d in set(devices)}
    return [_built(str(i) if name is None else name, shape, dtype_names[d], device_names[v], group, r, sizes[d])
            for i, ((name, _, group), shape, d, v, r) in enumerate(zip(entries, shapes, dtypes, devices, trainable))]


def _check_tensors(entries: list[tuple[str | None, Any, int]], tensors: list) -> None:
    """Every entry a dense tensor, none twice; checked in bulk, then searched for a culprit to name."""
    torch = sys.modules.get("torch")
    if (torch is not None and all(issubclass(kind, torch.Tensor) for kind in set(map(type, tensors)))
            and len(set(map(id, tensors))) == len(tensors) and {t.layout for t in tensors} <= {torch.strided}):
        return
    seen: dict[int, int] = {}
    for i, (name, t, _) in enumerate(entries):
        label = name if name is not None else f"params[{i}]"
        if torch is None or not isinstance(t, torch.Tensor):
            raise TypeError(f"{label} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise ValueError(f"{label} is a sparse tensor ({t.layout}); only dense parameters are supported")
        if id(t) in seen:
            raise ValueError(f"{label} is the same tensor as params[{seen[id(t)]}] (duplicate parameter)")
        seen[id(t)] = i


def _from_mapping(mapping: Mapping) -> list[ParamMeta]:
    metas = []
    for name, spec in mapping.items():
        if type(spec) is tuple:  # the common case first: a shape
            metas.append(ParamMeta(str(name), spec))
        elif isinstance(spec, Mapping):
            if "shape" not in spec:
                raise ValueError(f"parameter {name!r}: spec {dict(spec)!r} has no 'shape'")
            metas.append(ParamMeta.from_dict({"name": str(name), **spec}))
        elif isinstance(spec, int) and not isinstance(spec, bool):
            metas.append(ParamMeta(str(name), (spec,)))
        elif isinstance(spec, (list, tuple)):
            metas.append(ParamMeta(str(name), spec))
        else:
            raise TypeError(f"parameter {name!r}: expected a shape, got {type(spec).__name__}")
    return metas


def _jax_leaves(obj: Any) -> list[tuple[Any, Any]] | None:
    """``obj``'s (key path, leaf) pairs if it is a non-empty JAX pytree of arrays or
    ``ShapeDtypeStruct``s, else None."""
    jax = sys.modules.get("jax")
    if jax is None or isinstance(obj, (str, bytes, Iterator)) or _is_shape_mapping(obj):
        return None  # an iterator (model.parameters()) is no pytree; a shape mapping is read as shapes
    leaves = jax.tree_util.tree_flatten_with_path(obj)[0]
    kinds = (jax.Array, jax.ShapeDtypeStruct)
    return leaves if leaves and all(isinstance(x, kinds) for _, x in leaves) else None


def _is_shape_mapping(obj: Any) -> bool:
    """Cheaply tell ``{name: shape}`` from a pytree before flattening 100k shapes as one."""
    return isinstance(obj, Mapping) and bool(obj) and isinstance(next(iter(obj.values())), (tuple, list, int))


def _from_jax(leaves: list[tuple[Any, Any]]) -> list[ParamMeta]:
    """Metas in ``tree_flatten`` order (so ``treedef.unflatten`` maps per-param values back to the
    tree), named by their key paths in the dotted form torch's ``named_parameters`` uses."""
    dtypes: dict[Any, str] = {}  # str(numpy dtype) costs microseconds: once per distinct dtype
    metas, paths = [], {}
    for path, leaf in leaves:
        if leaf.dtype not in dtypes:
            dtypes[leaf.dtype] = str(leaf.dtype)
        name = dotted(path)
        if name in paths:
            raise ValueError(f"two leaves of the pytree are both named {name!r} in dotted form ({paths[name]} and "
                             f"{_keystr(path)}): rename one key")
        paths[name] = _keystr(path)
        metas.append(ParamMeta(name, leaf.shape, dtypes[leaf.dtype], _jax_device(leaf)))  # ints already
    return metas


def dotted(path: Any) -> str:
    """A JAX key path as torch names params: ``enc.w``, ``layers.0.kernel`` (from ``['enc']['w']`` ...)."""
    return ".".join(str(_key(k)) for k in path)


def _key(entry: Any) -> Any:
    for field in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
        if hasattr(entry, field):
            return getattr(entry, field)
    return entry


def _keystr(path: Any) -> str:
    from jax.tree_util import keystr

    return keystr(path)


def _jax_device(leaf: Any) -> str:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return "meta"  # an abstract ShapeDtypeStruct: no storage anywhere
    device = min(sharding.device_set, key=lambda d: d.id)
    return "cpu" if device.platform == "cpu" else f"cuda:{device.id}"
