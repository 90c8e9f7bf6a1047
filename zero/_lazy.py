"""Names resolved on first access (PEP 562), for the package ``__init__`` modules.

``import zero`` loads the plan layer only; a name from another layer, or a submodule nobody has
imported yet (``zero.backends.checkpoint.save`` right after ``import zero``), is imported when
first read, so every dotted name the docs write after ``import zero`` resolves. Standard library
only: the root package imports this.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any


def module_getattr(package: str, names: Mapping[str, str] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``names`` maps a public name to the module that
    defines it; any other name that is a submodule of ``package`` is imported and returned."""
    names = dict(names or {})

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
