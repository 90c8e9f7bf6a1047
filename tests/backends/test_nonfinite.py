"""Non-finite gradients (`zero.backends.nonfinite`): a NaN in one param's gradient on one rank is
named (the step, the param, the ranks where it appeared) in every mode, and warned of, skipped on
every rank together, or raised, as ``nonfinite=`` says; at no collective of its own."""

import nonfinite_workers as nw
import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.timeout(240)

# where the NaN is said to appear: rank 1 made it (zero reduces the gradients itself), or after
# DDP's all-reduce, in the part of the model its owner (rank 0 here, for 2.weight) steps
LOCAL = "first seen in the gradients of rank 1, before their reduction"
AFTER_DDP = "found after DDP's all-reduce (every rank then holds them: the rank that made them cannot be told)"
WHERE = {"whole": f"{AFTER_DDP} in the part of the model rank 0 steps", "flat": AFTER_DDP, "hybrid": AFTER_DDP,
         "rs": LOCAL, "rs-hybrid": LOCAL, "overlap": AFTER_DDP}


@pytest.mark.parametrize("mode", sorted(nw.MODES))
def test_a_nan_on_one_rank_is_named_on_every_rank_in_every_mode(mode):
    for r in run_ranks(nw.nan_on_one_rank, 2, mode, "warn"):
        first = r["warnings"][0]
        assert first[0] == 2 and first[1].startswith(f"step 3: gradients with NaN or inf in {nw.BAD}, "), first
        assert WHERE[mode] in first[1] and "stepped anyway (nonfinite='warn'" in first[1], first
        assert not r["finite"], "warned, and stepped: the NaN spread"


@pytest.mark.parametrize("mode", ["whole", "rs", "rs-hybrid"])
def test_skip_skips_the_step_on_every_rank_as_if_it_never_was(mode):
    """Three ranks, the NaN on rank 1: every rank skips step 3 (no param, moment or count moves),
    and the run ends bit for bit where a run without that iteration ends."""
    skipped = run_ranks(nw.nan_on_one_rank, 3, mode, "skip", 1, 2, 5)
    without = run_ranks(nw.nan_on_one_rank, 3, mode, "skip", 1, None, 5, 2)
    for r, w in zip(skipped, without):
        assert r["unchanged_at_bad_step"] == [True] * 8 and r["skipped"] == 1 and w["skipped"] == 0
        assert [m for _, m in r["warnings"]] == [m for _, m in r["warnings"][:1]]
        assert r["warnings"][0][1].endswith("the step is skipped on every rank (nonfinite='skip')")
        assert all(torch.equal(a, b) for a, b in zip(r["params"], w["params"]))


@pytest.mark.parametrize("mode", ["flat", "rs", "overlap"])
def test_raise_raises_on_every_rank_naming_the_same_things(mode):
    for r in run_ranks(nw.nan_on_one_rank, 2, mode, "raise", fresh=mode == "overlap"):
        step, text = r["error"]
        assert step == 2 and text.startswith(f"step 3: gradients with NaN or inf in {nw.BAD}, {WHERE[mode]}"), text
        if mode != "overlap":  # its buckets were stepped inside backward, before the end of it
            assert r["unchanged_at_bad_step"] == [True] * 8 and r["finite"]


@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_clean_steps_make_no_collective_for_the_check(policy):
    """Each rank's flag rides in the step's one check-in; names are exchanged only when one flags."""
    for r in run_ranks(nw.clean_steps_collectives, 2, policy):
        assert r == {"check_ins": 3, "names": 0}


def test_bad_policies_and_skip_under_overlap_are_refused(one_rank):
    from zero.backends import ZeroRedundancyOptimizer as Zero

    with pytest.raises(ValueError, match=r"nonfinite must be one of \('warn', 'skip', 'raise'\), got 'ignore'"):
        Zero(torch.nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1, nonfinite="ignore")
    with pytest.raises(ValueError, match=r"nonfinite='skip' cannot be honoured with overlap_with_ddp=True"):
        Zero(torch.nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1, nonfinite="skip", overlap_with_ddp=True)


def _cases():
    """(label, tensors): large tensors (summed first) and small ones (the fused check), clean, with
    NaN or inf, and finite values whose sum overflows (all finite: the sum alone would say not)."""
    from zero.functional.adapters.nonfinite import SUMMED_NUMEL
    big, small = SUMMED_NUMEL + 3, 100
    out = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        huge = torch.finfo(dtype).max
        for label, at, value in (("clean", None, 0.0), ("nan", 7, float("nan")), ("inf", -1, float("inf")),
                                 ("-inf", 0, float("-inf")), ("overflowing sum", None, huge)):
            for where in ("large", "small"):
                tensors = [torch.ones(big, dtype=dtype), torch.ones(small, dtype=dtype), torch.ones(0, dtype=dtype)]
                target = tensors[0 if where == "large" else 1]
                if at is not None:
                    target[at] = value
                elif value:
                    target.fill_(value)
                out.append((f"{dtype} {where} {label}", tensors))
    both = torch.ones(big)
    both[3], both[9] = float("inf"), float("-inf")  # their sum is NaN: still found
    out.append(("+inf and -inf", [both]))
    out.append(("complex nan", [torch.ones(big, dtype=torch.complex64) * complex(1, float("nan"))]))
    out.append(("mixed dtypes", [torch.ones(big, dtype=torch.float64), torch.ones(big), torch.ones(9)]))
    return out


@pytest.mark.parametrize("label,tensors", _cases(), ids=[c[0] for c in _cases()])
def test_the_check_is_exact_on_large_and_small_tensors(label, tensors):
    from zero.functional.adapters.nonfinite import all_finite
    before = [t.clone() for t in tensors]
    assert all_finite(tensors) == all(bool(torch.isfinite(t).all()) for t in tensors), label
    assert all(torch.equal(a, b) or (a.isnan() == b.isnan()).all() for a, b in zip(tensors, before)), "changed"
