"""The schedules' two ways of working out a value: one count in Python floats, counts in a tensor."""

import numpy as np
import pytest
import torch
from alias_cases import SCHEDULES

import zero.functional as F
from zero.functional.schedules import basic

# Optax's parity list, and what it has no twin for: the one-cycle and restart schedules, the
# cosine interpolation, a user's callable inside a join
ALL = SCHEDULES + [
    lambda m: m.piecewise_interpolate_schedule("cosine", 0.1, {10: 0.5, 25: 0.1}),
    lambda m: m.linear_onecycle_schedule(40, 0.1), lambda m: m.sgdr_schedule([dict(
        init_value=0.0, peak_value=0.1, warmup_steps=3, decay_steps=12)] * 3),
    lambda m: m.join_schedules([m.constant_schedule(0.1), lambda k: 0.1 / (1 + k)], [15]),
]


@pytest.mark.parametrize("make", ALL)
def test_one_count_is_worked_out_in_floats_and_equals_the_tensor_of_counts(make):
    """An eager step reads its schedule at one count in Python floats, with no torch op (a dozen
    0-d tensor ops cost more than a small step); a tensor of counts, and a traced count, take
    the tensor formula. The two agree to float64 rounding at every count, negative and past the
    end included, and ``torch.func`` still sees a tensor."""
    schedule = make(F)
    counts, five = torch.arange(-3, 70), torch.tensor(5)
    ints = counts.tolist()
    with _TorchOps() as ops:
        one = [schedule(k) for k in ints]
    with _TorchOps() as read:
        at_five = schedule(five)
    assert ops.called == [] and all(type(v) is float for v in one)
    assert [f.__name__ for f in read.called] == ["dim", "__float__"]  # the count read, then floats only
    expected = schedule.formula(counts.to(torch.float64), basic.TensorOps)
    np.testing.assert_allclose(one, expected.numpy(), rtol=4e-16, atol=0)
    assert at_five == one[ints.index(5)]
    traced = torch.func.vmap(schedule)(counts.to(torch.float64))
    np.testing.assert_allclose(traced.numpy(), expected.numpy(), rtol=0, atol=0)


class _TorchOps(torch.overrides.TorchFunctionMode):
    """Lists the torch functions called inside it."""

    def __init__(self):
        super().__init__()
        self.called = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.called.append(func)
        return func(*args, **(kwargs or {}))
