"""Rules from ``optax.contrib``: one rule a module, each named and shaped as Optax's (its state
layout included) and re-exported from here, as ``optax.contrib.<name>`` is. Empty until the first
contrib rule lands (Muon, issue #29).
"""

__all__: list[str] = []
