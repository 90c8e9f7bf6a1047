"""Optax's own test modules, run against `zero.functional` (see `optax_converter`).

``AliasTest.test_optimization`` (10,000 steps per case) runs ported, in `test_optax_convergence`.
"""

import optax_converter as conv
import pytest

# Optax's own deprecation (optimistic_adam), which the suite's tests call on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:`optimistic_adam` is deprecated:DeprecationWarning")

MODULES = {
    "alias": "optax._src.alias_test",
    "transform": "optax._src.transform_test",
    "combine": "optax._src.combine_test",
    "update": "optax._src.update_test",
    "float64": "optax._src.float64_test",
    "inject": "optax.schedules._inject_test",
    "join": "optax.schedules._join_test",
    "schedule": "optax.schedules._schedule_test",
    "accumulation": "optax.transforms._accumulation_test",
    "adding": "optax.transforms._adding_test",
    "clipping": "optax.transforms._clipping_test",
    "combining": "optax.transforms._combining_test",
    "conditionality": "optax.transforms._conditionality_test",
    "constraining": "optax.transforms._constraining_test",
    "freezing": "optax.transforms._freezing_test",
    "layouts": "optax.transforms._layouts_test",
    "masking": "optax.transforms._masking_test",
    "monitoring": "optax.transforms._monitoring_test",
    "muon": "optax.contrib._muon_test",
    "contrib": "optax.contrib._common_test",
    "schedule_free": "optax.contrib._schedule_free_test",
    "reduce_on_plateau": "optax.contrib._reduce_on_plateau_test",
    "sam": "optax.contrib._sam_test",
    "lookahead": "optax._src.lookahead_test",
    "privacy": "optax.contrib._privacy_test",
    "complex_valued": "optax.contrib._complex_valued_test",
    "microbatching": "optax.microbatching._microbatching_test",
    "galore": "optax.contrib._galore_test",
    "mechanic": "optax.contrib._mechanic_test",
    "linesearch": "optax._src.linesearch_test",
    "linear_algebra": "optax._src.linear_algebra_test",
}

# Test (``method`` or ``Class.method``) -> why it cannot apply to zero.
JAX_010 = "fails in Optax itself with JAX 0.10 (its structure error no longer says 'Dict key mismatch')"
SKIPS: dict[str, str] = {
    "AliasTest.test_optimization": "ported to tests/functional/test_optax_convergence.py (same cases, targets, "
                                   "steps and tolerance, torch gradients): through the converter each case runs 10,000 "
                                   "eager JAX steps, minutes each",
    "test_scale": "scales by 0.1**38, subnormal in float32: XLA flushes it to zero, torch keeps it, so zero's "
                  "5e-36 (the exact product) is compared with JAX's 0",
    "test_bad_structure_raises": JAX_010,
    "test_selective_bad_structure": JAX_010,
    "test_mask_compatible_callable_pytree": "a JAX-only pytree node (a dataclass registered with jax.tree_util), "
                                            "which torch's pytrees (optree) do not see into",
    "ContribTest.test_optimizers": "runs each contrib rule 30,000 steps inside jax.lax.scan (a JAX loop, which cannot "
                                   "call torch code) and then checks convergence of the params the loop left; zero's "
                                   "rules equal Optax's step for step (test_functional_optax_parity), so they "
                                   "converge as Optax's do",
    "test_lion_invalid_mode_raises": "zero raises the ValueError for an unknown mode when the transformation is "
                                     "built (the boundary); Optax at the first update, where this test expects it",
}

# Optax's Muon tests draw their matrices with the default (32-bit) JAX: with x64 on, as other
# modules here leave it, the same key draws another (100, 100) matrix, and Optax itself then
# fails its own bound on the smallest singular value (0.038 < 0.1). Its line-search tests are
# written for 32-bit too: a flat function's search fails (as the test expects) in float32 only.
X64_OFF = ("muon__", "linesearch__")


@pytest.fixture(autouse=True)
def _optax_default_precision(request):
    import jax

    if not any(prefix in request.node.nodeid for prefix in X64_OFF):
        yield
        return
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


for _prefix, _name in MODULES.items():
    try:
        _module = conv.load(_name)
    except ImportError as e:  # a test module needing a package we do not install
        pytest.skip(f"{_name} needs {e.name}", allow_module_level=True)
    globals().update(conv.test_cases(_module, _prefix, SKIPS))
