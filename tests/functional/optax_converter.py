"""Runs Optax's own test modules against `zero.functional`.

An Optax test module is executed with its Optax modules (``alias``, ``transform``, ``combine``,
``_masking``, ``schedules``...) replaced by proxies: a name `zero.functional` has resolves to the
zero rule behind a JAX face (JAX arrays in, torch tensors through the zero rule, JAX arrays out);
a name it lacks falls through to Optax. The JAX face is a real Optax transformation, so Optax's
own combinators take it; an Optax transformation handed to a zero combinator runs through
`zero.functional.from_optax`. ``jax.jit`` in the test bodies compiles what stays in JAX (a loss, a
Hessian-vector product) and runs eagerly what reaches a zero rule (torch code cannot be inside
JAX's program; compilation is not behaviour), and Optax's count of XLA compilations logs nothing;
a test that traces through a zero rule some other way (``jax.grad``, ``vmap``, ``lax.scan``)
cannot apply to torch and is skipped with that reason, naming the tracer that reached the rule, as is
``optax.tree.map_params`` on a zero rule (an Optax-internal protocol). A test that never
reaches a zero rule is skipped: it tests Optax alone.

Each test records whether it reached a zero rule (`reached`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import types
import unittest
from typing import Any

import jax
import numpy as np
import optax
import torch
from optax._src import base as optax_base

import zero.functional as F
from zero.functional.adapters.optax_bridge import from_optax
from zero.functional.base import takes_extra_args, update_with

TRACED = "traces a zero rule with {what} ({tracer}): not applicable to torch"
# A tracer's kind says which JAX transformation reached a zero rule. jax.grad and jax.vmap have
# torch.func's equivalents (tests/functional/test_pure_path.py runs every alias under them); a
# JAX loop, jit at import or pmap (a jaxpr tracer) would need torch code inside JAX's program.
_TRACERS = {"JVPTracer": "jax.grad/jvp", "LinearizeTracer": "jax.grad/linearize", "BatchTracer": "jax.vmap"}


class Traced(unittest.SkipTest):
    """A JAX tracer reached a zero rule."""


class _Reach:
    count = 0


def reached() -> int:
    """How many calls into zero rules the converter has made so far."""
    return _Reach.count


# -- values -------------------------------------------------------------------------------------

def _is_tx(x: Any) -> bool:
    return hasattr(x, "init") and hasattr(x, "update") and not isinstance(x, type)


def _is_stateful_schedule(x: Any) -> bool:
    return isinstance(x, optax_base.StatefulSchedule) or isinstance(x, F.WrappedSchedule)


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_torch(x: Any, data: bool = False) -> Any:
    """A JAX-side value as zero takes it: arrays become tensors, zero's own objects are unwrapped,
    Optax transformations run through `from_optax`, other callables get a torch face.

    ``data`` (params, updates, states): Python numbers become tensors, as ``jnp.asarray`` makes
    them. Otherwise (a factory's arguments) a weakly typed 0-d array, which is how JAX spells a
    Python number, becomes the number, so it takes the params' dtype where zero's rules cast.
    """
    if hasattr(x, "zero_object"):
        return x.zero_object
    if isinstance(x, jax.core.Tracer):
        kind = type(x).__name__
        raise Traced(TRACED.format(what=_TRACERS.get(kind, "a JAX loop, jit at import or pmap"), tracer=kind))
    if isinstance(x, optax.MaskedNode):
        return F.MaskedNode()
    if isinstance(x, bool | int | float | complex) and data:
        return to_torch(jax.numpy.asarray(x), data)
    if isinstance(x, jax.Array):
        if _is_key(x):
            return x  # a PRNG key has no torch counterpart
        if not data and x.ndim == 0 and getattr(x, "weak_type", False):
            return x.item()
        return torch.from_numpy(np.array(x)) if x.dtype == np.dtype("bool") else torch.from_dlpack(x)
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.copy())
    if isinstance(x, np.generic):
        return torch.tensor(x.item())
    if _is_dtype(x):
        return getattr(torch, np.dtype(x).name)
    if _is_stateful_schedule(x):
        return _TorchStatefulSchedule(x)
    if isinstance(x, optax.GradientTransformation) or (_is_tx(x) and not isinstance(x, tuple)):
        return from_optax(x)
    if callable(x) and not isinstance(x, type):
        return _torch_face(x)
    return _containers(x, lambda v: to_torch(v, data))


def to_jax(x: Any) -> Any:
    """A zero-side value as a JAX test sees it."""
    if isinstance(x, F.GradientTransformation):
        return _jax_tx(x)
    if isinstance(x, F.MultiSteps):
        return _JaxMultiSteps(x)
    if isinstance(x, F.MaskedNode):
        return optax.MaskedNode()
    if isinstance(x, torch.Tensor):
        t = x.detach().contiguous()
        return jax.numpy.asarray(t.numpy()) if t.dtype == torch.bool else jax.dlpack.from_dlpack(t)
    if callable(x) and not isinstance(x, type):
        return _jax_face(x)
    return _containers(x, to_jax)


def _is_dtype(x: Any) -> bool:
    return (isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic))
            or type(x).__name__ == "_ScalarMeta")


def _containers(x: Any, leaf) -> Any:
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(leaf(v) for v in x))
    if isinstance(x, list | tuple):
        return type(x)(leaf(v) for v in x)
    if isinstance(x, dict):
        return type(x)((k, leaf(v)) for k, v in x.items())
    return x


def _torch_face(fn):
    """A JAX-side callable (a schedule, a mask function, a loss) called by zero with torch values;
    as a loss, its value and gradient come from ``jax.value_and_grad`` (``value_and_grad``: what a
    zero line search asks of a loss it cannot differentiate with torch's autograd)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        return to_torch(fn(*to_jax(args), **to_jax(kwargs)))

    def value_and_grad(params, *args, **kwargs):
        value, grad = jax.value_and_grad(fn)(to_jax(params), *to_jax(args), **to_jax(kwargs))
        return to_torch(value, data=True), to_torch(grad, data=True)

    def hvp(params, v):  # a Hessian-vector product (Sophia's Hutchinson estimate of a JAX loss)
        return to_torch(jax.jvp(jax.grad(fn), (to_jax(params),), (to_jax(v),))[1], data=True)

    call.value_and_grad, call.hvp = value_and_grad, hvp
    return call


class _TorchStatefulSchedule:
    """A JAX-side stateful schedule called by zero with torch values."""

    def __init__(self, schedule):
        self._schedule = schedule

    def init(self):
        return to_torch(self._schedule.init(), data=True)

    def update(self, state, **extra_args):
        return to_torch(self._schedule.update(to_jax(state), **to_jax(extra_args)), data=True)

    def __call__(self, state, **extra_args):
        return to_torch(self._schedule(to_jax(state), **to_jax(extra_args)), data=True)


def _jax_face(fn):
    """A zero callable (a schedule, the factory `inject_hyperparams` returns) called by a test."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        _Reach.count += 1
        return to_jax(fn(*to_torch(args), **to_torch(kwargs)))
    call.zero_object = fn
    return call


class _JaxTx(optax.GradientTransformation):
    """Optax's transformation type, holding the zero transformation it fronts."""


class _JaxTxExtraArgs(optax.GradientTransformationExtraArgs):
    """The same for a zero transformation whose update takes extra args."""


def _jax_tx(tx: F.GradientTransformation) -> _JaxTx | _JaxTxExtraArgs:
    def init(params):
        _Reach.count += 1
        return to_jax(tx.init(to_torch(params, data=True)))

    def update(updates, state, params=None, **extra_args):
        _Reach.count += 1
        out = update_with(tx, to_torch(updates, True), to_torch(state, True), to_torch(params, True),
                          to_torch(extra_args))
        return to_jax(out)

    init.zero_face = update.zero_face = True  # for _map_params, which may get init alone
    face = (_JaxTxExtraArgs if takes_extra_args(tx) else _JaxTx)(init, update)
    face.zero_object = tx
    return face


class _JaxMultiSteps:
    """`zero.functional.MultiSteps` behind a JAX face (Optax's ``MultiSteps`` interface)."""

    def __init__(self, ms: F.MultiSteps):
        self.zero_object = ms
        self._tx = _jax_tx(ms.gradient_transformation())

    def init(self, params):
        return self._tx.init(params)

    def update(self, updates, state, params=None, **extra_args):
        return self._tx.update(updates, state, params, **extra_args)

    def has_updated(self, state) -> Any:
        return to_jax(self.zero_object.has_updated(to_torch(state, True)))

    def gradient_transformation(self):
        return self._tx

    @property
    def inner_opt(self):
        return to_jax(self.zero_object.inner_opt)


# Functions of pytrees of values (not factories, whose numbers are hyperparameters).
TREE_FUNCTIONS = {"apply_updates", "global_norm", "incremental_update", "periodic_update", "skip_not_finite",
                  "skip_large_updates", "per_example_global_norm_clip"}


def bridge(obj: Any) -> Any:
    """A zero function or class behind a JAX face."""
    if obj is F.MultiSteps:
        def multi_steps(*args, **kwargs):
            return _JaxMultiSteps(F.MultiSteps(*to_torch(args), **to_torch(kwargs)))
        return multi_steps

    data = getattr(obj, "__name__", "") in TREE_FUNCTIONS

    @functools.wraps(obj)
    def call(*args, **kwargs):
        _Reach.count += 1
        return to_jax(obj(*to_torch(args, data), **to_torch(kwargs, data)))
    call.zero_object = obj
    return call


# -- modules ------------------------------------------------------------------------------------

class ZeroProxy(types.ModuleType):
    """An Optax module whose names resolve to zero's where zero has them (functions, MultiSteps and
    the state classes), else to Optax's."""

    def __init__(self, module: types.ModuleType, ours: types.ModuleType = F):
        super().__init__(module.__name__)
        self._optax_module = module
        self._ours = ours

    def __getattr__(self, name: str) -> Any:
        original = getattr(self._optax_module, name)
        ours = getattr(self._ours, name, None)
        if ours is None or name.startswith("_") or inspect.ismodule(original):
            return original
        if inspect.isfunction(ours) or ours is F.MultiSteps:
            return bridge(ours)
        if isinstance(ours, type) and name.endswith("State"):
            return ours  # zero's rules build and read zero's state classes
        return original


class _TestBodyJax(types.ModuleType):
    """``jax`` with ``jit`` compiling only what never reaches a zero rule, for test bodies."""

    def __init__(self):
        super().__init__("jax")

    def __getattr__(self, name: str) -> Any:
        if name == "jit":
            return _jit_if_jax
        return getattr(jax, name)


def _jit_if_jax(fn=None, **options):
    """``jax.jit`` for a test body's function that stays in JAX (a loss, a Hessian-vector product:
    compiled, as in Optax's test); one that reaches a zero rule (a tracer met at the torch face,
    `Traced`) runs eagerly from then on, the rule called with concrete values."""
    if fn is None:
        return lambda f: _jit_if_jax(f, **options)
    compiled, eager = jax.jit(fn, **options), False

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal eager
        if not eager:
            try:
                return compiled(*args, **kwargs)
            except Traced:
                eager = True
        return fn(*args, **kwargs)
    return call


MAP_PARAMS = ("optax.tree.map_params works by an Optax-internal protocol (init on Optax's _ParamsPlaceholder); "
              "zero has no map_params")


class _OptaxTree(types.ModuleType):
    """``optax.tree`` whose ``map_params`` skips (the subtest, or test) when given a zero rule."""

    def __init__(self):
        super().__init__("optax.tree")

    def __getattr__(self, name: str) -> Any:
        if name == "map_params":
            return _map_params
        return getattr(optax.tree, name)


def _map_params(opt, *args, **kwargs):
    if hasattr(opt, "zero_object") or hasattr(opt, "zero_face"):
        raise unittest.SkipTest(MAP_PARAMS)
    return optax.tree.map_params(opt, *args, **kwargs)


class _Optax(types.ModuleType):
    """``optax`` with `_OptaxTree` as ``optax.tree``, for test bodies."""

    def __init__(self):
        super().__init__("optax")
        self.tree = _OptaxTree()

    def __getattr__(self, name: str) -> Any:
        return getattr(optax, name)


class _TestUtils(types.ModuleType):
    """Optax's ``test_utils`` with ``log_compilations`` logging nothing: with ``jax.jit`` off, the
    JAX ops around a zero rule compile one by one on first use, which says nothing about zero
    (whose steps are not compiled at all)."""

    def __init__(self, module: types.ModuleType):
        super().__init__(module.__name__)
        self._module = module

    def __getattr__(self, name: str) -> Any:
        if name == "log_compilations":
            return _no_compilations
        return getattr(self._module, name)


@contextlib.contextmanager
def _no_compilations():
    yield []


PROXIED = ["optax._src.alias", "optax._src.transform", "optax._src.combine", "optax._src.update",
           "optax._src.base", "optax._src.wrappers", "optax.transforms", "optax.schedules",
           "optax.transforms._accumulation", "optax.transforms._masking", "optax.transforms._combining",
           "optax.transforms._clipping", "optax.transforms._adding", "optax.transforms._conditionality",
           "optax.transforms._constraining", "optax.transforms._freezing", "optax.transforms._layouts",
           "optax.transforms._monitoring", "optax.schedules._inject", "optax.schedules._schedule",
           "optax.schedules._join", "optax._src.lookahead", "optax._src.linesearch", "optax._src.linear_algebra"]


# Optax modules whose names resolve to a zero namespace other than zero.functional.
PROXIED_ELSEWHERE = {"optax.contrib._muon": F.contrib, "optax.contrib": F.contrib,
                     "optax.contrib._schedule_free": F.contrib, "optax.contrib._reduce_on_plateau": F.contrib,
                     "optax.contrib._sam": F.contrib, "optax.contrib._privacy": F.contrib,
                     "optax.contrib._complex_valued": F.contrib, "optax.contrib._galore": F.contrib,
                     "optax.contrib._mechanic": F.contrib,
                     "optax.microbatching._microbatching": F.microbatching, "optax.microbatching": F.microbatching}


def load(test_module: str) -> types.ModuleType:
    """Execute Optax's ``test_module`` (e.g. ``"optax._src.alias_test"``) with proxies in place of
    the Optax modules it imports; returns the new module."""
    saved = []
    for name in PROXIED + list(PROXIED_ELSEWHERE):
        parent, _, attr = name.rpartition(".")
        package = importlib.import_module(parent)
        module = importlib.import_module(name)
        saved.append((package, attr, module))
        setattr(package, attr, ZeroProxy(module, PROXIED_ELSEWHERE.get(name, F)))
    try:
        origin = importlib.util.find_spec(test_module).origin
        spec = importlib.util.spec_from_file_location("zero_" + test_module.replace(".", "_"), origin)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for package, attr, original in saved:
            setattr(package, attr, original)
    module.jax = _TestBodyJax()
    if hasattr(module, "optax"):
        module.optax = _Optax()
    if hasattr(module, "test_utils"):
        module.test_utils = _TestUtils(module.test_utils)
    return module


NOT_REACHED = "reaches no zero rule (Optax testing Optax)"


def _needs_zero(method):
    """``method``, skipped when it never calls into zero: a pass or failure there is Optax's own
    (with ``jax.jit`` off, XLA's fused roundings differ), not a finding about zero."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        before = reached()
        try:
            method(self, *args, **kwargs)
        except unittest.SkipTest:
            raise
        except Exception:
            if reached() == before:
                raise unittest.SkipTest(NOT_REACHED) from None
            raise
        if reached() == before:
            raise unittest.SkipTest(NOT_REACHED)
    return run


def test_cases(module: types.ModuleType, prefix: str, skips: dict[str, str]) -> dict[str, type]:
    """The module's TestCase classes, renamed ``<prefix>__<class>``, with ``skips`` (test method
    name or ``Class.method``, which covers its numbered parameterized cases -> reason) applied and
    tests that reach no zero rule skipped."""
    found = {}
    for name, cls in vars(module).items():
        if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)) or cls.__module__ != module.__name__:
            continue
        namespace = {}
        for attr in dir(cls):
            if not attr.startswith("test") or not callable(getattr(cls, attr)):
                continue
            base = attr.rstrip("0123456789")  # absl's parameterized cases: test_x0, test_x1...
            reason = next((skips[k] for k in (f"{name}.{attr}", attr, f"{name}.{base}", base) if k in skips), None)
            method = _needs_zero(getattr(cls, attr))
            namespace[attr] = unittest.skip(reason)(method) if reason else method
        found[f"{prefix}__{name}"] = type(name, (cls,), namespace)
    return found
