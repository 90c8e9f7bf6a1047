"""`save` and `load`: a checkpoint directory, checked against the model before anything loads;
`read_metadata` and `describe` read one without a process group."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import shutil
import uuid
from math import prod
from typing import Any

import torch
from torch import nn

from zero.backends import comm
from zero.backends.checkpoint import integrity
from zero.backends.checkpoint.dcp import get_state_dict, resolve_options, set_state_dict, unwrap_post_local_sgd
from zero.backends.checkpoint.dcp_pieces import quiet
from zero.backends.checkpoint.integrity import ChecksumWriter
from zero.backends.checkpoint.staging import kept_staging
from zero.backends.checkpoint.torch_state import from_torch, loading, saved_by
from zero.backends.precision import MASTER_KEY

__all__ = ["save", "load", "read_metadata", "describe"]


def save(checkpoint_id: Any, model: nn.Module, optimizer: Any, *, masters: bool = True, options: Any = None,
         async_save: bool = False, keep_staging: bool = False, **dcp_kwargs: Any) -> Any:
    """`get_state_dict` saved with ``torch.distributed.checkpoint.save`` under ``{"model": ...,
    "optim": ...}``, FSDP2's convention. Call on every rank.

    ``async_save``: DCP's ``async_save``. It returns once the state is copied (the only time
    training waits); the write, the checksums, ``.metadata`` and the swap into place finish on a
    background thread, and the returned future completes after them (its ``result()`` raises what
    went wrong). Steps taken meanwhile do not change what is written. A later save (either kind)
    first waits for this process's background saves, so saves land in the order they were asked.
    ``keep_staging=True`` keeps the copy's host memory for the next background save of the same
    layout (`zero.backends.checkpoint.staging`): every save after the first blocks only while the
    state is copied into it, not while fresh memory is handed out, at the cost of that memory held
    between saves.

    Saving over a checkpoint replaces it whole or not at all: the new one is written into a
    sibling directory (``<checkpoint_id>.saving-<id>``) and renamed into place by group rank 0
    once every rank has written and DCP's ``.metadata`` is down; until then the old checkpoint
    stays as it was, and a save that dies leaves it untouched (and the sibling behind, which the
    next save to the same place removes). ``dcp_kwargs`` go to DCP; with your own
    ``storage_writer`` (and ``checkpoint_id=None``) DCP writes where the writer says, in place."""
    import torch.distributed.checkpoint as dcp

    if keep_staging and not async_save:
        raise ValueError("keep_staging=True keeps a background save's copy of the state for the next one: it needs "
                         "async_save=True (a synchronous save copies nothing)")
    if keep_staging and "async_stager" in dcp_kwargs:
        raise ValueError("keep_staging=True and async_stager= both say where the state is copied: give one")
    _wait_for_background_saves()
    with quiet():
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options, masters=masters)
        inner = unwrap_post_local_sgd(optimizer)[0]
        model_sd = _written_here(model_sd, group_of(inner))
        group = comm.twin_group(group_of(inner)) if async_save else group_of(inner)
        final = None if checkpoint_id is None or "storage_writer" in dcp_kwargs else os.fspath(checkpoint_id)
        target = checkpoint_id if final is None else _staging(final, group)
        if final is not None:  # zero's writer: DCP's, each piece hashed (`integrity`)
            dcp_kwargs["storage_writer"] = ChecksumWriter(target)
        if not async_save:
            metadata = dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=target,
                                process_group=group, **dcp_kwargs)
            if final is not None:
                _publish(target, final, group)
            return metadata
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        # DCP's default stager cannot copy a ShardedTensor; these copy every piece before returning
        dcp_kwargs.setdefault("async_stager", kept_staging() if keep_staging else BlockingAsyncStager())
        # the save's collectives run on a thread while training's run on the optimizer's group
        future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=target,
                                process_group=group, **dcp_kwargs)
        if final is None:
            _BACKGROUND.append(getattr(future, "upload_completion", future))
            return future
        rank = comm.group_rank(group)
        if hasattr(future, "upload_completion"):  # DCP's AsyncSaveResponse (its newer checkpointer types)
            done = _published_when_done(future.upload_completion, target, final, rank)
            _BACKGROUND.append(done)
            return dataclasses.replace(future, upload_completion=done)
        done = _published_when_done(future, target, final, rank)
        _BACKGROUND.append(done)
        return done


def _written_here(model_sd: dict[str, Any], group: Any) -> dict[str, Any]:
    """``model_sd`` with each replicated tensor (a plain tensor every rank of ``group`` holds alike:
    a ZeRO or DDP model's) kept on one rank only, the ranks' bytes balanced (largest first); a
    DTensor (the rank's own piece) and non-tensors stay. DCP writes a replicated tensor once anyway
    (its dedup, planned after the state is staged): dropping the copies first spares every rank
    staging the whole model for an asynchronous save, and planning it for a synchronous one."""
    size = comm.group_size(group) if comm.in_group(group) else 1
    if size == 1:
        return model_sd
    rank, loads, out = comm.group_rank(group), [0] * size, {}
    plain = {k: v for k, v in model_sd.items() if type(v) in (torch.Tensor, nn.Parameter)}
    for key in sorted(plain, key=lambda k: (-plain[k].nbytes, k)):  # the same order on every rank
        writer = loads.index(min(loads))
        loads[writer] += plain[key].nbytes
        if writer == rank:
            out[key] = plain[key]
    return {k: v for k, v in model_sd.items() if k not in plain or k in out}


# This process's background saves, oldest first. A save starts only once they have finished: two
# writes in flight would run their collectives on one group from two threads, and an older save
# finishing after a newer one would swap the older checkpoint into place over it.
_BACKGROUND: list[Any] = []


def _wait_for_background_saves() -> None:
    """Wait for every background save of this process (each rank waits for its own, so the ranks
    start the next save together); their errors stay with their futures."""
    while _BACKGROUND:
        with contextlib.suppress(Exception):
            _BACKGROUND.pop(0).result()


def group_of(optimizer: Any) -> Any:
    """The group a sharded optimizer's ranks save and load over: a ZeroRedundancyOptimizer's, or
    the mesh's of a `zero.functional.Optimizer` over FSDP2's params (HSDP's: every replica's ranks)."""
    if hasattr(optimizer, "rank_state"):
        return optimizer.process_group
    executor = getattr(optimizer, "executor", None)
    if executor is None:
        raise TypeError(f"optimizer must be a zero.backends.ZeroRedundancyOptimizer or a zero.functional.Optimizer "
                        f"over FSDP2's params, got {type(optimizer).__name__}")
    return executor.mesh_group


def _staging(final: str, group: Any) -> str:
    """The sibling directory this save writes into, one name agreed by every rank (rank 0's)."""
    if comm.group_rank(group) == 0 and os.path.exists(os.path.join(final, ".metadata")):
        # with a whole checkpoint in place, siblings are leftovers: a save to this place that died,
        # or one cut short after its swap (otherwise they may hold the only whole one: kept)
        parent, name = os.path.split(os.path.abspath(final))
        for kind in ("saving", "replaced"):
            for stale in glob.glob(os.path.join(glob.escape(parent), f"{glob.escape(name)}.{kind}-*")):
                shutil.rmtree(stale, ignore_errors=True)
    return comm.broadcast_object(f"{final}.saving-{uuid.uuid4().hex[:12]}", group)


def _publish(staging: str, final: str, group: Any) -> None:
    """Rank 0 swaps the finished save into place; every rank learns how it went before returning."""
    error = _swap(staging, final) if comm.group_rank(group) == 0 else None
    error = comm.broadcast_object(error, group)
    if error is not None:
        raise RuntimeError(f"the checkpoint was written to {staging!r} but could not replace {final!r}: {error}")


def _swap(staging: str, final: str) -> str | None:
    """``staging`` renamed to ``final``; an old ``final`` is moved aside first and removed after
    (between the two renames both checkpoints are whole on disk). The error's text, or None."""
    try:
        old = None
        if os.path.lexists(final):
            old = f"{final}.replaced-{uuid.uuid4().hex[:12]}"
            os.rename(final, old)
        os.rename(staging, final)
        if old is not None:
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def _published_when_done(future: Any, staging: str, final: str, rank: int) -> Any:
    """A future that completes after ``future`` and (on rank 0) the swap into place."""
    from concurrent.futures import Future

    done: Future = Future()

    def finish(saved: Any) -> None:
        try:
            result = saved.result()
            error = _swap(staging, final) if rank == 0 else None
            if error is not None:
                raise RuntimeError(f"the checkpoint was written to {staging!r} but could not replace {final!r}: "
                                   f"{error}")
            done.set_result(result)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            done.set_exception(e)

    future.add_done_callback(finish)
    return done


def load(checkpoint_id: Any, model: nn.Module, optimizer: Any, *, options: Any = None, verify: bool = True) -> None:
    """Load a checkpoint `save` (or FSDP2, or ``dcp.save`` of `get_state_dict`'s dicts) wrote,
    at any world size and plan. Call on every rank. ``optimizer`` may be a ``torch.optim`` class
    too (over FSDP2's params, as tested): a `zero.functional` rule's state then continues in the
    class with the same maths (`zero.backends.checkpoint.into_torch`).

    It is checked first, before anything is loaded, with the same ``ValueError`` on every rank: a
    changed byte (its checksum: `zero.backends.checkpoint.integrity`, each rank hashing its share),
    a damaged ``.metadata``, a missing or short data file, an unfinished save, a tensor whose chunks
    do not cover it, an FQN of another model (missing, extra or reshaped) or state of another
    optimizer, each named. A checkpoint without checksums (FSDP2's, an older zero's) loads with a
    warning. ``verify=False`` skips the data files' checks (not the others). Master weights absent
    from the checkpoint start again from the loaded params."""
    import torch.distributed.checkpoint as dcp

    from zero.backends.checkpoint.into_torch import is_torch_optimizer, load_into_torch

    metadata = read_metadata(checkpoint_id)
    if is_torch_optimizer(optimizer):  # a zero.functional rule's checkpoint, continued by torch's class
        if verify:
            _verified(checkpoint_id, metadata, None)
        return load_into_torch(checkpoint_id, model, optimizer, metadata)
    inner = unwrap_post_local_sgd(optimizer)[0]
    if verify:
        _verified(checkpoint_id, metadata, group_of(inner))
    with quiet():
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        if _missing(metadata, {"model": model_sd, "optim": optim_sd}, masters_only=True):
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options, masters=False)
        translated = (from_torch(metadata, checkpoint_id, inner, optim_sd)  # torch.optim's state, same maths
                      or _into_torch_maths(metadata, checkpoint_id, inner, optim_sd))  # or the other way
        request = {"model": model_sd, "optim": optim_sd if translated is None else translated.request}
        _check_against(metadata, request, resolve_options(options).strict, lambda: _whose(metadata, checkpoint_id,
                                                                                           inner))
        # every tensor is there (checked above); settings absent (a checkpoint converted from a JAX
        # run has no torch hyperparameters) keep the optimizer's own
        partial = any(k not in metadata.state_dict_metadata for k in _flat(request))
        _dcp_load(dcp, request, checkpoint_id, dcp.DefaultLoadPlanner(allow_partial_load=partial), group_of(inner))
        if translated is not None:
            translated.finish()
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)


def _into_torch_maths(metadata: Any, path: Any, optimizer: Any, optim_sd: dict) -> Any:
    """A `zero.functional` rule's state loading into one of zero's optimizers that steps a torch
    class's maths (`into_torch.ZeroTorchLoad`), or None when that is not the case."""
    from zero.backends.checkpoint.into_torch import ZeroTorchLoad, torch_class_stepped
    from zero.backends.checkpoint.torch_state import is_torch_state, state_keys

    name = torch_class_stepped(optimizer)
    if name is None or is_torch_state(metadata) or not state_keys(metadata):
        return None
    return ZeroTorchLoad(metadata, path, name, optim_sd)


def _verified(path: Any, metadata: Any, group: Any) -> None:
    """Each rank checks its share of the checkpoint's pieces; every rank raises the same
    ``ValueError`` if any is wrong (`integrity.verify`), before anything is loaded."""
    share = (comm.group_rank(group), comm.group_size(group)) if comm.in_group(group) else (0, 1)
    errors = integrity.verify(path, metadata, share)
    if share[1] > 1:
        errors = sorted({e for got in comm.all_gather_object(errors, group) for e in got})
    if errors:
        more = f" (and {len(errors) - 4} more)" if len(errors) > 4 else ""
        raise ValueError(f"the checkpoint at {os.fspath(path)!r} is damaged, so nothing was loaded: "
                         + "; ".join(errors[:4]) + more)
    if not integrity.has_checksums(path):
        integrity.warn_unverified(path)


def _dcp_load(dcp: Any, request: dict, path: Any, planner: Any, group: Any) -> None:
    """``dcp.load``, its ``CheckpointException`` (a ``BaseException``, raised with every rank's
    traceback) a ``ValueError`` naming the checkpoint and each rank's failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(request, checkpoint_id=path, planner=planner, process_group=group)
    except CheckpointException as e:
        failures = getattr(e, "failures", {}) or {}
        said = "; ".join(f"rank {r}: {type(f).__name__}: {f}" for r, f in sorted(failures.items())) or str(e)
        raise ValueError(f"loading the checkpoint at {os.fspath(path)!r} failed ({said})") from None


def _whose(metadata: Any, path: Any, optimizer: Any) -> str:
    return f"its optimizer state was saved by {saved_by(metadata, path)}, and this optimizer steps {loading(optimizer)}"


def read_metadata(checkpoint_id: Any) -> Any:
    """DCP's metadata of a checkpoint directory; a ``ValueError`` when its save did not finish, or
    when ``.metadata`` is truncated, unreadable or changed since the save (`integrity.read_metadata`)."""
    path = os.fspath(checkpoint_id)
    if not os.path.isdir(path):
        aside = sorted(glob.glob(f"{glob.escape(path)}.replaced-*"))
        raise ValueError(f"no checkpoint at {path!r}: not a directory" + (
            f"; a save was cut short while swapping it into place: the previous checkpoint is whole at {aside[-1]!r}"
            if aside else ""))
    if not os.path.exists(os.path.join(path, ".metadata")):
        written = sorted(f for f in os.listdir(path) if not f.startswith("."))
        raise ValueError(f"the checkpoint at {path!r} is incomplete: it has no .metadata (written last, once every "
                         f"rank has written its data), so its save did not finish; data files present: {written}")
    return integrity.read_metadata(path)


def _flat(request: dict) -> dict[str, Any]:
    """DCP's flat key -> value of a nested state dict."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(request)[0]


def _tensors(request: dict) -> dict[str, Any]:
    """DCP's flat key -> tensor (or ShardedTensor) of a nested state dict."""
    return {k: v for k, v in _flat(request).items() if isinstance(v, torch.Tensor)}


def _missing(metadata: Any, request: dict, masters_only: bool = False) -> list[str]:
    keys = [k for k in _tensors(request) if k not in metadata.state_dict_metadata]
    return [k for k in keys if k.endswith("." + MASTER_KEY)] if masters_only else keys


def _check_against(metadata: Any, request: dict, strict: bool, whose: Any = None) -> None:
    """``ValueError`` naming what the checkpoint lacks or holds differently from ``request``
    (``whose()``: which optimizer saved it and which loads, said when optimizer state is missing)."""
    saved = metadata.state_dict_metadata
    missing = _missing(metadata, request)
    if missing:
        fqns = sorted(k.removeprefix("model.") for k in missing if k.startswith("model."))
        which = f" (the model's {fqns[:6]}: it was saved for another model)" if fqns else \
            f" ({whose()})" if whose is not None else ""
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors this model and optimizer need{which}: "
                         f"{missing[:6]}")
    for key, value in _tensors(request).items():
        md = saved[key]
        if not hasattr(md, "chunks"):
            raise ValueError(f"the checkpoint holds {key!r} as bytes, not a tensor")
        if tuple(md.size) != tuple(value.size()):
            raise ValueError(f"the checkpoint's {key!r} has shape {tuple(md.size)} but here it has shape "
                             f"{tuple(value.size())}: it was saved for another model")
        covered = sum(prod(c.sizes) for c in md.chunks)
        if covered != prod(md.size):
            raise ValueError(f"the checkpoint's {key!r} is incomplete: its chunks hold {covered} of "
                             f"{prod(md.size)} elements")
    if strict:
        params = {k for k in _tensors(request) if k.startswith("model.")}
        extra = sorted(k for k in saved if k.startswith("model.") and k not in params)
        if extra:
            raise ValueError(f"the checkpoint holds model tensors this model does not have: {extra[:6]}")


def describe(checkpoint_id: Any) -> list[dict[str, Any]]:
    """What a checkpoint holds, read from its metadata alone (no process group): per saved tensor
    its key, shape, dtype, bytes, the chunks written (offsets, sizes, the file holding each: DCP's
    ``__<rank>_<n>.distcp`` names the rank that wrote it) and whether they cover it;
    per non-tensor entry (param-group settings ...) its key."""
    metadata, rows = read_metadata(checkpoint_id), []
    files = {(index.fqn, tuple(index.offset or ())): info.relative_path
             for index, info in (metadata.storage_data or {}).items()}
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if not hasattr(md, "chunks"):
            rows.append({"key": key, "kind": "bytes"})
            continue
        numel, dtype = prod(md.size), md.properties.dtype
        covered = sum(prod(c.sizes) for c in md.chunks)
        rows.append({"key": key, "kind": "tensor", "shape": list(md.size), "dtype": str(dtype).removeprefix("torch."),
                     "bytes": numel * dtype.itemsize, "complete": covered == numel,
                     "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes),
                                 "file": files.get((key, tuple(c.offsets)))} for c in md.chunks]})
    return rows
