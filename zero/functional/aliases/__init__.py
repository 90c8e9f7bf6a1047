"""Optax's optimizer aliases, one module per family (`sgd`, `adam`, `rms`, `sign`, `layerwise`,
`factored`): each alias is one `chain` of `zero.functional.transforms` whose docstring carries the
maths. A new alias goes in its family's module and is re-exported from `zero.functional`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from zero.functional.base import GradientTransformation, ScalarOrSchedule, Schedule, Spec

__all__ = ["Schedule", "ScalarOrSchedule", "Mask", "alias"]

Mask = Any  # a pytree of bools like the params, or a function of the params returning one


def alias(factory: Callable[..., GradientTransformation]) -> Callable[..., GradientTransformation]:
    """Record the alias and its arguments as the chain's spec, so it can be rebuilt under
    `inject_hyperparams` (what `zero.functional.Optimizer` does to let param groups set them)."""
    signature = inspect.signature(factory)

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> GradientTransformation:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{factory.__name__}(): {e}{_torch_names(kwargs, signature)}") from None
        bound.apply_defaults()
        tx = factory(*args, **kwargs)
        links = tx.spec.links if tx.spec is not None else ()  # kept, so a chain around the alias can fuse it
        return tx._replace(spec=Spec(factory.__name__, dict(bound.arguments), build, links))

    return build


# torch.optim's names for settings Optax (and so zero.functional) names otherwise
_OPTAX_NAMES = {"lr": "learning_rate", "betas": "b1 and b2", "alpha": "decay", "amsgrad": "the amsgrad alias"}


def _torch_names(kwargs: dict, signature: inspect.Signature) -> str:
    """A hint for a torch habit: ``adamw(lr=1e-3)`` -> "Optax's name is learning_rate; got lr"."""
    hints = [f"Optax's name is {_OPTAX_NAMES[k]}; got {k}" for k in kwargs
             if k in _OPTAX_NAMES and k not in signature.parameters]
    if not hints:
        return ""
    return f" ({'; '.join(hints)}; or zero.functional.from_torch(torch.optim.AdamW, lr=...) for torch's names)"
