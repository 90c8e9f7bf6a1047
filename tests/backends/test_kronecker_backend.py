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


@pytest.mark.parametrize("rule, world_sizes", [("soap", (2, 3, 4)), ("shampoo", (2, 3, 4)), ("soap_by_name", (3,))])
def test_under_hybrid_plans_each_factor_on_its_owner(rule, world_sizes):
    """``soap_by_name``: the first layer (an 'embedding') and the biases routed to no factors by
    name: the plan keeps only the other weights whole, the first layer's weight in the shards."""
    for world_size in world_sizes:
        results = run_ranks(kw.under_zero, world_size, rule, STEPS)
        first = results[0]
        model = kw.make_model("plan")
        metas = {m.name: m for m in zero.param_metas(list(model.named_parameters() if rule.endswith("by_name")
                                                          else model.parameters()))}
        factored = [n for n, f in first["factored"].items() if f]  # the rule's tensors with factors
        if rule.endswith("by_name"):
            factored = [n for n, d in kw.by_name(dict.fromkeys(factored)).items() if d is not None]
            assert factored == ["1.weight", "2.weight", "3.weight", "4.weight"]
        assert first["whole"] == factored
        for rank, r in enumerate(results):
            # element by element relative (helpers.worst), as test_hybrid's 1e-9: Shampoo's graft norms join the
            # shards' partial sums, and an element near zero shows their last bits (SOAP's runs are exact)
            assert r["worst"] <= (0.0 if rule.startswith("soap") else 1e-9) and r["same"], (rule, world_size, rank,
                                                                                             r["worst"])
            assert r["state_bytes"] == r["planned"], (rule, world_size, rank)
            assert r["runs"] == sum(_kernel_runs(r["optimizer"], metas[n]) for n in r["owned_whole"]), (rule, rank)
        assert sum(first["all_runs"]) == sum(_kernel_runs(first["optimizer"], metas[n]) for n in first["whole"])


@pytest.mark.parametrize("rule", ["soap", "shampoo"])
def test_over_fsdp2_each_factor_on_its_owner(rule):
    """At 2, 3 and 4 ranks (at 4, a rank with no rows of the 5-wide layer)."""
    alone = run_ranks(kw.over_fsdp2, 1, rule, STEPS)[0]
    for world_size in (2, 3, 4):
        results = run_ranks(kw.over_fsdp2, world_size, rule, STEPS)
        assert results[0]["worst"] <= 1e-12, (world_size, results[0]["worst"])  # (rank 0 compares)
        assert sum(results[0]["all_runs"]) == alone["runs"]  # once across the ranks, as one process runs them
        assert all(r["runs"] < alone["runs"] for r in results), world_size


def _worst(a, b) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("rule", ["soap", "shampoo"])
def test_checkpoints_move_the_factors_between_plans_and_mesh_sizes(tmp_path, rule):
    """ZeRO's hybrid plan at 2 ranks -> sharded checkpoint -> 3 ranks (other owners), and FSDP2 at 2
    ranks -> DCP -> 3: the factors, bases and roots come back where the new plan puts them, and the
    run continues as one process's (the refreshes fall on both sides of the save)."""
    import alias_cases
    import fsdp2_workers as fw

    run_ranks(kw.zero_leg, 2, rule, None, str(tmp_path / "zero"), 0, 4)
    resumed = run_ranks(kw.zero_leg, 3, rule, str(tmp_path / "zero"), None, 4, 4)[0]
    assert _worst(resumed, run_ranks(kw.one_process, 1, rule, 8)[0]) <= 1e-10
    spec = (rule, alias_cases.CONTRIB[rule])
    run_ranks(fw.train_and_save, 2, spec, str(tmp_path / "fsdp2"))
    got = run_ranks(fw.resume_and_train, 3, spec, str(tmp_path / "fsdp2"))[0]
    assert _worst(got, run_ranks(fw.one_process, 1, spec)[0]) <= 1e-12
