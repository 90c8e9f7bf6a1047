"""Programs on top of the three layers: the ``zero`` command line, the demo, and the launcher
that starts ranks on one machine. Nothing in ``zero.plans``, ``zero.functional`` or
``zero.backends`` imports from here."""

from zero._lazy import module_getattr

__getattr__ = module_getattr(__name__)  # a submodule not imported yet resolves on first access
