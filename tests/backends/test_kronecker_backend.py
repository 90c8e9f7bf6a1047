"""SOAP and Shampoo owned once under every torch executor: ZeRO's hybrid plans (the rule makes the
plan: ``strategy="flat"`` keeps its factored tensors whole) and FSDP2's owner path, equal to one
process, each factor's eigendecomposition or root computed on one rank only (counted), and each
rank's state bytes exactly the plan's. The JAX mesh: tests/backends/test_jax_mesh.py."""

import kronecker_workers as kw
import pytest
from helpers import run_ranks

import zero
from zero.plans.costs import cost_of

pytestmark = pytest.mark.timeout(600)

STEPS = 9  # SOAP: bases found at step 1, refreshed after steps 3 and 6; Shampoo: roots at steps 3, 6 and 9


def _kernel_runs(optimizer: str, name_of_meta) -> int:
    """The runs of each factor's kernel over `STEPS` steps, for one whole param, by the rule's cost model."""
    spec = cost_of(optimizer)
    if optimizer.startswith("soap"):
        return len(spec.sides(name_of_meta)) * (1 + (STEPS - 1) // 3)
    return len(spec.layout(name_of_meta).factor_sizes()) * (STEPS // 3)


@pytest.mark.parametrize("rule, world_sizes", [("soap", (2, 3, 4)), ("shampoo", (3,))])
def test_under_hybrid_plans_each_factor_on_its_owner(rule, world_sizes):
    for world_size in world_sizes:
        results = run_ranks(kw.under_zero, world_size, rule, STEPS)
        first = results[0]
        metas = {m.name: m for m in zero.param_metas(list(kw.make_model("plan").parameters()))}
        assert first["whole"] == [n for n, f in first["factored"].items() if f]  # the rule's tensors with factors
        for rank, r in enumerate(results):
            assert r["worst"] <= 1e-10 and r["same"], (rule, world_size, rank, r["worst"])
            assert r["state_bytes"] == r["planned"], (rule, world_size, rank)
            assert r["runs"] == sum(_kernel_runs(r["optimizer"], metas[n]) for n in r["owned_whole"]), (rule, rank)
        assert sum(first["all_runs"]) == sum(_kernel_runs(first["optimizer"], metas[n]) for n in first["whole"])


@pytest.mark.parametrize("rule", ["soap", "shampoo"])
def test_over_fsdp2_each_factor_on_its_owner(rule):
    results = run_ranks(kw.over_fsdp2, 3, rule, STEPS)
    alone = run_ranks(kw.over_fsdp2, 1, rule, STEPS)[0]
    for r in results:
        assert r["worst"] <= 1e-12, r["worst"]
    assert sum(results[0]["all_runs"]) == alone["runs"]  # once across the ranks, as one process runs them
    assert all(r["runs"] < alone["runs"] for r in results)
