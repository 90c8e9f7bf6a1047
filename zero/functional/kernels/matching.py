"""Reading a chain's specs as a rule: the prefix torch's rules share (``maximize`` as ``scale(-1)``,
a coupled decay), the core, a decay (maskless or masked), the learning rate. Each ``take``
pops the first spec when it is what is asked for; a kernel matches when nothing is left over."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zero.functional.base import Spec

__all__ = ["take", "take_decay", "maximize_and_decay", "plain_adam", "plain_decay", "decayed_rule", "lr_rule"]


def take(specs: list[tuple[int, Spec]], name: str, accept: Callable[[dict], bool] = lambda a: True):
    """Pop the first spec if it is ``name`` with acceptable arguments."""
    if specs and specs[0][1].name == name and accept(specs[0][1].args):
        return specs.pop(0)
    return None


def maximize_and_decay(specs: list[tuple[int, Spec]]) -> tuple[bool, float]:
    """Pop torch's prefix of a rule: ``maximize`` as ``scale(-1)``, then coupled weight decay
    (without a mask: torch's multi-tensor implementations take one decay per call)."""
    maximize = take(specs, "scale", lambda a: a["step_size"] == -1.0) is not None
    decay = take(specs, "add_decayed_weights", plain_decay)
    return maximize, decay[1].args["weight_decay"] if decay else 0.0


def take_decay(specs: list[tuple[int, Spec]]) -> tuple[float, Any] | None:
    """Pop a weight decay, maskless or masked (``masked(add_decayed_weights(rate))``, what a
    ``mask=`` builds): ``(rate, mask)``, or None."""
    plain = take(specs, "add_decayed_weights", plain_decay)
    if plain is not None:
        return plain[1].args["weight_decay"], None
    inner = lambda a: a["inner"].spec is not None and a["inner"].spec.name == "add_decayed_weights" \
        and not callable(a["inner"].spec.args["weight_decay"])  # noqa: E731
    masked = take(specs, "masked", inner)
    return (masked[1].args["inner"].spec.args["weight_decay"], masked[1].args["mask"]) if masked else None


def plain_adam(args: dict) -> bool:
    """``scale_by_adam`` as torch's fused kernel computes it."""
    return not args["eps_root"] and not args["nesterov"] and args["mu_dtype"] is None


def plain_decay(args: dict) -> bool:
    return args["mask"] is None and not callable(args["weight_decay"])


def decayed_rule(specs: list[tuple[int, Spec]], take_core: Callable[[list], Any], masks: bool = True):
    """[scale(-1)] [decay] core [decay] scale_by_learning_rate, with at most one of the two decays
    (masked ones only when ``masks``), or None: (maximize, (decay rate, mask), decoupled, the
    core's position and spec, the lr link's position and learning rate)."""
    specs = list(specs)
    maximize = take(specs, "scale", lambda a: a["step_size"] == -1.0) is not None
    coupled = take_decay(specs)
    core = take_core(specs)
    decoupled = take_decay(specs)
    lr = take(specs, "scale_by_learning_rate", lambda a: a["flip_sign"])
    if core is None or lr is None or specs or (coupled and decoupled):
        return None
    decay = coupled or decoupled or (0.0, None)
    if decay[1] is not None and not masks:
        return None
    return maximize, decay, decoupled is not None, core[0], core[1], lr[0], lr[1].args["learning_rate"]


def lr_rule(specs: list[tuple[int, Spec]], core_name: str):
    """[scale(-1)] [add_decayed_weights] ``core_name`` scale_by_learning_rate, or None: (maximize,
    weight decay, the core's position and arguments, the lr link's position and learning rate)."""
    specs = list(specs)
    maximize, weight_decay = maximize_and_decay(specs)
    core = take(specs, core_name)
    lr = take(specs, "scale_by_learning_rate", lambda a: a["flip_sign"])
    if core is None or lr is None or specs:
        return None
    return maximize, weight_decay, core[0], core[1].args, lr[0], lr[1].args["learning_rate"]
