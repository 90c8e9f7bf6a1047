"""Optax's gradient transformations on torch tensors, one module per topic: `scaling`, `adam`, `rms`,
`sign`, `momentum`, `adding`, `layerwise`, `factorized`, `clipping`, `masking`, `conditionality`,
`accumulation`, `constraining`, `monitoring`, `layouts`, `lookahead`, `lbfgs`, `linesearch`. Each
mirrors the Optax function of the same name formula for formula (same arguments, defaults and state
fields). A new transformation goes in the module of its topic, in its ``__all__``, and is
re-exported from `zero.functional`, one name a line: that is the one list of the names. This
package holds each module's ``__all__`` (the aliases build on ``T.scale`` ...).
"""

from zero.functional.transforms import (
    accumulation,
    adam,
    adding,
    clipping,
    conditionality,
    constraining,
    factorized,
    layerwise,
    layouts,
    lbfgs,
    linesearch,
    lookahead,
    masking,
    momentum,
    monitoring,
    rms,
    scaling,
    sign,
)

_TOPICS = (scaling, adam, rms, sign, momentum, adding, layerwise, factorized, clipping, masking, conditionality,
           accumulation, constraining, monitoring, layouts, lookahead, lbfgs, linesearch)
globals().update({name: getattr(topic, name) for topic in _TOPICS for name in topic.__all__})
__all__ = sorted(name for topic in _TOPICS for name in topic.__all__)
