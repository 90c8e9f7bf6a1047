"""Optax's schedules: `basic` (one formula each) and `join` (schedules joined at boundaries). A new
schedule goes in the module of its kind, in its ``__all__``, and is re-exported from
`zero.functional`, one name a line (the one list of the names); this package holds the modules'.
"""

from zero.functional.schedules import basic, join

globals().update({name: getattr(kind, name) for kind in (basic, join) for name in kind.__all__})
__all__ = sorted(name for kind in (basic, join) for name in kind.__all__)
