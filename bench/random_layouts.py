"""A thousand random layouts (#66 item 4): the suite's draw (tests/backends/layout_workers.py) at
scale, each case equal to one process or refused by name; prints the counts by outcome, executor
and rule, and every case that was neither.

    .venv/bin/python bench/random_layouts.py [--cases 1000] [--seed 66]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "backends"), str(ROOT / "tests" / "functional")]

import layout_workers as w  # noqa: E402

from zero.tools.launch import run  # noqa: E402

BATCH = 50  # cases per run of the ranks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=66)
    args = parser.parse_args()
    cases = w.draws(args.seed, args.cases)
    by_world: dict[int, list[dict]] = {}
    for case in cases:
        by_world.setdefault(case["world"], []).append(case)
    start, outcomes, wrong = time.perf_counter(), Counter(), []
    per_executor, per_rule = Counter(), Counter()
    for world, mine in sorted(by_world.items()):
        for k in range(0, len(mine), BATCH):
            batch = mine[k:k + BATCH]
            for case, (kind, detail) in zip(batch, run(w.run_cases, world, batch, timeout=900)[0]):
                outcomes[kind] += 1
                per_executor[(case["executor"], kind)] += 1
                per_rule[(case["rule"], kind)] += 1
                if kind == "wrong":
                    wrong.append((case, detail))
    print(f"{args.cases} cases, seed {args.seed}, {time.perf_counter() - start:.0f} s: {dict(outcomes)}")
    print("by executor:", {f"{e}/{k}": n for (e, k), n in sorted(per_executor.items())})
    print("by rule:", {f"{r}/{k}": n for (r, k), n in sorted(per_rule.items())})
    for case, detail in wrong:
        print("WRONG", case, detail)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
