"""Optax-style gradient transformations over torch tensors, and adapters to and from torch.optim
and Optax. Loads torch, never jax (the Optax bridge imports it on first use) nor zero.backends.

Where things live (every public name is re-exported here, one a line):

- ``base``, ``update``, ``combine``, ``inject``, ``elementwise``, ``foreach``, ``quantize``,
  ``scalars``: the core: `GradientTransformation` and tree helpers, `apply_updates`, `chain`,
  `inject_hyperparams`, and the floor every rule computes on (the elementwise maths the rules
  share, their list forms run as torch's foreach ops with small CPU leaves packed into one
  tensor, block-wise quantized moments, and 0-d hyperparameter and count tensors that remember
  their number).
- ``sharding/``: the whole-tensor quantities a sharded step completes across ranks, one module a
  concern (the installed `Sharding` and the stepped pieces, norms, sums over axes, rules that need
  whole tensors, low-bit blocks), every name at ``zero.functional.sharding``. The seam a sharded
  executor installs; a new whole-tensor quantity goes in the module of its concern.
- ``transforms/``: Optax's transformations, one module per topic (``adam``, ``rms``, ``clipping``,
  ``masking`` ...). A new transformation goes in the module of its topic.
- ``schedules/``: step count -> hyperparameter functions. A new schedule goes here.
- ``linalg``, ``microbatching``: Optax's linear algebra (power iteration, inverse p-th roots,
  non-negative least squares) and its microbatching of a function over a batch.
- ``aliases/``: the optimizers (one `chain` each), one module per family. A new alias goes here.
- ``contrib/``: ``optax.contrib``'s rules, one rule a module, and torchao's low-bit Adam. A new
  contrib rule goes here.
- ``kernels/``: in-place steps on torch's fused and multi-tensor kernels for chains that spell a
  torch rule (`explain` says which). A new kernel goes in ``kernels/``.
- ``adapters/``: `from_torch`, `Optimizer` / `FunctionalOptimizer` (torch's optimizer contract, one face for
  every zero optimizer), `torch_optimizer` (a rule where torch code expects an optimizer class), `from_optax`.
"""

from zero._lazy import module_getattr
from zero.functional.base import set_to_zero
from zero.functional.base import stateless
from zero.functional.base import stateless_with_tree_map
from zero.functional.base import EmptyState
from zero.functional.base import GradientTransformation
from zero.functional.base import with_extra_args_support
from zero.functional.base import identity
from zero.functional.update import incremental_update
from zero.functional.update import periodic_update
from zero.functional.update import apply_updates
from zero.functional.combine import named_chain
from zero.functional.combine import chain
from zero.functional.inject import InjectHyperparamsState
from zero.functional.inject import InjectStatefulHyperparamsState
from zero.functional.inject import WrappedSchedule
from zero.functional.inject import WrappedScheduleState
from zero.functional.inject import inject_hyperparams
from zero.functional.transforms.accumulation import ApplyEvery
from zero.functional.transforms.accumulation import apply_every
from zero.functional.transforms.accumulation import skip_not_finite
from zero.functional.transforms.accumulation import skip_large_updates
from zero.functional.transforms.accumulation import MultiSteps
from zero.functional.transforms.accumulation import MultiStepsState
from zero.functional.transforms.adam import ScaleByAdanState
from zero.functional.transforms.adam import scale_by_yogi
from zero.functional.transforms.adam import scale_by_adan
from zero.functional.transforms.adam import ScaleByAdamState
from zero.functional.transforms.adam import ScaleByAmsgradState
from zero.functional.transforms.adam import ScaleByBeliefState
from zero.functional.transforms.adam import scale_by_adam
from zero.functional.transforms.adam import scale_by_amsgrad
from zero.functional.transforms.adam import scale_by_adamax
from zero.functional.transforms.adam import scale_by_radam
from zero.functional.transforms.adam import scale_by_belief
from zero.functional.transforms.adding import centralize
from zero.functional.transforms.adding import AddNoiseState
from zero.functional.transforms.adding import WeightDecaySchedule
from zero.functional.transforms.adding import add_decayed_weights
from zero.functional.transforms.adding import add_noise
from zero.functional.transforms.clipping import clip_by_block_rms
from zero.functional.transforms.clipping import adaptive_grad_clip
from zero.functional.transforms.clipping import per_example_global_norm_clip
from zero.functional.transforms.clipping import clip
from zero.functional.transforms.clipping import clip_by_global_norm
from zero.functional.transforms.clipping import global_norm
from zero.functional.transforms.conditionality import ZeroNansState
from zero.functional.transforms.conditionality import ConditionallyMaskState
from zero.functional.transforms.conditionality import ConditionallyTransformState
from zero.functional.transforms.conditionality import zero_nans
from zero.functional.transforms.conditionality import conditionally_mask
from zero.functional.transforms.conditionality import conditionally_transform
from zero.functional.transforms.conditionality import ApplyIfFiniteState
from zero.functional.transforms.conditionality import apply_if_finite
from zero.functional.transforms.factorized import FactoredState
from zero.functional.transforms.factorized import scale_by_factored_rms
from zero.functional.transforms.factorized import scale_by_param_block_rms
from zero.functional.transforms.factorized import ScaleBySM3State
from zero.functional.transforms.factorized import scale_by_sm3
from zero.functional.transforms.layerwise import ScaleByNovogradState
from zero.functional.transforms.layerwise import scale_by_novograd
from zero.functional.transforms.layerwise import scale_by_trust_ratio
from zero.functional.transforms.masking import PartitionState
from zero.functional.transforms.masking import partition
from zero.functional.transforms.masking import MaskedNode
from zero.functional.transforms.masking import MaskedState
from zero.functional.transforms.masking import MultiTransformState
from zero.functional.transforms.masking import masked
from zero.functional.transforms.masking import multi_transform
from zero.functional.transforms.momentum import ScaleByOptimisticGradientState
from zero.functional.transforms.momentum import scale_by_optimistic_gradient
from zero.functional.transforms.momentum import TraceState
from zero.functional.transforms.momentum import EmaState
from zero.functional.transforms.momentum import trace
from zero.functional.transforms.momentum import ema
from zero.functional.transforms.rms import ScaleByRmsState
from zero.functional.transforms.rms import ScaleByRmsWithCountState
from zero.functional.transforms.rms import ScaleByRStdDevState
from zero.functional.transforms.rms import ScaleByRStdDevWithCountState
from zero.functional.transforms.rms import ScaleByRssState
from zero.functional.transforms.rms import ScaleByAdaDeltaState
from zero.functional.transforms.rms import scale_by_rms
from zero.functional.transforms.rms import scale_by_stddev
from zero.functional.transforms.rms import scale_by_rss
from zero.functional.transforms.rms import scale_by_adadelta
from zero.functional.transforms.scaling import scale_by_polyak
from zero.functional.transforms.scaling import ScaleByScheduleState
from zero.functional.transforms.scaling import scale
from zero.functional.transforms.scaling import scale_by_learning_rate
from zero.functional.transforms.scaling import scale_by_schedule
from zero.functional.transforms.sign import scale_by_sign
from zero.functional.transforms.sign import ScaleByLionState
from zero.functional.transforms.sign import ScaleByRpropState
from zero.functional.transforms.sign import scale_by_lion
from zero.functional.transforms.sign import scale_by_rprop
from zero.functional.inject import inject_stateful_hyperparams
from zero.functional.transforms.clipping import per_example_layer_norm_clip
from zero.functional.transforms.masking import freeze
from zero.functional.transforms.masking import selective_transform
from zero.functional.transforms.constraining import NonNegativeParamsState
from zero.functional.transforms.constraining import keep_params_nonnegative
from zero.functional.transforms.monitoring import SnapshotState
from zero.functional.transforms.monitoring import MonitorState
from zero.functional.transforms.monitoring import snapshot
from zero.functional.transforms.monitoring import measure_with_ema
from zero.functional.transforms.monitoring import monitor
from zero.functional.transforms.layouts import flatten
from zero.functional.transforms.scaling import normalize_by_update_norm
from zero.functional.transforms.scaling import scale_by_param_block_norm
from zero.functional.transforms.scaling import ScaleByDistanceOverGradientsState
from zero.functional.transforms.scaling import scale_by_distance_over_gradients
from zero.functional.transforms.scaling import scale_gradient
from zero.functional.transforms.lookahead import LookaheadState
from zero.functional.transforms.lookahead import LookaheadParams
from zero.functional.transforms.lookahead import lookahead
from zero.functional.linalg import power_iteration
from zero.functional.linalg import matrix_inverse_pth_root
from zero.functional.linalg import nnls
from zero.functional.microbatching import microbatch
from zero.functional.transforms.lbfgs import ScaleByLBFGSState
from zero.functional.transforms.lbfgs import scale_by_lbfgs
from zero.functional.transforms.linesearch import BacktrackingLinesearchInfo
from zero.functional.transforms.linesearch import ScaleByBacktrackingLinesearchState
from zero.functional.transforms.linesearch import scale_by_backtracking_linesearch
from zero.functional.transforms.linesearch import ZoomLinesearchInfo
from zero.functional.transforms.linesearch import ScaleByZoomLinesearchState
from zero.functional.transforms.linesearch import scale_by_zoom_linesearch
from zero.functional.transforms.linesearch import value_and_grad_from_state
from zero.functional.aliases.lbfgs import lbfgs
from zero.functional.schedules.basic import piecewise_interpolate_schedule
from zero.functional.schedules.basic import constant_schedule
from zero.functional.schedules.basic import cosine_decay_schedule
from zero.functional.schedules.basic import exponential_decay
from zero.functional.schedules.basic import linear_schedule
from zero.functional.schedules.basic import piecewise_constant_schedule
from zero.functional.schedules.basic import polynomial_schedule
from zero.functional.schedules.join import linear_onecycle_schedule
from zero.functional.schedules.join import cosine_onecycle_schedule
from zero.functional.schedules.join import sgdr_schedule
from zero.functional.schedules.join import join_schedules
from zero.functional.schedules.join import warmup_cosine_decay_schedule
from zero.functional.schedules.join import warmup_constant_schedule
from zero.functional.schedules.join import warmup_exponential_decay_schedule
from zero.functional.aliases.adam import adam
from zero.functional.aliases.adam import adamax
from zero.functional.aliases.adam import adamw
from zero.functional.aliases.adam import nadam
from zero.functional.aliases.adam import radam
from zero.functional.aliases.adam import adabelief
from zero.functional.aliases.adam import amsgrad
from zero.functional.aliases.adam import adamaxw
from zero.functional.aliases.adam import adan
from zero.functional.aliases.adam import optimistic_adam
from zero.functional.aliases.adam import optimistic_adam_v2
from zero.functional.aliases.adam import nadamw
from zero.functional.aliases.adam import yogi
from zero.functional.aliases.factored import adafactor
from zero.functional.aliases.factored import sm3
from zero.functional.aliases.layerwise import lamb
from zero.functional.aliases.layerwise import fromage
from zero.functional.aliases.layerwise import lars
from zero.functional.aliases.layerwise import novograd
from zero.functional.aliases.rms import adadelta
from zero.functional.aliases.rms import adagrad
from zero.functional.aliases.rms import rmsprop
from zero.functional.aliases.sgd import sgd
from zero.functional.aliases.sgd import noisy_sgd
from zero.functional.aliases.sgd import optimistic_gradient_descent
from zero.functional.aliases.sgd import polyak_sgd
from zero.functional.aliases.sign import lion
from zero.functional.aliases.sign import rprop
from zero.functional.aliases.sign import sign_sgd
from zero.functional.aliases.sign import signum
from zero.functional.adapters.optax_bridge import from_optax
from zero.functional.adapters.optax_bridge import from_optax_state
from zero.functional.adapters.optax_bridge import to_optax_state
from zero.functional.adapters.optimizer import FunctionalOptimizer
from zero.functional.adapters.optimizer import Optimizer
from zero.functional.adapters.state_tree import split_state
from zero.functional.adapters.torch_factory import torch_optimizer
from zero.functional.adapters.torch_rules import from_torch
from zero.functional.kernels.chains import Path
from zero.functional.kernels.chains import explain
from zero.functional import contrib
from zero.functional import microbatching

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
    "Path",
    "explain",
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
    "contrib",
    "microbatching",
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
    "torch_optimizer",
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
    "warmup_constant_schedule",
    "warmup_exponential_decay_schedule",
    "with_extra_args_support",
    "yogi",
    "zero_nans",
    "ScaleByLBFGSState",
    "scale_by_lbfgs",
    "BacktrackingLinesearchInfo",
    "ScaleByBacktrackingLinesearchState",
    "scale_by_backtracking_linesearch",
    "ZoomLinesearchInfo",
    "ScaleByZoomLinesearchState",
    "scale_by_zoom_linesearch",
    "value_and_grad_from_state",
    "lbfgs",
    "power_iteration",
    "matrix_inverse_pth_root",
    "nnls",
    "microbatch",
    "LookaheadState",
    "LookaheadParams",
    "lookahead",
    "inject_stateful_hyperparams",
    "per_example_layer_norm_clip",
    "freeze",
    "selective_transform",
    "NonNegativeParamsState",
    "keep_params_nonnegative",
    "SnapshotState",
    "MonitorState",
    "snapshot",
    "measure_with_ema",
    "monitor",
    "flatten",
    "normalize_by_update_norm",
    "scale_by_param_block_norm",
    "ScaleByDistanceOverGradientsState",
    "scale_by_distance_over_gradients",
    "scale_gradient",
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

__getattr__ = module_getattr(__name__)  # a submodule not imported yet resolves on first access
