"""Param-group settings for transformations: the bridge between torch's group keys (``lr`` ...)
and the hyperparameters a transformation keeps in its state (`inject_hyperparams`).

An alias (``zero.functional.adamw(...)``) or a factory is rebuilt under `inject_hyperparams`
(`with_group_hyperparams`, `from_factory`) so that a param group, or a torch lr scheduler, can
set its numbers; `hyperparams_of` names them as torch does; before each step the group's values
go into the state (`sync_hyperparams`) and a scheduled one comes back out (`show_scheduled`).
A setting the transformation would ignore is an error naming it (`check_group_settings`).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch

from zero.functional.adapters.torch_rules import torch_class_of, torch_settings
from zero.functional.base import GradientTransformation
from zero.functional.combine import chain
from zero.functional.inject import inject_hyperparams
from zero.functional.scalars import same_number, scalar

__all__ = ["hyperparams_of", "settings_of", "with_group_hyperparams", "from_factory", "rule_name", "check_not_optax",
           "check_group_settings", "sync_hyperparams", "show_scheduled", "looks_like_hyperparameter"]


def rule_name(tx: GradientTransformation) -> str:
    """What ``tx`` is, named as its factory is called (``zero.functional.adamw``,
    ``zero.functional.contrib.muon``; an injected alias by the alias; others by their spec)."""
    spec = getattr(tx, "spec", None)
    if spec is None:
        return "a zero.functional transformation built by hand"
    if torch_class_of(tx) is not None:
        return f"zero.functional.from_torch(torch.optim.{torch_class_of(tx)})"
    source = spec.args.get("source") if spec.name == "inject_hyperparams" else None
    factory = source[0] if source else spec.factory
    if factory is None:
        return f"zero.functional.{spec.name}"
    module = getattr(factory, "__module__", "") or ""
    where = "zero.functional.contrib" if ".contrib" in module else "zero.functional"
    return f"{where}.{factory.__name__}" if module.startswith("zero.functional") else factory.__name__


def hyperparams_of(tx: GradientTransformation) -> dict[str, float]:
    """The torch-group view (``lr`` ...) of the hyperparameters ``tx`` keeps in its state
    (those of `inject_hyperparams`, read from its spec; none for other transformations)."""
    spec = getattr(tx, "spec", None)
    if spec is None or spec.name not in ("inject_hyperparams", "from_optax"):
        return {}
    return {_group_key(k): v for k, v in spec.args["hyperparams"].items()}


def settings_of(tx: GradientTransformation) -> dict[str, Any]:
    """Every group setting of ``tx``: the hyperparameters it keeps in its state (`hyperparams_of`,
    which a group sets), and for a rule that mirrors a ``torch.optim`` class every other setting
    torch's class keeps in its groups (``betas``, ``amsgrad``, ``foreach`` ...: `torch_settings`),
    so that its state dict's groups load into torch's class and torch's into it."""
    out = torch_settings(tx)  # torch's values as torch keeps them (ns_steps an int, as its Muon reads it)
    for key, value in hyperparams_of(tx).items():
        out.setdefault(key, value)
    return out


def with_group_hyperparams(tx: Any, who: str = "tx") -> GradientTransformation:
    """``tx`` in the form whose hyperparameters param groups and lr schedulers can set.

    An alias (``zero.functional.sgd(0.1)`` ...) is rebuilt under `inject_hyperparams` with the
    same arguments, so it steps the same; a transformation that already keeps its hyperparameters
    in its state is returned as it is, and so is one that has none to offer. An Optax object is a
    ``TypeError`` saying to wrap it with `from_optax`.
    """
    check_not_optax(tx, who)
    if not hasattr(tx, "init") or not hasattr(tx, "update"):
        raise TypeError(f"{who} must be a zero.functional GradientTransformation, got {type(tx).__name__}")
    spec = getattr(tx, "spec", None)
    if spec is not None and spec.factory is not None:
        return _injected(spec.factory, spec.args)
    if spec is not None and spec.name == "chain":
        return _chain_with_group_hyperparams(tx, who)
    return tx


def _injected(factory: Any, args: dict) -> GradientTransformation:
    """``factory(**args)`` with its numeric arguments kept in the state, in float64 (which holds a
    Python float exactly: torch keeps group settings as Python numbers, and a float kept in the
    params' dtype would round: bf16 makes ``b2=0.999`` 1.0). A mask (or Muon's dimension numbers)
    is a function of the params, not a schedule of the step, and a block size shapes the state:
    they stay fixed, as do the arguments `inject_hyperparams` never injects (``clip_value_fn``,
    ``warmup_steps`` ...)."""
    fixed = [k for k in args if "mask" in k or "dimension_numbers" in k or k == "block_size"]
    return inject_hyperparams(factory, static_args=fixed, hyperparam_dtype=torch.float64)(**args)


def from_factory(factory: Any, kwargs: dict, who: str = "optimizer_class") -> GradientTransformation:
    """``factory(**kwargs)`` in the form whose hyperparameters param groups set: the same
    transformation, by the same route, as `with_group_hyperparams` makes of the built
    ``factory(**kwargs)`` (a `zero.functional` alias is built, then rebuilt from its spec); a
    factory of your own is injected with the same settings. So ``ZeroRedundancyOptimizer(params,
    F.adamw, learning_rate=...)`` and ``ZeroRedundancyOptimizer(params, F.adamw(...))`` step alike."""
    check_not_optax(factory, who)
    signature = inspect.signature(factory)
    try:
        bound = signature.bind(**kwargs)
    except TypeError as e:
        raise TypeError(f"{who} {getattr(factory, '__name__', factory)!r}: {e}") from None
    tx = factory(**kwargs)
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"{who} {factory!r} returned {type(tx).__name__}, not a GradientTransformation")
    if tx.spec is not None and tx.spec.factory is not None:
        return with_group_hyperparams(tx, who)
    bound.apply_defaults()
    return _injected(factory, dict(bound.arguments))


_RATES = ("learning_rate", "lr")


def _chain_with_group_hyperparams(tx: GradientTransformation, who: str) -> GradientTransformation:
    """A chain whose one link has a learning rate (an alias, `from_torch`, `inject_hyperparams`,
    in nested chains too) rebuilt so that link's hyperparameters are the group's (``lr`` ...), as
    ``inject_hyperparams(lambda learning_rate: chain(..., adamw(learning_rate), ...))`` would:
    torch's lr schedulers then drive it. Several such links: a ``ValueError`` saying how to choose."""
    rated = _rated_links(tx.spec.links, ())
    if not rated:
        return tx
    if len(rated) > 1:
        names = ", ".join(f"link {'.'.join(map(str, path))} ({name})" for path, name, _, _ in rated)
        raise ValueError(f"{who} is a chain with a learning rate in more than one link ({names}), so a param "
                         "group's lr cannot say which it sets; name the one a scheduler drives yourself: inject_"
                         "hyperparams(lambda learning_rate: chain(..., adamw(learning_rate), ...))(learning_rate=...)")
    path, _, factory, args = rated[0]

    def rebuilt(**hyperparams: Any) -> GradientTransformation:
        return _with_link(tx, path, factory(**hyperparams))

    rebuilt.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in args])
    rebuilt.__name__ = f"chain around {factory.__name__}"
    return _injected(rebuilt, args)


def _rated_links(links: tuple, at: tuple[int, ...]) -> list[tuple[tuple[int, ...], str, Any, dict]]:
    """``(path, name, factory, args)`` of each link that can be rebuilt with a learning rate."""
    out = []
    for i, link in enumerate(links):
        spec = getattr(link, "spec", None)
        if spec is None:
            continue
        source = (spec.factory, spec.args) if spec.factory is not None else spec.args.get("source")
        if source is not None and any(k in source[1] for k in _RATES):
            name = spec.name if spec.factory is not None else f"inject_hyperparams({source[0].__name__})"
            out.append((at + (i,), name, *source))
        elif spec.name == "chain":
            out += _rated_links(spec.links, at + (i,))
    return out


def _with_link(tx: GradientTransformation, path: tuple[int, ...], link: Any) -> GradientTransformation:
    """The chain ``tx`` with the link at ``path`` (through nested chains) replaced by ``link``."""
    links = list(tx.spec.links)
    links[path[0]] = link if len(path) == 1 else _with_link(links[path[0]], path[1:], link)
    return chain(*links)


def check_not_optax(obj: Any, who: str) -> None:
    """``TypeError`` for an Optax transformation or factory where a zero.functional one is needed."""
    module = getattr(obj, "__module__", "") or ""
    if module.split(".")[0] != "optax" and type(obj).__module__.split(".")[0] != "optax":
        return
    if hasattr(obj, "init") and hasattr(obj, "update"):
        raise TypeError(f"{who} is an Optax transformation ({type(obj).__name__}), which steps JAX arrays: "
                        f"wrap it as zero.functional.from_optax({who}) to run it on torch tensors")
    name = getattr(obj, "__name__", "factory")
    raise TypeError(f"{who} is Optax's {name}, which builds transformations of JAX arrays: pass "
                    f"zero.functional.from_optax(optax.{name}(...)), or zero.functional's own {name} if it has one")


def _group_key(name: str) -> str:
    return "lr" if name == "learning_rate" else name


def check_group_settings(group: dict, known: dict, index: int) -> None:
    """A group setting that looks like a hyperparameter the transformation does not keep would be
    ignored: that is an error, naming it (other keys, e.g. a group's name, are left alone)."""
    ignored = sorted(k for k, v in group.items() if k not in ("params", "tx") and k not in known
                     and looks_like_hyperparameter(v))
    if ignored:
        offer = f"its hyperparameters are {sorted(known)}" if known else "it keeps none in its state"
        raise ValueError(f"param group {index} sets {ignored}, which its transformation would ignore: {offer}. "
                         "Build it with zero.functional.inject_hyperparams(factory)(...) (or an alias, or "
                         "optax.inject_hyperparams inside from_optax) to make a setting per group")


def looks_like_hyperparameter(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return bool(value) and all(looks_like_hyperparameter(v) for v in value)
    return isinstance(value, (bool, int, float, torch.Tensor))


def sync_hyperparams(state: Any, group: dict) -> Any:
    """Copy the group's values (set by the user or an lr scheduler) into an injected state:
    ours (floats) or Optax's through `from_optax` (0-d tensors, kept in their dtype)."""
    hyperparams = getattr(state, "hyperparams", None)
    if not isinstance(hyperparams, dict) or not hasattr(state, "_replace"):
        return state
    for k in getattr(state, "hyperparams_states", None) or {}:  # each step's value comes from its schedule
        key = _group_key(k)
        if key in group and float(group[key]) != float(hyperparams[k]):
            raise ValueError(f"the param group's {key!r} was set to {group[key]!r}, but {k} follows the "
                             f"transformation's own schedule (now {float(hyperparams[k])!r}), which would ignore "
                             f"it: give {k} as a number to let torch's lr schedulers (or you) set it, or drop them")
    hp = {k: _like(v, group.get(_group_key(k), v)) for k, v in hyperparams.items()}
    if all(map(operator.is_, hp.values(), hyperparams.values())):  # every value unchanged: the state as it is
        return state
    return state._replace(hyperparams=hp)


def show_scheduled(state: Any, group: dict) -> None:
    """After a step, a scheduled hyperparameter's value in its group (``lr`` as it is now)."""
    for k in getattr(state, "hyperparams_states", None) or {}:
        if _group_key(k) in group:
            group[_group_key(k)] = float(state.hyperparams[k])


def _like(old: Any, value: Any) -> Any:
    if isinstance(old, torch.Tensor):  # unchanged: the same tensor (`scalars`: no op made or read)
        return old if same_number(old, value) else scalar(value, dtype=old.dtype, device=old.device)
    return float(value)
