"""Optax-style gradient transformations over torch tensors, and adapters to and from torch.optim
and Optax. Loads torch, never jax (the Optax bridge imports it when used) nor zero.backends.
"""

from zero.functional.alias import adadelta, adagrad, adam, adamax, adamw, lamb, lion, nadam, radam, rmsprop, rprop, sgd
from zero.functional.base import EmptyState, GradientTransformation, apply_updates, chain, identity
from zero.functional.clipping import clip, clip_by_global_norm, global_norm
from zero.functional.schedules import (
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear_schedule,
    piecewise_constant_schedule,
    polynomial_schedule,
    warmup_cosine_decay_schedule,
)
from zero.functional.transform import *  # noqa: F403 - the transform module's __all__ is the public list
from zero.functional.transform import __all__ as _transform_names
from zero.functional.wrappers import (
    ApplyIfFiniteState,
    InjectHyperparamsState,
    MaskedNode,
    MaskedState,
    MultiSteps,
    MultiStepsState,
    MultiTransformState,
    apply_if_finite,
    inject_hyperparams,
    masked,
    multi_transform,
)

__all__ = [
    "ApplyIfFiniteState", "EmptyState", "GradientTransformation", "InjectHyperparamsState", "MaskedNode",
    "MaskedState", "MultiSteps", "MultiStepsState", "MultiTransformState", "adadelta", "adagrad", "adam",
    "adamax", "adamw", "apply_if_finite", "apply_updates", "chain", "clip", "clip_by_global_norm",
    "constant_schedule", "cosine_decay_schedule", "exponential_decay", "global_norm", "identity",
    "inject_hyperparams", "join_schedules", "lamb", "linear_schedule", "lion", "masked", "multi_transform",
    "nadam", "piecewise_constant_schedule", "polynomial_schedule", "radam", "rmsprop", "rprop", "sgd",
    "warmup_cosine_decay_schedule", *_transform_names,
]
