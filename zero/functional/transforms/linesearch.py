"""Line searches (mirrors ``optax.scale_by_backtracking_linesearch``, ``scale_by_zoom_linesearch``,
their states and infos, and ``value_and_grad_from_state``): a step size along the updates from
the loss at trial points. ``update(updates, state, params, value=, grad=, value_fn=)`` as Optax:
``value`` and ``grad`` at ``params``, ``value_fn(params, **kw)`` the loss anywhere (its gradient by
torch's autograd, or ``value_fn.value_and_grad`` when it has one: what
`zero.functional.Optimizer` builds from a ``step(closure)``).

Eager loops for JAX's ``while_loop``: the same trials, the same decisions, in Python floats for
the scalars. The slopes are inner products over the whole model (`inner_products`)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from zero.functional.base import GradientTransformation, tree_leaves, tree_map, zeros_like
from zero.functional.sharding import inner_products

# Optax's diagnostics, word for word (its tests read them)
FLAG_INTERVAL_NOT_FOUND = ("No interval satisfying curvature condition. Consider increasing maximal possible "
                           "stepsize of the linesearch.")
FLAG_INTERVAL_TOO_SMALL = "Length of searched interval has been reduced below threshold."
FLAG_CURVATURE_COND_NOT_SATISFIED = ("Returning stepsize with sufficient decrease but curvature condition not "
                                     "satisfied.")
FLAG_NO_STEPSIZE_FOUND = "Linesearch failed, no stepsize satisfying sufficient decrease found."
FLAG_NOT_A_DESCENT_DIRECTION = "The linesearch failed because the provided direction is not a descent direction. "

__all__ = ["BacktrackingLinesearchInfo", "ScaleByBacktrackingLinesearchState", "scale_by_backtracking_linesearch",
           "ZoomLinesearchInfo", "ScaleByZoomLinesearchState", "scale_by_zoom_linesearch",
           "value_and_grad_from_state"]


class BacktrackingLinesearchInfo(NamedTuple):
    """What the last backtracking search did (``optax.BacktrackingLinesearchInfo``)."""

    num_linesearch_steps: torch.Tensor
    decrease_error: torch.Tensor


class ScaleByBacktrackingLinesearchState(NamedTuple):
    """State of ``scale_by_backtracking_linesearch``: the step size taken, the loss there, its
    gradient (with ``store_grad``, else None) and `BacktrackingLinesearchInfo`."""

    learning_rate: torch.Tensor
    value: torch.Tensor
    grad: Any
    info: BacktrackingLinesearchInfo


class ZoomLinesearchInfo(NamedTuple):
    """What the last zoom search did (``optax.ZoomLinesearchInfo``)."""

    num_linesearch_steps: torch.Tensor
    decrease_error: torch.Tensor
    curvature_error: torch.Tensor


class ScaleByZoomLinesearchState(NamedTuple):
    """State of ``scale_by_zoom_linesearch``: the step size taken, the loss and gradient there
    (for `value_and_grad_from_state`), and `ZoomLinesearchInfo`."""

    learning_rate: torch.Tensor
    value: torch.Tensor
    grad: Any
    info: ZoomLinesearchInfo


def _slope(a: Any, b: Any) -> float:
    (s,) = inner_products((tree_leaves(a), tree_leaves(b)))
    return float(s)


def _along(params: Any, step: float, updates: Any) -> Any:
    return tree_map(lambda p, u: p + step * u, params, updates)


def _fn_kwargs(value_fn: Callable, extra: dict, who: str, value: Any = 0.0, grad: Any = 0.0) -> dict:
    if value_fn is None or value is None or grad is None:
        raise ValueError(f"{who} needs the loss: update(updates, state, params, value=loss, grad=grads, "
                         "value_fn=loss_fn), or zero.functional.Optimizer.step(closure) on plain params (a line "
                         "search under a sharded optimizer is not supported: its trials need the whole params)")
    names = set(inspect.signature(value_fn).parameters)
    rest = sorted(k for k in extra if k not in names)
    if rest:
        raise TypeError(f"Unexpected keyword arguments passed to `{who}.update`. These arguments were not consumed by "
                        f"`value_fn`: {rest}. Ensure that all extra keyword arguments are accepted by `value_fn`.")
    return dict(extra)


def value_and_grad_of(value_fn: Callable, params: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """``value_fn(params, **kwargs)`` and its gradient in ``params``: ``value_fn.value_and_grad``
    when it has one, else torch's autograd through ``value_fn``."""
    own = getattr(value_fn, "value_and_grad", None)
    if own is not None:
        return own(params, **kwargs)
    leaves, treedef = optree.tree_flatten(params)
    with torch.enable_grad():
        xs = [x.detach().requires_grad_() for x in leaves]
        value = value_fn(treedef.unflatten(xs), **kwargs)
        grads = torch.autograd.grad(value, xs, allow_unused=True)
    return value.detach(), treedef.unflatten([torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads)])


def _value_of(value_fn: Callable, params: Any, **kwargs: Any) -> torch.Tensor:
    own = getattr(value_fn, "value_and_grad", None)
    if own is not None:
        return own(params, **kwargs)[0]
    with torch.no_grad():
        return value_fn(params, **kwargs)


def _dtype_of(params: Any) -> torch.dtype:
    leaf = tree_leaves(params)[0]
    return leaf.real.dtype if leaf.is_complex() else leaf.dtype


def scale_by_backtracking_linesearch(max_backtracking_steps: int, slope_rtol: float = 1e-4,
                                     decrease_factor: float = 0.8, increase_factor: float = 1.5,
                                     max_learning_rate: float = 1.0, atol: float = 0.0, rtol: float = 0.0,
                                     store_grad: bool = False, verbose: bool = False) -> GradientTransformation:
    """Armijo backtracking (``optax.scale_by_backtracking_linesearch``): from the last step size
    times ``increase_factor`` (at most ``max_learning_rate``), shrink by ``decrease_factor`` until
    the loss decreases by ``slope_rtol`` of the slope's promise (within ``atol``, ``rtol``); a
    search that finds no finite loss takes a step of 0."""

    def init(params):
        dtype = _dtype_of(params)
        return ScaleByBacktrackingLinesearchState(
            torch.tensor(1.0, dtype=dtype), torch.tensor(math.inf, dtype=dtype),
            zeros_like(params) if store_grad else None,
            BacktrackingLinesearchInfo(torch.tensor(0), torch.tensor(math.inf, dtype=dtype)))

    def error(step: float, slope: float, value: float, new_value: float) -> float:
        e = new_value - (1.0 + rtol) * value - step * slope_rtol * slope
        return math.inf if math.isnan(e) else max(e, 0.0)

    def update(updates, state, params=None, *, value=None, grad=None, value_fn=None, **extra_args):
        kwargs = _fn_kwargs(value_fn, extra_args, "scale_by_backtracking_linesearch", value, grad)
        slope, v0 = _slope(updates, grad), float(value)
        lr = min(increase_factor * float(state.learning_rate), max_learning_rate)
        new_value, new_grad, err, steps = v0, None, math.inf, 0
        while not err <= atol and steps <= max_backtracking_steps:
            lr = decrease_factor * lr if steps > 0 else lr
            trial = _along(params, lr, updates)
            new_value = float(_value_of(value_fn, trial, **kwargs))
            err = error(lr, slope, v0, new_value)
            if store_grad and (err <= atol or steps == max_backtracking_steps):
                new_grad = value_and_grad_of(value_fn, trial, **kwargs)[1]
            steps += 1
        if verbose and err > atol:
            print(f"INFO: scale_by_backtracking_linesearch: no step size ensured sufficient decrease (value {v0}, "
                  f"slope {slope}, step size {lr}, decrease error {err})")
        lr = 0.0 if math.isinf(err) else lr
        dtype = state.learning_rate.dtype
        out = tree_map(lambda u: lr * u, updates)
        grad_out = (new_grad if new_grad is not None else zeros_like(params)) if store_grad else None
        return out, ScaleByBacktrackingLinesearchState(
            torch.tensor(lr, dtype=dtype), torch.tensor(new_value, dtype=dtype), grad_out,
            BacktrackingLinesearchInfo(torch.tensor(steps), torch.tensor(err, dtype=dtype)))

    return GradientTransformation(init, update)


def _cubicmin(a, fa, fpa, b, fb, c, fc) -> float:
    """The minimiser of the cubic through (a, fa) with slope fpa, (b, fb) and (c, fc); nan where
    it has none (JAX's inf and nan there are rejected by the interval checks alike)."""
    db, dc = b - a, c - a
    try:
        denom = (db * dc) ** 2 * (db - dc)
        r1, r2 = fb - fa - fpa * db, fc - fa - fpa * dc
        A = (dc ** 2 * r1 - db ** 2 * r2) / denom  # noqa: N806
        B = (-(dc ** 3) * r1 + db ** 3 * r2) / denom  # noqa: N806
        radical = B * B - 3.0 * A * fpa
        return a + (-B + math.sqrt(radical)) / (3.0 * A)
    except (ZeroDivisionError, OverflowError, ValueError):
        return math.nan


def _quadmin(a, fa, fpa, b, fb) -> float:
    """The minimiser of the quadratic through (a, fa) with slope fpa and (b, fb); nan where none."""
    try:
        B = (fb - fa - fpa * (b - a)) / ((b - a) ** 2)  # noqa: N806
        return a - fpa / (2.0 * B)
    except (ZeroDivisionError, OverflowError):
        return math.nan


class _Zoom:
    """One zoom search (the state Optax's ``zoom_linesearch`` carries), eager."""

    def __init__(self, settings: dict, value_and_grad: Callable, params: Any, updates: Any, value: float, grad: Any,
                 guess: float):
        self.s, self.vg, self.params, self.updates = settings, value_and_grad, params, updates
        slope = _slope(updates, grad)
        self.count, self.guess, self.stepsize = 0, guess, 0.0
        self.value, self.grad, self.slope = value, grad, slope
        self.value_init, self.slope_init = value, slope
        self.decrease_error = self.curvature_error = self.error = math.inf
        self.interval_found = self.done = self.failed = False
        self.low, self.value_low, self.slope_low = 0.0, value, slope
        self.high, self.value_high, self.slope_high = 0.0, value, slope
        self.cubic_ref, self.value_cubic_ref = 0.0, value
        self.safe_stepsize, self.safe_value, self.safe_grad = 0.0, value, grad

    def trial(self, step: float) -> tuple[float, Any, float]:
        value, grad = self.vg(_along(self.params, step, self.updates))
        return float(value), grad, _slope(grad, self.updates)

    def errors(self, step: float, value: float, slope: float) -> tuple[float, float]:
        s = self.s
        dec = value - self.value_init - s["slope_rtol"] * step * self.slope_init
        if s["approx_dec_rtol"] is not None:
            approx = max(slope - (2 * s["slope_rtol"] - 1.0) * self.slope_init,
                         value - self.value_init - s["approx_dec_rtol"] * abs(self.value_init))
            dec = min(approx, dec)
        dec = math.inf if math.isnan(dec) else max(dec, 0.0)
        curv = abs(slope) - s["curv_rtol"] * abs(self.slope_init)
        curv = math.inf if math.isnan(curv) else max(curv, 0.0)
        return dec, curv

    def search_interval(self) -> None:
        s = self.s
        new = self.guess if self.count == 0 else s["increase_factor"] * self.stepsize
        reached = False
        if s["max_stepsize"] is not None:
            reached, new = new >= s["max_stepsize"], min(new, s["max_stepsize"])
        value, grad, slope = self.trial(new)
        dec, curv = self.errors(new, value, slope)
        err = max(dec, curv)
        if dec <= s["tol"]:
            self.safe_stepsize, self.safe_value, self.safe_grad = new, value, grad
        set_high = dec > 0.0 or (value >= self.value and self.count > 0)
        set_low = slope >= 0.0 and not set_high
        prev = (self.stepsize, self.value, self.slope)
        if set_low:
            (self.low, self.value_low, self.slope_low), (self.high, self.value_high, self.slope_high) = \
                (new, value, slope), prev
        else:
            (self.low, self.value_low, self.slope_low), (self.high, self.value_high, self.slope_high) = \
                prev, (new, value, slope)
        found = set_high or set_low or err <= s["tol"]
        self.done = err <= s["tol"] or (reached and not found)
        if s["verbose"] and reached and not found:
            print(self._info(new, dec, curv) + FLAG_INTERVAL_NOT_FOUND + "\n" + FLAG_CURVATURE_COND_NOT_SATISFIED)
        self.failed = self.count + 1 >= s["max_linesearch_steps"] and not self.done
        self.interval_found = found
        self.cubic_ref, self.value_cubic_ref = self.low, self.value_low
        self._moved(new, value, grad, slope, dec, curv, err)

    def zoom(self) -> None:
        s = self.s
        low, high = self.low, self.high
        delta, left, right = abs(high - low), min(high, low), max(high, low)
        cubic = _cubicmin(low, self.value_low, self.slope_low, high, self.value_high, self.cubic_ref,
                          self.value_cubic_ref)
        quad = _quadmin(low, self.value_low, self.slope_low, high, self.value_high)
        if left + 0.2 * delta < cubic < right - 0.2 * delta:
            middle = cubic
        elif left + 0.1 * delta < quad < right - 0.1 * delta:
            middle = quad
        else:
            middle = (low + high) / 2.0
        value, grad, slope = self.trial(middle)
        dec, curv = self.errors(middle, value, slope)
        err = max(dec, curv)
        if dec <= s["tol"] and value < self.safe_value:
            self.safe_stepsize, self.safe_value, self.safe_grad = middle, value, grad
        self.done = err <= s["tol"]
        to_middle = dec > 0.0 or value >= self.value_low
        to_low = slope * (high - low) >= 0.0 and not to_middle
        if to_middle or to_low:
            self.cubic_ref, self.value_cubic_ref = high, self.value_high
        else:
            self.cubic_ref, self.value_cubic_ref = low, self.value_low
        if to_middle:
            self.high, self.value_high, self.slope_high = middle, value, slope
        if to_low:
            self.high, self.value_high, self.slope_high = low, self.value_low, self.slope_low
        if not to_middle:
            self.low, self.value_low, self.slope_low = middle, value, slope
        too_small = delta <= s["interval_threshold"]
        self.failed = (self.count + 1 >= s["max_linesearch_steps"] or (too_small and self.safe_stepsize > 0.0)) \
            and not self.done
        self._moved(middle, value, grad, slope, dec, curv, err)

    def _moved(self, step, value, grad, slope, dec, curv, err) -> None:
        self.count += 1
        self.stepsize, self.value, self.grad, self.slope = step, value, grad, slope
        self.decrease_error, self.curvature_error, self.error = dec, curv, err

    def _info(self, step: float, dec: float, curv: float) -> str:
        return (f"INFO: optax.scale_by_zoom_linesearch:\nValue at current params: {self.value_init}\n"
                f"Slope along update direction: {self.slope_init}\nStepsize reached: {step}\n"
                f"Decrease Error: {dec}\nCurvature Error: {curv}")

    def safe_step(self) -> None:
        if self.s["verbose"]:
            self._report()
        if self.safe_stepsize > 0.0 or math.isinf(self.decrease_error):
            self.stepsize, self.value, self.grad = self.safe_stepsize, self.safe_value, self.safe_grad

    def _report(self) -> None:
        """Optax's account of a failed search (``_try_safe_step`` and ``_failure_diagnostic``)."""
        lines = [self._info(self.stepsize, self.decrease_error, self.curvature_error)]
        length = abs(self.low - self.high)
        if length <= self.s["interval_threshold"]:
            lines.append(FLAG_INTERVAL_TOO_SMALL + f" Interval length: {length}.")
        if self.safe_stepsize > 0.0:
            lines.append(FLAG_CURVATURE_COND_NOT_SATISFIED + f" Stepsize ensuring sufficient decrease: "
                                                            f"{self.safe_stepsize}.")
        else:
            lines.append(FLAG_NO_STEPSIZE_FOUND)
            descent = self.slope_init < 0.0
            if not descent:
                lines.append(FLAG_NOT_A_DESCENT_DIRECTION + f"The slope (={self.slope_init}) at stepsize=0 should be "
                                                           "negative")
            else:
                lines.append("Consider augmenting the maximal number of linesearch iterations.")
                if self.stepsize < float(torch.finfo(torch.float32).eps):
                    lines.append(f"Computed stepsize (={self.stepsize}) is below machine precision, consider passing "
                                 "to higher precision (float64).")
                if abs(self.slope_init) > 1e16:
                    lines.append("Very large absolute slope at stepsize=0. The objective is badly conditioned.")
            if math.isinf(self.decrease_error):
                lines.append("Cannot even make a step without getting Inf or Nan. The linesearch won't make a step and "
                             "the optimizer is stuck.")
            else:
                lines.append("Making an unsafe step, not decreasing enough the objective. Convergence of the solver "
                             "is compromised as it does not reduce values.")
        print("\n".join(lines))

    def run(self) -> None:
        while not (self.done or self.failed):
            self.zoom() if self.interval_found else self.search_interval()
            if self.failed:
                self.safe_step()


def scale_by_zoom_linesearch(max_linesearch_steps: int, max_learning_rate: float | None = None, tol: float = 0.0,
                             increase_factor: float = 2.0, slope_rtol: float = 1e-4, curv_rtol: float = 0.9,
                             approx_dec_rtol: float | None = 1e-6, stepsize_precision: float = 1e-5,
                             initial_guess_strategy: str = "keep", verbose: bool = False) -> GradientTransformation:
    """A step size meeting the strong Wolfe conditions (sufficient decrease, ``slope_rtol``; small
    curvature, ``curv_rtol``), found by growing the step until an interval brackets one, then
    zooming by cubic, quadratic or bisection interpolation (``optax.scale_by_zoom_linesearch``,
    Nocedal and Wright's Algorithms 3.5-3.6). ``initial_guess_strategy``: ``"one"`` or ``"keep"``
    (the last step size)."""
    if initial_guess_strategy not in ("one", "keep"):
        raise ValueError(f"Unknown initial guess strategy: {initial_guess_strategy}")
    settings = dict(max_linesearch_steps=max_linesearch_steps, max_stepsize=max_learning_rate, tol=tol,
                    increase_factor=increase_factor, slope_rtol=slope_rtol, curv_rtol=curv_rtol,
                    approx_dec_rtol=approx_dec_rtol, interval_threshold=stepsize_precision, verbose=verbose)

    def init(params):
        dtype = _dtype_of(params)
        info = ZoomLinesearchInfo(torch.tensor(0), torch.tensor(math.inf), torch.tensor(math.inf))
        return ScaleByZoomLinesearchState(torch.tensor(1.0, dtype=dtype), torch.tensor(math.inf, dtype=dtype),
                                          zeros_like(params), info)

    def update(updates, state, params=None, *, value=None, grad=None, value_fn=None, **extra_args):
        kwargs = _fn_kwargs(value_fn, extra_args, "scale_by_zoom_linesearch", value, grad)
        guess = 1.0 if initial_guess_strategy == "one" else float(state.learning_rate)
        search = _Zoom(settings, lambda p: value_and_grad_of(value_fn, p, **kwargs), params, updates, float(value),
                       grad, guess)
        search.run()
        dtype = state.learning_rate.dtype
        out = tree_map(lambda u: search.stepsize * u, updates)
        info = ZoomLinesearchInfo(torch.tensor(search.count), torch.tensor(search.decrease_error),
                                  torch.tensor(search.curvature_error))
        return out, ScaleByZoomLinesearchState(torch.tensor(search.stepsize, dtype=dtype),
                                               torch.tensor(search.value, dtype=dtype), search.grad, info)

    return GradientTransformation(init, update)


def value_and_grad_from_state(value_fn: Callable[..., Any]) -> Callable[..., tuple[torch.Tensor, Any]]:
    """``value_fn``'s loss and gradient at ``params``, taken from a line search's state when it
    holds them for these params (the last trial's), else computed (``optax.value_and_grad_from_state``):
    call ``value_and_grad(params, state=opt_state)``."""

    def value_and_grad(params: Any, *args: Any, state: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        value, grad = _get(state, "value"), _get(state, "grad")
        if value is None or grad is None:
            raise ValueError("Value or gradient not found in the state. Make sure that these values are stored in the "
                             "state by the optimizer.")
        if torch.isfinite(torch.as_tensor(value)) and grad is not None:
            return value, grad
        own = getattr(value_fn, "value_and_grad", None)
        if own is not None:
            return own(params, *args, **kwargs)
        return value_and_grad_of(lambda p, **kw: value_fn(p, *args, **kw), params, **kwargs)

    return value_and_grad


def _get(state: Any, field: str) -> Any:
    """The one ``field`` of the state's nodes (Optax's ``tree.get``): None when no node has it, a
    ``KeyError`` naming it when several do."""
    def has(node: Any) -> bool:
        return field in getattr(node, "_fields", ())

    found = [getattr(n, field) for n in optree.tree_leaves(state, is_leaf=has, none_is_leaf=True) if has(n)]
    if len(found) > 1:
        raise KeyError(f"the state holds {len(found)} fields named {field!r}: value_and_grad_from_state needs exactly "
                       "one (a line search's)")
    return found[0] if found else None
