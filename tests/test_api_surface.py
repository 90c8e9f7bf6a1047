"""The public names of `zero`, pinned: each package's ``__all__`` is exactly this list, and every
name resolves from where it is listed (the lazy ones in a process where nothing of zero was loaded
before: each package in a fork of one that imported torch alone). Removing or renaming a public
name fails here: move it, and keep it importable from here, or say so in the README and update
this list."""

import json
import subprocess
import sys

import pytest

# one worker for the module under -n 2: its one process answers for every package
pytestmark = pytest.mark.xdist_group("api_surface")

PUBLIC = {
    "zero": (
        "OPTIMIZERS", "ParamMeta", "Partition", "Plan", "ZeroRedundancyOptimizer", "assign_ddp_buckets",
        "bucket_views", "ddp_buckets", "diff_plans", "flat_layout", "holdings", "make_plan", "param_metas",
        "partition", "preset", "split_bucket", "state_bytes", "sync_rows",
    ),
    "zero.functional": (
        "AddNoiseState", "ApplyEvery", "ApplyIfFiniteState", "BacktrackingLinesearchInfo", "ConditionallyMaskState",
        "ConditionallyTransformState", "EmaState", "EmptyState", "FactoredState", "FunctionalOptimizer",
        "GradientTransformation", "InjectHyperparamsState", "InjectStatefulHyperparamsState", "LookaheadParams",
        "LookaheadState", "MaskedNode", "MaskedState", "MonitorState", "MultiSteps", "MultiStepsState",
        "MultiTransformState", "NonNegativeParamsState", "Optimizer", "PartitionState", "Path", "ScaleByAdaDeltaState",
        "ScaleByAdamState", "ScaleByAdanState", "ScaleByAmsgradState", "ScaleByBacktrackingLinesearchState",
        "ScaleByBeliefState", "ScaleByDistanceOverGradientsState", "ScaleByLBFGSState", "ScaleByLionState",
        "ScaleByNovogradState", "ScaleByOptimisticGradientState", "ScaleByRStdDevState", "ScaleByRStdDevWithCountState",
        "ScaleByRmsState", "ScaleByRmsWithCountState", "ScaleByRpropState", "ScaleByRssState", "ScaleBySM3State",
        "ScaleByScheduleState", "ScaleByZoomLinesearchState", "SnapshotState", "TraceState", "WeightDecaySchedule",
        "WrappedSchedule", "WrappedScheduleState", "ZeroNansState", "ZoomLinesearchInfo", "adabelief", "adadelta",
        "adafactor", "adagrad", "adam", "adamax", "adamaxw", "adamw", "adan", "adaptive_grad_clip",
        "add_decayed_weights", "add_noise", "amsgrad", "apply_every", "apply_if_finite", "apply_updates", "centralize",
        "chain", "clip", "clip_by_block_rms", "clip_by_global_norm", "conditionally_mask", "conditionally_transform",
        "constant_schedule", "contrib", "cosine_decay_schedule", "cosine_onecycle_schedule", "ema", "explain",
        "exponential_decay", "flatten", "freeze", "from_optax", "from_optax_state", "from_torch", "fromage",
        "global_norm", "identity", "incremental_update", "inject_hyperparams", "inject_stateful_hyperparams",
        "join_schedules", "keep_params_nonnegative", "lamb", "lars", "lbfgs", "linear_onecycle_schedule",
        "linear_schedule", "lion", "lookahead", "masked", "matrix_inverse_pth_root", "measure_with_ema", "microbatch",
        "microbatching", "monitor", "multi_transform", "nadam", "nadamw", "named_chain", "nnls", "noisy_sgd",
        "normalize_by_update_norm", "novograd", "optimistic_adam", "optimistic_adam_v2", "optimistic_gradient_descent",
        "partition", "per_example_global_norm_clip", "per_example_layer_norm_clip", "periodic_update",
        "piecewise_constant_schedule", "piecewise_interpolate_schedule", "polyak_sgd", "polynomial_schedule",
        "power_iteration", "radam", "rmsprop", "rprop", "scale", "scale_by_adadelta", "scale_by_adam",
        "scale_by_adamax", "scale_by_adan", "scale_by_amsgrad", "scale_by_backtracking_linesearch", "scale_by_belief",
        "scale_by_distance_over_gradients", "scale_by_factored_rms", "scale_by_lbfgs", "scale_by_learning_rate",
        "scale_by_lion", "scale_by_novograd", "scale_by_optimistic_gradient", "scale_by_param_block_norm",
        "scale_by_param_block_rms", "scale_by_polyak", "scale_by_radam", "scale_by_rms", "scale_by_rprop",
        "scale_by_rss", "scale_by_schedule", "scale_by_sign", "scale_by_sm3", "scale_by_stddev", "scale_by_trust_ratio",
        "scale_by_yogi", "scale_by_zoom_linesearch", "scale_gradient", "selective_transform", "set_to_zero", "sgd",
        "sgdr_schedule", "sign_sgd", "signum", "skip_large_updates", "skip_not_finite", "sm3", "snapshot",
        "split_state", "stateless", "stateless_with_tree_map", "to_optax_state", "torch_optimizer", "trace",
        "value_and_grad_from_state", "warmup_constant_schedule", "warmup_cosine_decay_schedule",
        "warmup_exponential_decay_schedule", "with_extra_args_support", "yogi", "zero_nans",
    ),
    "zero.functional.contrib": (
        "COCOBState", "DAdaptAdamWState", "DifferentiallyPrivateAggregateState", "DoGState", "DoWGState",
        "GaLoreDimensionNumbers", "GaLoreState", "HutchinsonState", "MadgradState", "MechanicState", "MomoAdamState",
        "MomoState", "MuonDimensionNumbers", "MuonState", "NormalizeState", "ProdigyState", "ReduceLROnPlateauState",
        "SAMState", "ScaleByAdemamixState", "ScaleByLowBitAdamState", "ScaleBySimplifiedAdEMAMixState",
        "ScheduleFreeState", "ShampooState", "SoapState", "SophiaState", "SplitRealAndImaginaryArrays",
        "SplitRealAndImaginaryState", "acprop", "adam_4bit", "adam_8bit", "adamw_4bit", "adamw_8bit", "ademamix",
        "adopt", "cocob", "dadapt_adamw", "decay_after_update", "differentially_private_aggregate", "dog", "dowg",
        "dpsgd", "galore", "hutchinson_estimator_diag_hessian", "madgrad", "mechanize", "momo", "momo_adam", "muon",
        "muon_8bit", "normalize", "orthogonalize_via_newton_schulz", "prodigy", "reduce_on_plateau", "sam",
        "scale_by_acprop", "scale_by_adam_4bit", "scale_by_adam_8bit", "scale_by_ademamix", "scale_by_adopt",
        "scale_by_cocob", "scale_by_dog", "scale_by_dowg", "scale_by_galore", "scale_by_madgrad", "scale_by_muon",
        "scale_by_shampoo", "scale_by_shape", "scale_by_simplified_ademamix", "scale_by_soap", "scale_by_sophia",
        "schedule_free", "schedule_free_adamw", "schedule_free_eval_params", "schedule_free_sgd",
        "schedule_free_states", "shampoo", "simplified_ademamix", "soap", "sophia", "split_real_and_imaginary",
        "swap_eval", "swap_train",
    ),
    "zero.backends": (
        "DistributedOptimizer", "HierarchicalModelAverager", "Int8Reducer", "MeanReducer", "PeriodicModelAverager",
        "PostLocalSGDOptimizer", "RankState", "ShardedGradScaler", "ZeroRedundancyOptimizer", "average_parameters",
        "get_state_dict", "hook_with_zero_step", "hook_with_zero_step_interleaved", "register_post_local_sgd_hook",
        "set_state_dict",
    ),
    "zero.backends.checkpoint": (
        "describe", "get_state_dict", "load", "model_fqns", "read_metadata", "save", "set_state_dict",
    ),
    "zero.backends.jax_mesh": (
        "device_bytes", "gather_state", "init", "packing", "place_state", "restore", "save", "state_bytes", "update",
    ),
}


# Each package imported in a process of its own, forked from one that imported torch alone (torch is
# not zero's: a fresh interpreter per package spent 3-4 s of CPU importing torch again, six times).
SURFACES = """
import importlib, json, os, sys
import torch
for name in json.loads(sys.argv[1]):
    read, write = os.pipe()
    if os.fork() == 0:
        try:
            m = importlib.import_module(name)
            [getattr(m, n) for n in m.__all__]
            said = sorted(m.__all__)
        except Exception as e:
            said = f"{type(e).__name__}: {e}"
        os.write(write, json.dumps(said).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    os.wait()
    if not said:
        sys.exit(f"importing {name} ended its process before it answered")
    print(json.dumps([name, json.loads(said)]))
"""


@pytest.fixture(scope="module")
def surfaces() -> dict:
    out = subprocess.run([sys.executable, "-c", SURFACES, json.dumps(sorted(PUBLIC))], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]  # names a package whose import ended its process
    return dict(json.loads(line) for line in out.stdout.splitlines())


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_the_public_names_are_exactly_these_and_each_resolves(surfaces, module):
    assert surfaces[module] == sorted(PUBLIC[module])
