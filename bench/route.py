"""One gradient's route from the backward hook to the update kernel, read off a real step.

ZeRO-2 (a flat plan, ``reduce_scatter_grads=True``) on 2 gloo ranks; rank 0 steps once under
``sys.setprofile`` and lists, in call order, every function of `zero` (and the kernel) that is
handed the gradient, holds it or hands it on. A function counts (a *stop*) when an argument, a
local variable at its return, or its return value is a tensor on the gradient's storages (the
param's ``.grad``, the bucket it is packed into, the shard its mean lands in), directly or one or
two levels inside a list, tuple or dict (``self`` does not count); so does every `zero` function
on the stack then, as one follows the gradient by hand, down from the hook and from ``step``.
``re-entries`` counts the files the route comes back to after leaving them; ``back-and-forth``
the times it goes A -> B -> A between two files.

    python bench/route.py [--rule torch|functional]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

import zero
import zero.functional as F
from zero.backends import ZeroRedundancyOptimizer
from zero.tools.launch import run

ROOT = os.path.dirname(zero.__file__)
HARNESS = os.path.join(ROOT, "tools")  # the launcher that runs the ranks
INLINE = {"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"}  # expressions, not stops
KERNELS = {"_fused_adamw_", "_fused_adam_"}


def _storages(value, depth: int = 2) -> set[int]:
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()} if value.device.type != "meta" else set()
    if depth and isinstance(value, (list, tuple)):
        return set().union(*(_storages(v, depth - 1) for v in value)) if value else set()
    if depth and isinstance(value, dict):
        return set().union(*(_storages(v, depth - 1) for v in value.values())) if value else set()
    return set()


def _route(rank: int, world_size: int, rule: str) -> list[str] | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 8))
    plan = zero.make_plan(zero.param_metas(model), world_size, "flat")
    tracked: set[int] = set()  # the traced gradient's storages; first the .grad backward makes (before zero's hook)
    model[0].weight.register_post_accumulate_grad_hook(
        lambda p: tracked.add(p.grad.untyped_storage().data_ptr()) if calls else None)
    if rule == "torch":
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, plan=plan, lr=1e-3, fused=True,
                                      reduce_scatter_grads=True)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), F.adamw, plan=plan, learning_rate=1e-3,
                                      reduce_scatter_grads=True)
    calls: list[tuple[str, str, set[int]]] = []
    x = torch.randn(16, 64)
    model(x).square().mean().backward()
    opt.step()  # built and warm: the traced step is a steady one
    opt.zero_grad()
    def stack(frame) -> list[tuple[str, str]]:
        """The zero frames on the stack, outermost first."""
        out = []
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(ROOT) and not path.startswith(HARNESS) and frame.f_code.co_name not in INLINE:
                out.append((os.path.relpath(path, os.path.dirname(ROOT)), frame.f_code.co_qualname, frame))
            frame = frame.f_back
        return out[::-1]

    def profile(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") in KERNELS:
            calls.append((stack(frame) + [("torch", arg.__name__, 0)], set()))
            return
        path = frame.f_code.co_filename
        if event not in ("call", "return") or not path.startswith(ROOT) or frame.f_code.co_name in INLINE:
            return
        names = [n for n in frame.f_code.co_varnames if n != "self"]  # at a return: every local bound
        if event == "call":
            names = names[:frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]
        seen = set().union(set(), *(_storages(frame.f_locals.get(n)) for n in names))
        if event == "return":
            seen |= _storages(arg)
        if seen:
            calls.append((stack(frame), seen))

    sys.setprofile(profile)
    try:
        model(x).square().mean().backward()
        opt.step()
    finally:
        sys.setprofile(None)
    if rank:
        return None
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = _gradient_tensors(opt.mode.gradients) + list(getattr(opt.mode, "_grads", ()))
    tracked |= {t.untyped_storage().data_ptr() for t in held} - params
    stops, frames = [], []  # the frames themselves: kept alive, no id is reused
    for frames_then, seen in calls:
        if frames_then[-1][0] != "torch" and not seen & tracked:
            continue
        for path, name, frame in frames_then:  # the frames the gradient passes through, in order
            stop = f"{path}:{name}" if path != "torch" else f"torch.{name}"
            if any(frame is f for f in frames) or (stops and stops[-1] == stop):
                continue
            frames.append(frame)
            stops.append(stop)
    return stops


def _gradient_tensors(obj, depth: int = 5, seen: set[int] | None = None) -> list[torch.Tensor]:
    """The tensors the mode's gradients object holds (buckets, landing shards), found by walking it."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("zero."):
        items = [v for k, v in vars(obj).items() if k not in ("state", "params", "mode", "optim")]
    else:
        return []
    return [t for v in items for t in _gradient_tensors(v, depth - 1, seen)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rule", choices=("torch", "functional"), default="torch")
    stops = run(_route, 2, parser.parse_args().rule)[0]
    files, reentries = [], 0
    for s in stops:
        f = s.split(":")[0]
        if files and files[-1] == f:
            continue
        reentries += f in files
        files.append(f)
    back = sum(files[k] == files[k - 2] for k in range(2, len(files)))
    for k, s in enumerate(stops, 1):
        print(f"{k:3d}  {s}")
    print(f"{len(stops)} stops in {len(set(files))} files; {reentries} re-entries; {back} back-and-forth")


if __name__ == "__main__":
    main()
