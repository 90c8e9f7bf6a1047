"""Rules from ``optax.contrib``: one rule a module, each named and shaped as Optax's (its state
layout included) and re-exported from here, as ``optax.contrib.<name>`` is.
"""

from zero.functional.contrib._muon import MuonState, muon, scale_by_muon, scale_by_shape
from zero.functional.contrib.newton_schulz import MuonDimensionNumbers, orthogonalize_via_newton_schulz

__all__ = ["MuonState", "muon", "scale_by_muon", "scale_by_shape", "MuonDimensionNumbers",
           "orthogonalize_via_newton_schulz"]
