"""Optax-style gradient transformations over torch tensors, and adapters to and from torch.optim
and Optax. Loads torch, never jax (the Optax bridge imports it on first use) nor zero.backends.
"""

from zero.functional.alias import adadelta
from zero.functional.alias import adagrad
from zero.functional.alias import adam
from zero.functional.alias import adamax
from zero.functional.alias import adamw
from zero.functional.alias import lamb
from zero.functional.alias import lion
from zero.functional.alias import nadam
from zero.functional.alias import radam
from zero.functional.alias import rmsprop
from zero.functional.alias import rprop
from zero.functional.alias import sgd
from zero.functional.more_rules import ScaleByOptimisticGradientState
from zero.functional.more_rules import ScaleByNovogradState
from zero.functional.more_rules import ScaleByAdanState
from zero.functional.more_rules import scale_by_sign
from zero.functional.more_rules import scale_by_optimistic_gradient
from zero.functional.more_rules import scale_by_yogi
from zero.functional.more_rules import scale_by_novograd
from zero.functional.more_rules import scale_by_polyak
from zero.functional.more_rules import scale_by_adan
from zero.functional.more_aliases import adabelief
from zero.functional.more_aliases import amsgrad
from zero.functional.more_aliases import adamaxw
from zero.functional.more_aliases import adan
from zero.functional.more_aliases import fromage
from zero.functional.more_aliases import lars
from zero.functional.more_aliases import noisy_sgd
from zero.functional.more_aliases import novograd
from zero.functional.more_aliases import optimistic_gradient_descent
from zero.functional.more_aliases import optimistic_adam
from zero.functional.more_aliases import optimistic_adam_v2
from zero.functional.more_aliases import nadamw
from zero.functional.more_aliases import polyak_sgd
from zero.functional.more_aliases import sign_sgd
from zero.functional.more_aliases import signum
from zero.functional.more_aliases import yogi
from zero.functional.more_transforms import ZeroNansState
from zero.functional.more_transforms import ApplyEvery
from zero.functional.wrappers import PartitionState
from zero.functional.more_transforms import ConditionallyMaskState
from zero.functional.more_transforms import ConditionallyTransformState
from zero.functional.more_transforms import set_to_zero
from zero.functional.more_transforms import stateless
from zero.functional.more_transforms import stateless_with_tree_map
from zero.functional.more_transforms import zero_nans
from zero.functional.more_transforms import centralize
from zero.functional.more_transforms import apply_every
from zero.functional.more_transforms import named_chain
from zero.functional.wrappers import partition
from zero.functional.more_transforms import conditionally_mask
from zero.functional.more_transforms import conditionally_transform
from zero.functional.more_transforms import skip_not_finite
from zero.functional.more_transforms import skip_large_updates
from zero.functional.more_transforms import clip_by_block_rms
from zero.functional.more_transforms import adaptive_grad_clip
from zero.functional.more_transforms import per_example_global_norm_clip
from zero.functional.schedules import piecewise_interpolate_schedule
from zero.functional.schedules import linear_onecycle_schedule
from zero.functional.schedules import cosine_onecycle_schedule
from zero.functional.schedules import sgdr_schedule
from zero.functional.base import incremental_update
from zero.functional.base import periodic_update
from zero.functional.factorized import FactoredState
from zero.functional.factorized import scale_by_factored_rms
from zero.functional.factorized import scale_by_param_block_rms
from zero.functional.factorized import adafactor
from zero.functional.more_rules import ScaleBySM3State
from zero.functional.more_rules import scale_by_sm3
from zero.functional.more_aliases import sm3
from zero.functional.base import EmptyState
from zero.functional.base import GradientTransformation
from zero.functional.base import apply_updates
from zero.functional.base import with_extra_args_support
from zero.functional.combine import chain
from zero.functional.base import identity
from zero.functional.clipping import clip
from zero.functional.clipping import clip_by_global_norm
from zero.functional.clipping import global_norm
from zero.functional.optax_bridge import from_optax
from zero.functional.optax_bridge import from_optax_state
from zero.functional.optax_bridge import to_optax_state
from zero.functional.optimizer import FunctionalOptimizer
from zero.functional.optimizer import Optimizer
from zero.functional.optimizer import split_state
from zero.functional.schedules import constant_schedule
from zero.functional.schedules import cosine_decay_schedule
from zero.functional.schedules import exponential_decay
from zero.functional.schedules import join_schedules
from zero.functional.schedules import linear_schedule
from zero.functional.schedules import piecewise_constant_schedule
from zero.functional.schedules import polynomial_schedule
from zero.functional.schedules import warmup_cosine_decay_schedule
from zero.functional.torch_optim import from_torch
from zero.functional.wrappers import ApplyIfFiniteState
from zero.functional.inject import InjectHyperparamsState
from zero.functional.inject import InjectStatefulHyperparamsState
from zero.functional.inject import WrappedSchedule
from zero.functional.inject import WrappedScheduleState
from zero.functional.wrappers import MaskedNode
from zero.functional.wrappers import MaskedState
from zero.functional.wrappers import MultiSteps
from zero.functional.wrappers import MultiStepsState
from zero.functional.wrappers import MultiTransformState
from zero.functional.wrappers import apply_if_finite
from zero.functional.inject import inject_hyperparams
from zero.functional.wrappers import masked
from zero.functional.wrappers import multi_transform
from zero.functional.adam_family import ScaleByAdamState
from zero.functional.adam_family import ScaleByAmsgradState
from zero.functional.adam_family import ScaleByBeliefState
from zero.functional.adam_family import scale_by_adam
from zero.functional.adam_family import scale_by_amsgrad
from zero.functional.adam_family import scale_by_adamax
from zero.functional.adam_family import scale_by_radam
from zero.functional.adam_family import scale_by_belief
from zero.functional.transform import ScaleByScheduleState
from zero.functional.transform import ScaleByRmsState
from zero.functional.transform import ScaleByRmsWithCountState
from zero.functional.transform import ScaleByRStdDevState
from zero.functional.transform import ScaleByRStdDevWithCountState
from zero.functional.transform import ScaleByRssState
from zero.functional.transform import ScaleByLionState
from zero.functional.transform import ScaleByRpropState
from zero.functional.transform import ScaleByAdaDeltaState
from zero.functional.transform import TraceState
from zero.functional.transform import EmaState
from zero.functional.transform import AddNoiseState
from zero.functional.transform import WeightDecaySchedule
from zero.functional.transform import scale
from zero.functional.transform import scale_by_learning_rate
from zero.functional.transform import scale_by_schedule
from zero.functional.transform import scale_by_rms
from zero.functional.transform import scale_by_stddev
from zero.functional.transform import scale_by_rss
from zero.functional.transform import scale_by_lion
from zero.functional.transform import scale_by_trust_ratio
from zero.functional.transform import scale_by_rprop
from zero.functional.transform import scale_by_adadelta
from zero.functional.transform import trace
from zero.functional.transform import ema
from zero.functional.transform import add_decayed_weights
from zero.functional.transform import add_noise

__all__ = [
    "AddNoiseState",
    "ApplyEvery",
    "ApplyIfFiniteState",
    "ConditionallyMaskState",
    "ConditionallyTransformState",
    "EmaState",
    "EmptyState",
    "FactoredState",
    "FunctionalOptimizer",
    "GradientTransformation",
    "InjectHyperparamsState",
    "InjectStatefulHyperparamsState",
    "MaskedNode",
    "MaskedState",
    "MultiSteps",
    "MultiStepsState",
    "MultiTransformState",
    "Optimizer",
    "PartitionState",
    "ScaleByAdaDeltaState",
    "ScaleByAdamState",
    "ScaleByAdanState",
    "ScaleByAmsgradState",
    "ScaleByBeliefState",
    "ScaleByLionState",
    "ScaleByNovogradState",
    "ScaleByOptimisticGradientState",
    "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState",
    "ScaleByRmsState",
    "ScaleByRmsWithCountState",
    "ScaleByRpropState",
    "ScaleByRssState",
    "ScaleBySM3State",
    "ScaleByScheduleState",
    "TraceState",
    "WeightDecaySchedule",
    "WrappedSchedule",
    "WrappedScheduleState",
    "ZeroNansState",
    "adabelief",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamaxw",
    "adamw",
    "adan",
    "adaptive_grad_clip",
    "add_decayed_weights",
    "add_noise",
    "amsgrad",
    "apply_every",
    "apply_if_finite",
    "apply_updates",
    "centralize",
    "chain",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "conditionally_mask",
    "conditionally_transform",
    "constant_schedule",
    "cosine_decay_schedule",
    "cosine_onecycle_schedule",
    "ema",
    "exponential_decay",
    "from_optax",
    "from_optax_state",
    "from_torch",
    "fromage",
    "global_norm",
    "identity",
    "incremental_update",
    "inject_hyperparams",
    "join_schedules",
    "lamb",
    "lars",
    "linear_onecycle_schedule",
    "linear_schedule",
    "lion",
    "masked",
    "multi_transform",
    "nadam",
    "nadamw",
    "named_chain",
    "noisy_sgd",
    "novograd",
    "optimistic_adam",
    "optimistic_adam_v2",
    "optimistic_gradient_descent",
    "partition",
    "per_example_global_norm_clip",
    "periodic_update",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
    "polyak_sgd",
    "polynomial_schedule",
    "radam",
    "rmsprop",
    "rprop",
    "scale",
    "scale_by_adadelta",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_adan",
    "scale_by_amsgrad",
    "scale_by_belief",
    "scale_by_factored_rms",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_novograd",
    "scale_by_optimistic_gradient",
    "scale_by_param_block_rms",
    "scale_by_polyak",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_rprop",
    "scale_by_rss",
    "scale_by_schedule",
    "scale_by_sign",
    "scale_by_sm3",
    "scale_by_stddev",
    "scale_by_trust_ratio",
    "scale_by_yogi",
    "set_to_zero",
    "sgd",
    "sgdr_schedule",
    "sign_sgd",
    "signum",
    "skip_large_updates",
    "skip_not_finite",
    "sm3",
    "split_state",
    "stateless",
    "stateless_with_tree_map",
    "to_optax_state",
    "trace",
    "warmup_cosine_decay_schedule",
    "with_extra_args_support",
    "yogi",
    "zero_nans",
]


def _register_state_classes() -> None:
    """Let ``torch.load(weights_only=True)`` (torch's default) read checkpoints holding our states:
    every NamedTuple state class of the layer (public or not, e.g. `from_torch`'s) is a safe global."""
    import sys

    import torch

    modules = [m for name, m in sys.modules.items() if name.startswith("zero.functional.") and m is not None]
    states = [obj for m in modules for obj in vars(m).values()
              if isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_fields")
              and obj.__module__ == m.__name__ and obj.__name__ != "Spec"]
    torch.serialization.add_safe_globals(states)


_register_state_classes()
