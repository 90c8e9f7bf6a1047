import datetime
import os
import shutil
import sys
import tempfile

# One thread per process, before torch starts its pool: two pytest workers, the notebooks' kernels,
# the docs' commands and the ranks share the machine's cores, and torch's default (a thread per core
# in every process) oversubscribes them: with it a notebook took 303 s beside the suite, with one
# thread 27 s. The child processes inherit it; a value already set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The notebooks' training runs and simulations at the size the suite affords (`zero.tools.notebook`):
# fewer steps, and zero_at_scale's 1,024-rank runs only; every check kept. Unset (a reader running a
# notebook) they run full size.
os.environ.setdefault("ZERO_NOTEBOOK_SIZE", "small")
# XLA at its quickest to compile, for this process and every child (the workers, the JAX mesh's
# processes, the notebooks' kernels): Optax's tests and the JAX references run eagerly, each op's
# first use on a shape is a compile of its own, and those compiles were most of the JAX tests' time
# (about 40 ms each here, 22 ms with these: LLVM without its optimisation passes, XLA's older loop
# emitters; neither enables fast math, so the arithmetic is IEEE's as before). Added to the flags
# a caller set; a process that needs more devices adds its own (`tests/backends/xla_devices.py`).
FAST_XLA = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if FAST_XLA not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_XLA}".strip()

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# CI machines are slow and shared: no per-example deadlines, fewer examples than a local deep run.
settings.register_profile("ci", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo default group in this process, for errors raised at the boundary."""
    import torch.distributed as dist

    from zero.tools.launch import free_port

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """The pools of gloo ranks the multi-rank tests share (`helpers.run_ranks`), ended with the session."""
    yield
    helpers = sys.modules.get("helpers")
    if helpers is not None:
        helpers.close_pools()


# Notebooks that simulate 1,024-rank jobs run longer than one test's 300 s bound allows on 2 busy cores.
LONG_NOTEBOOKS = {"zero_at_scale.ipynb": 900}
# Notebooks on the worker of a group of tests: zero_at_scale simulates ranks test_simulate simulates
# too, and one after the other the second reads them from the session's store (ZERO_SIMULATE_CACHE)
NOTEBOOK_GROUPS = {"zero_at_scale.ipynb": "simulate"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix != ".ipynb":
            continue
        if item.path.name in LONG_NOTEBOOKS:
            item.add_marker(pytest.mark.timeout(LONG_NOTEBOOKS[item.path.name]))
        if item.path.name in NOTEBOOK_GROUPS:
            item.add_marker(pytest.mark.xdist_group(NOTEBOOK_GROUPS[item.path.name]))


def pytest_configure(config):
    _refuse_ungrouped_workers(config)
    if not hasattr(config, "workerinput") and not os.environ.get("ZERO_SIMULATE_CACHE"):
        # one store of simulated ranks (`zero.backends.simulate`) for the session, its workers and
        # their children (notebooks, the docs' commands): a rank they each simulate runs once
        config.zero_simulate_cache = tempfile.mkdtemp(prefix="zero-simulate-")
        os.environ["ZERO_SIMULATE_CACHE"] = config.zero_simulate_cache
    if not hasattr(config, "workerinput") and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        config.zero_jax_cache = tempfile.mkdtemp(prefix="zero-jax-cache-")
        _share_jax_compilations(config.zero_jax_cache)


def _share_jax_compilations(folder):
    """One store of XLA's compiled programs for the session, its workers and their children (JAX's
    persistent compilation cache, every program kept however quick its compile): Optax's tests run
    eagerly, and each op's first use on a new shape compiles, as does each jitted closure a test
    builds again; the workers, the JAX mesh's processes and the notebooks compile the same ones
    (Optax's suite, the JAX references and the hypergradients: 290 s -> 223 s on two workers)."""
    settings = {"jax_compilation_cache_dir": folder, "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    os.environ.update({name.upper(): str(value) for name, value in settings.items()})
    jax = sys.modules.get("jax")  # imported before the settings were there (a plugin): told directly
    if jax is not None:
        for name, value in settings.items():
            jax.config.update(name, value)


def _refuse_ungrouped_workers(config):
    """Under pytest 9.2 and pytest-xdist 3.8, --dist loadgroup ignores every xdist_group mark
    (pytest-dev/pytest-xdist#1386): the session fixtures of the grouped modules (the JAX mesh's
    subprocess, the simulations) would run once per worker, 200 s each."""
    from importlib.metadata import version

    from packaging.version import Version

    if config.getoption("dist", "no") != "loadgroup":
        return
    pytest_v, xdist_v = Version(version("pytest")), Version(version("pytest-xdist"))
    if pytest_v >= Version("9.2.0.dev0") and xdist_v <= Version("3.8.0"):
        raise pytest.UsageError(
            f"pytest {pytest_v} with pytest-xdist {xdist_v} does not group tests under --dist loadgroup "
            "(pytest-dev/pytest-xdist#1386): install the project's dev extra (pytest<9.2)")


def pytest_unconfigure(config):
    for folder in (getattr(config, "zero_simulate_cache", None), getattr(config, "zero_jax_cache", None)):
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
