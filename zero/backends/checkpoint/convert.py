"""Converting checkpoints between torch's DCP format and the Orbax format of `zero.backends.jax_mesh`.

``zero checkpoint convert SRC DST --to orbax`` turns a DCP checkpoint (zero's `save`, or FSDP2's
``dcp.save`` of ``get_state_dict``) into an Orbax checkpoint that `zero.backends.jax_mesh.restore`
continues with the matching Optax rule; ``--to dcp`` does the reverse, for `load`. Params keep
their dotted names and shapes. Both directions stream: one param's tensors are in memory at a
time (DCP loads one key per call; Orbax gets one item per param; DCP's writer asks a planner
for each tensor as it writes it).

State names: torch's ``exp_avg`` / ``exp_avg_sq`` / ``step`` of Adam and AdamW are Optax's
``0.mu`` / ``0.nu`` / ``0.count`` (of ``optax.adam`` / ``adamw``), SGD's ``momentum_buffer`` is
``0.trace`` (of ``optax.sgd(momentum=...)``); other torch state (AMSGrad's maximum, master
weights) is a ``ValueError`` naming it. A `zero.functional` rule's state is saved under Optax's
own paths already and passes as it is (``zero.functional.adamw`` injects its hyperparameters: it
is ``optax.inject_hyperparams(optax.adamw)``'s state, whose ``hyperparams`` the checkpoint keeps as
its param groups' settings, as torch keeps them, ``lr`` for ``learning_rate``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from zero.backends.checkpoint.dcp_pieces import quiet
from zero.backends.checkpoint.files import read_metadata
from zero.backends.precision import MASTER_KEY

__all__ = ["to_orbax", "to_dcp", "TORCH_TO_OPTAX"]

TORCH_TO_OPTAX = {"exp_avg": "0.mu", "exp_avg_sq": "0.nu", "step": "0.count", "momentum_buffer": "0.trace"}


@contextlib.contextmanager
def _one_process():
    """DCP run without a process group (one key at a time), without its notice that it assumes so."""
    with quiet(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


class _DcpSource:
    """A DCP checkpoint read key by key: its params (by the param groups' FQNs) and their state."""

    def __init__(self, path: str | os.PathLike):
        from zero.backends.checkpoint import integrity

        self.path = os.fspath(path)
        metadata = read_metadata(self.path)
        errors = integrity.verify(self.path, metadata)
        if errors:
            raise ValueError(f"the checkpoint at {self.path!r} is damaged, so nothing was converted: "
                             + "; ".join(errors[:4]))
        if not integrity.has_checksums(self.path):
            integrity.warn_unverified(self.path)
        self.md = metadata.state_dict_metadata
        model = sorted(k.removeprefix("model.") for k in self.md if k.startswith("model."))
        stated = [f for f in model if any(k.startswith(f"optim.state.{f}.") for k in self.md)]
        self.fqns = stated or model  # the params with optimizer state (all, for a rule that keeps none)
        if not self.fqns:
            raise ValueError(f"the DCP checkpoint at {self.path!r} holds no model tensors: save it with "
                             "zero.backends.checkpoint.save or dcp.save of get_state_dict's dicts")
        self.state: dict[str, list[str]] = {f: [] for f in self.fqns}
        for k in self.md:
            if k.startswith("optim.state."):
                fqn = max((f for f in self.fqns if k.startswith(f"optim.state.{f}.")), key=len, default=None)
                if fqn is None:
                    raise ValueError(f"the checkpoint's {k!r} belongs to no model param")
                self.state[fqn].append(k[len(f"optim.state.{fqn}."):])

    def load(self, key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        md = self.md[key]
        if not hasattr(md, "chunks"):
            raise ValueError(f"the checkpoint holds {key!r} as bytes, not a tensor")
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        with _one_process():
            dcp.load({key: out}, checkpoint_id=self.path, no_dist=True)
        return out

    def injected_settings(self, paths: Any) -> dict[str, np.ndarray]:
        """``hyperparams.<name>`` of a `zero.functional` rule that injects its hyperparameters (its
        state under ``inner_state``): the param groups' numeric settings, which must agree (Optax
        keeps one value of each)."""
        if not any(p.startswith("inner_state.") for p in paths):
            return {}
        from zero.backends.checkpoint.torch_state import read_groups

        count = len({k.split(".")[2] for k in self.md if k.startswith("optim.param_groups.")})
        out: dict[str, np.ndarray] = {}
        for k, group in enumerate(read_groups(read_metadata(self.path), self.path, count)[0]):
            for name, value in group.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    path = f"hyperparams.{'learning_rate' if name == 'lr' else name}"
                    _same_shared(out, path, np.asarray(float(value), dtype=np.float64), f"param group {k}")
        return out

    def optax_path(self, name: str, torch_names: bool) -> str:
        """Optax's path of state ``name``: torch.optim's names mapped (``torch_names``: the checkpoint
        holds some), a `zero.functional` rule's paths as they are."""
        if name == MASTER_KEY:
            raise ValueError("the checkpoint holds master weights (a low-precision model stepped in float32): a "
                             "mesh run has none; save it without masters (save(..., masters=False))")
        if not torch_names:
            return name
        if name not in TORCH_TO_OPTAX:
            raise ValueError(f"torch's optimizer state {name!r} has no Optax counterpart here (known: "
                             f"{sorted(TORCH_TO_OPTAX)}: Adam, AdamW, SGD with momentum)")
        return TORCH_TO_OPTAX[name]


def to_orbax(src: str | os.PathLike, dst: str | os.PathLike) -> dict:
    """The DCP checkpoint ``src`` as a `zero.backends.jax_mesh` Orbax checkpoint at ``dst`` (laid
    out per param); returns its metadata. Written beside ``dst`` and swapped into place."""
    import orbax.checkpoint as ocp

    from zero.backends.orbax_format import FORMAT, checksums, write_replacing

    source = _DcpSource(src)
    names = sorted({n for f in source.fqns for n in source.state[f]})
    torch_names = any(n in TORCH_TO_OPTAX for n in names)  # torch.optim's state, else a zero.functional rule's
    paths = {n: source.optax_path(n, torch_names) for n in names}
    # a leaf shaped like its param is per param (moments); others the params share (counts, Muon's
    # coefficients), saved under every param in DCP and once in Optax: every param's must agree
    shapes = {f: tuple(source.md[f"model.{f}"].size) for f in source.fqns}
    per_param = sorted({paths[n] for f in source.fqns for n in source.state[f]
                        if tuple(source.md[f"optim.state.{f}.{n}"].size) == shapes[f] and shapes[f] != ()
                        and n != "step"})
    settings = source.injected_settings(paths.values())
    shared = sorted(set(paths.values()) - set(per_param) | set(settings))
    nodes = [{"path": p, "per_param": True} for p in per_param] + [{"path": p, "per_param": False} for p in shared]
    meta = {"format": FORMAT, "layout": "params", "names": source.fqns, "shapes": [], "dtypes": [], "plan": None,
            "nodes": nodes, "has_params": True, "checksums": {}}

    def write(tmp: str) -> None:
        pytree = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        shared_values: dict[str, np.ndarray] = {}
        for i, fqn in enumerate(source.fqns):
            param = _numpy(source.load(f"model.{fqn}"))
            meta["shapes"].append(list(param.shape))
            meta["dtypes"].append(param.dtype.name)
            item = {"param": param}
            for name in source.state[fqn]:
                value, path = _numpy(source.load(f"optim.state.{fqn}.{name}")), paths[name]
                if path in shared:
                    _same_shared(shared_values, path, value.astype(np.int32) if name == "step" else value, fqn)
                    continue
                j = [n["path"] for n in nodes].index(path)
                nodes[j]["dtype"] = value.dtype.name
                nodes[j].setdefault("params", []).append(i)  # a node may hold some params only (Muon's: matrices)
                item[f"n{j}"] = value
            pytree.save(os.path.join(tmp, f"p{i}"), ocp.args.PyTreeSave(item))
            meta["checksums"].update(checksums(f"p{i}", item))
        for path, value in settings.items():  # the injected hyperparameters: one per group setting
            shared_values[path] = value
        if shared:  # Orbax refuses an empty item
            values = {f"s{j}": shared_values[n["path"]] for j, n in enumerate(nodes) if not n["per_param"]}
            pytree.save(os.path.join(tmp, "shared"), ocp.args.PyTreeSave(values))
            meta["checksums"].update(checksums("shared", values))
        ocp.Checkpointer(ocp.JsonCheckpointHandler()).save(os.path.join(tmp, "zero"), ocp.args.JsonSave(meta))

    write_replacing(dst, write)
    return meta


def _same_shared(seen: dict[str, np.ndarray], path: str, value: np.ndarray, fqn: str) -> None:
    """Torch keeps a step (and a `zero.functional` rule its shared leaves) per param; Optax one for
    all params: every param's must agree."""
    if path in seen and not np.array_equal(seen[path], value):
        raise ValueError(f"param {fqn!r} has {path!r} = {value.tolist()} but others {seen[path].tolist()}: Optax "
                         "keeps one for all params")
    seen[path] = value


def to_dcp(src: str | os.PathLike, dst: str | os.PathLike, *, names: str = "torch") -> None:
    """The `zero.backends.jax_mesh` Orbax checkpoint ``src`` as a DCP checkpoint at ``dst`` that
    `zero.backends.checkpoint.load` resumes: the model's params by name and the optimizer's state,
    under torch's names (``names="torch"``: for ``torch.optim.Adam`` / ``AdamW`` / ``SGD``) or
    Optax's paths (``"optax"``: for the `zero.functional` rule). The param groups' settings are
    not in it (a mesh run has no torch hyperparameters): the optimizer keeps its own."""
    from zero.backends.orbax_format import Source, check, read_meta, write_replacing

    if names not in ("torch", "optax"):
        raise ValueError(f"names must be 'torch' or 'optax', got {names!r}")
    meta = read_meta(src)
    check(src, meta)
    source = Source(src, meta)
    if not meta.get("has_params"):
        raise ValueError(f"the Orbax checkpoint at {os.fspath(src)!r} holds no params (save it with "
                         "jax_mesh.save(..., params=params)): a torch run needs them")
    back = {v: k for k, v in TORCH_TO_OPTAX.items()}
    entries: dict[str, tuple[tuple[int, ...], torch.dtype, Any]] = {}
    for i, (name, shape, dtype) in enumerate(zip(meta["names"], meta["shapes"], meta["dtypes"])):
        entries[f"model.{name}"] = (tuple(shape), _torch(np.zeros(0, dtype)).dtype, ("param", i))
        for node in meta["nodes"]:
            key = node["path"] if names == "optax" else back.get(node["path"])
            if key is None:
                raise ValueError(f"state {node['path']!r} has no torch name (known: {sorted(back)}); convert with "
                                 "names='optax' for a zero.functional rule")
            if node["per_param"]:
                if source.has(node["path"], i):  # a hybrid plan's nodes hold some params each (Muon's: matrices)
                    entries[f"optim.state.{name}.{key}"] = (tuple(shape), _torch(np.zeros(0, node["dtype"])).dtype,
                                                            ("node", node["path"], i))
            else:
                count = source.shared(node["path"])
                value = torch.tensor(float(count), dtype=torch.float32) if names == "torch" else _torch(count)
                entries[f"optim.state.{name}.{key}"] = (tuple(value.shape), value.dtype, ("value", value))
    write_replacing(dst, lambda tmp: _write_dcp(tmp, entries, source, meta))


def _write_dcp(path: str, entries: dict, source: Any, meta: dict) -> None:
    """``dcp.save`` of ``entries`` with each tensor read from ``source`` only when DCP writes it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    def value(what: tuple) -> torch.Tensor:
        if what[0] == "value":
            return what[1]
        if what[0] == "param":
            return _torch(source.param(what[1]).reshape(meta["shapes"][what[1]]))
        _, path, i = what
        n = int(np.prod(meta["shapes"][i], dtype=np.int64))
        return _torch(source.piece(path, i, 0, n).reshape(meta["shapes"][i]))

    class Lazy(DefaultSavePlanner):
        def resolve_data(self, write_item):  # the tensor, read now: one at a time
            return value(entries[write_item.index.fqn][2])

    from zero.backends.checkpoint.integrity import ChecksumWriter

    placeholders = {k: torch.empty((), dtype=dtype).expand(shape) for k, (shape, dtype, _) in entries.items()}
    with _one_process():
        dcp.save(placeholders, checkpoint_id=path, planner=Lazy(), no_dist=True, storage_writer=ChecksumWriter(path))


def orbax_entries(meta: dict) -> Iterator[dict]:
    """What an Orbax checkpoint of `zero.backends.jax_mesh` holds, from its metadata: per param
    and per-param state node its key, shape, dtype and bytes; each shared node."""
    for name, shape, dtype in zip(meta["names"], meta["shapes"], meta["dtypes"]):
        numel = int(np.prod(shape, dtype=np.int64))
        yield {"key": f"params.{name}", "shape": shape, "dtype": dtype,
               "bytes": numel * np.dtype(dtype).itemsize if meta.get("has_params", True) else 0}
        for node in meta["nodes"]:
            if node["per_param"]:
                yield {"key": f"state.{name}.{node['path']}", "shape": shape, "dtype": node["dtype"],
                       "bytes": numel * np.dtype(node["dtype"]).itemsize}
    for node in meta["nodes"]:
        if not node["per_param"]:
            yield {"key": f"state.{node['path']}", "shape": [], "dtype": "shared", "bytes": 0}
