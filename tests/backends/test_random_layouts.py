"""Random layouts (#66 item 4): params of drawn shapes (uneven matrices, a vector, an embedding)
on 1-4 ranks, under a drawn executor (ZeRO flat, hybrid, whole-param; FSDP2), rule and dtype
(bf16 with float32 masters under ZeRO), each equal to one process or refused by a ``ValueError``
naming a param. The seed is fixed per run (``ZERO_LAYOUT_SEED``, default 66) and named in any
failure; ``bench/random_layouts.py`` draws a thousand."""

import os
from collections import Counter

import layout_workers as w
import pytest
from helpers import run_ranks

pytestmark = pytest.mark.timeout(600)

SEED = int(os.environ.get("ZERO_LAYOUT_SEED", "66"))
CASES = {1: 6, 2: 24, 3: 18, 4: 10}  # per number of ranks: 58 cases, one run of the ranks each


@pytest.mark.parametrize("world", sorted(CASES))
def test_each_drawn_layout_equals_one_process_or_is_refused_by_name(world):
    cases = w.draws(SEED + world, CASES[world], worlds=(world,))
    results = run_ranks(w.run_cases, world, cases, timeout=540)
    for rank, got in enumerate(results):
        bad = [(case, res) for case, res in zip(cases, got) if res[0] == "wrong"]
        assert not bad, f"seed {SEED + world}, rank {rank}: {bad[:3]}"
    kinds = Counter(res[0] for res in results[0])
    assert kinds["equal"] >= len(cases) // 2, f"seed {SEED + world}: most draws should step, got {dict(kinds)}"


# Cases the thousand draws found, kept: each once, at its own ranks
FOUND = [
    # a hybrid plan's flat buffer of 9 elements over 4 ranks leaves rank 3 a shard of padding only:
    # Adafactor's clipping (means over each tensor's axes) refused there alone, and the other ranks
    # waited in its all-reduce until gloo's timeout (seed 67 of bench/random_layouts.py)
    {"shapes": [(30, 4), (9,)], "world": 4, "executor": "zero_hybrid", "rule": "adafactor", "dtype": "float64"},
]


def test_layouts_the_draws_found():
    for case in FOUND:
        for rank, got in enumerate(run_ranks(w.run_cases, case["world"], [case], timeout=120)):
            assert got[0][0] == "equal", (case, rank, got)
