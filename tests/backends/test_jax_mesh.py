"""`zero.backends.jax_mesh`: Optax on a JAX device mesh, its state placed by a `zero.Plan`.

The JAX side runs in a subprocess with 8 CPU devices (`jax_mesh_checks.py`: XLA's device count
is fixed when jax starts), once for the module; the tests judge its figures. The two-executor
test runs the same saved plans on 4 gloo ranks with `ZeroRedundancyOptimizer`.
"""

import json
import pathlib
import re
import subprocess
import sys

import jax_mesh_workers as w
import numpy as np
import pytest
from helpers import run_ranks
from jax_mesh_twin import SHAPES
from xla_devices import environ_with_devices

pytest.importorskip("optax", reason="the JAX mesh executor needs the zero[jax] extra")

import zero  # noqa: E402

HERE = pathlib.Path(__file__).parent
SLOTS = {"adamw": 2, "lion": 1, "clip_adam": 2}  # per-param state leaves: (mu, nu) or mu
CASES = [f"{rule}-{kind}-float64" for rule in SLOTS for kind in ("flat", "whole")] + [
    "adamw-flat-float32", "clip_adam-whole-float32", "adamw-flat-mixed"]  # mixed: bf16 and float32 buffers


def twin_plans() -> list[str]:
    metas = zero.param_metas(w.twin_model())
    return [zero.make_plan(metas, 4, "flat", bucket_numel=400).to_json(),
            zero.make_plan(metas, 4, "sorted_greedy").to_json()]


# the module on one worker under -n 2, its fixture once per session: a worker may run other
# modules' tests between this module's, and a module fixture would run the JAX side again
# (its first test's bound covers the JAX side: about 200 s on 2 cores beside another worker)
pytestmark = [pytest.mark.xdist_group("jax_mesh"), pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def mesh_run(tmp_path_factory) -> dict:
    plans = tmp_path_factory.mktemp("jax_mesh") / "plans.json"
    plans.write_text(json.dumps(twin_plans()))
    env = environ_with_devices(8)
    out = subprocess.run([sys.executable, str(HERE / "jax_mesh_checks.py"), str(plans)], capture_output=True,
                         text=True, env=env, timeout=540)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("case", CASES)
def test_mesh_steps_equal_optax_unsharded(mesh_run, case):
    """50 steps under a flat plan (3 buffers) and a whole-param plan on 8 devices, uneven sizes."""
    r = mesh_run["parity"][case]
    tol = 1e-12 if case.endswith("float64") else 1e-6  # bf16 leaves step elementwise alike: exact
    assert r["rel"] <= tol, f"{case}: params differ from Optax's by {r['rel']}"
    assert r["state_rel"] <= 10 * tol, f"{case}: gathered state differs from Optax's by {r['state_rel']}"


@pytest.mark.parametrize("case", CASES)
def test_each_device_holds_the_plans_state_bytes(mesh_run, case):
    """The plan accounts torch's per-param scalars (Adam's ``step``); Optax keeps one count, replicated."""
    r, slots = mesh_run["parity"][case], SLOTS[case.split("-")[0]]
    assert r["bytes"] == r["mesh_bytes"], f"{case}: Plan.mesh_state_bytes against the devices"
    per_param = [p - s for p, s in zip(r["plan_bytes"], r["scalar_bytes"])]
    owned = [n * slots * r["itemsize"] for n in r["owned"]]
    if case.endswith("mixed"):  # a bf16 and a float32 buffer per bucket: the plan counts each in its dtype
        assert r["init_bytes"] == r["bytes"] == per_param and r["buffers"] == 4
    elif "-flat-" in case:
        assert r["init_bytes"] == r["bytes"] == per_param, f"{case}: bytes per device against the plan's"
    else:  # a row per rank, padded to the longest: the busiest rank's bytes on every device
        assert owned == per_param, f"{case}: each device's own elements against the plan's rank"
        assert r["init_bytes"] == r["bytes"] == [max(per_param)] * 8, f"{case}: rows padded to the busiest"


@pytest.mark.parametrize("case", CASES)
def test_init_never_holds_the_state_whole_on_a_device(mesh_run, case):
    """What the compiled init allocates on one device: its slice and the replicated count (each
    output rounded up to 64 bytes by the allocator), against the whole state."""
    r = mesh_run["parity"][case]
    slack = 64 * (2 * r["buffers"] + 1)
    assert r["init_allocates"] <= max(r["bytes"]) + slack < r["state_whole"], (case, r["init_allocates"])


@pytest.mark.parametrize("case", CASES)
def test_compiles_once_and_gathers_each_buffer_once(mesh_run, case):
    r = mesh_run["parity"][case]
    assert r["compiles_after_first"] == 0, f"{case}: steps after the first compiled again"
    assert r["collectives"]["all-gather"] == r["buffers"], f"{case}: one all-gather per buffer"
    assert r["collectives"]["all-reduce"] <= (1 if case.startswith("clip") else 0), f"{case}: all-reduces"


ERRORS = {
    "mesh_size": r"ValueError: the plan is for 4 ranks but mesh axis 'data' has 8 devices",
    "other_params": r"ValueError: the plan was made for other params: param 3 \('w1' in the plan\) has shape",
    "extra_param": r"ValueError: the plan is for 5 params but the tree has 6 leaves",
    "gather_other_params": r"ValueError: the plan was made for other params: param 0 \('b1' in the plan\) has shape",
    "axis": r"ValueError: the mesh has no axis 'model'",
    "not_a_plan": r"TypeError: plan must be a zero.Plan",
    "lamb": r"ValueError: this transformation does not treat every element alike: param 'b1'",
    "mask": r"ValueError: this transformation does not treat every element alike: param 'emb'",
    "muon": r"ValueError: optimizer state leaf \.inner_states\['adam'\]\.inner_state\[0\]\.mu\['b1'\] has shape",
    "adafactor": r"ValueError: optimizer state leaf \[0\]\.v_row\['emb'\] has shape \(16,\)",
    "frozen": r"ValueError: the plan marks param 'b2' frozen",
    "hybrid_global_norm": r"ValueError: this transformation does not treat every element alike: param 'b1' gets "
                          r"another update \(step \d\) under the hybrid plan",
    "hybrid_flat_adafactor": r"ValueError: this transformation does not treat every element alike: param 'b1' .* "
                             r"under the hybrid plan, .* add it to whole=",
    "hybrid_dims_by_name": r"(?s)ValueError: this transformation cannot step packed buffers .*\(Muon's dimension "
                           r"numbers or a mask as a dict by name\) cannot be read on the buffers: give it as a "
                           r"function of the tree",
    "split_heads": r"ValueError: the plan cuts 'w1' \(1 params\) at head edges \(split_heads=True\), which "
                   r"zero.ZeroRedundancyOptimizer executes",
    "hybrid_gather": r"ValueError: gather_state moves element-wise state .* a hybrid plan's whole params",
    "grads_tree": r"ValueError: the grads' tree .* is not the params'",
}


ORBAX_ERRORS = {
    "other_rule": r"ValueError: this transformation's state has '0.trace', which the checkpoint at .* lacks "
                  r"\(it holds \['0.count', '0.mu', '0.nu'\]\)",
    "other_params": r"ValueError: param 'w1' has shape \(16, 34\) here but \(16, 33\) in the checkpoint",
    "no_checkpoint": r"ValueError: no zero Orbax checkpoint at .*nothing",
}


@pytest.mark.parametrize("where, case", [("errors", c) for c in sorted(ERRORS)] +
                         [("orbax", c) for c in sorted(ORBAX_ERRORS)])
def test_wrong_input_is_an_error_naming_it(mesh_run, where, case):
    """Wrong input to the step, and to an Orbax restore (``where``: whose errors)."""
    import re

    expected, got = (ERRORS if where == "errors" else ORBAX_ERRORS)[case], (
        mesh_run["errors"] if where == "errors" else mesh_run["orbax"]["errors"])[case]
    assert re.match(expected, got), got


@pytest.mark.timeout(300)
def test_one_plan_two_executors_torch_ranks_and_a_jax_mesh(mesh_run):
    """Saved plans of a torch model (flat, whole), 20 AdamW steps from the same numbers on 4 gloo
    ranks and on a 4-device mesh: the same params, the same state per rank."""
    ranks = run_ranks(w.run_plans, 4, twin_plans(), timeout=240)
    for k, (kind, jax_side) in enumerate(zip(("flat", "whole"), mesh_run["two_executors"])):
        torch_params = [np.asarray(p) for p in ranks[0][k]["params"]]
        assert [p.shape for p in torch_params] == SHAPES
        for rank in ranks[1:]:
            assert rank[k]["params"] == ranks[0][k]["params"], f"{kind}: torch ranks disagree"
        for i, (a, b) in enumerate(zip(jax_side["params"], torch_params)):
            rel = np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b))
            assert rel <= 1e-12, f"{kind}: param {i} differs between the executors by {rel}"
        torch_bytes = [rank[k]["state_bytes"] for rank in ranks]
        expected = torch_bytes if kind == "flat" else [max(torch_bytes)] * 4  # rows padded to the busiest
        assert jax_side["state_bytes"] == expected, f"{kind}: state bytes {jax_side['state_bytes']} vs {torch_bytes}"


def test_state_moves_to_a_torch_checkpoint_and_back(mesh_run):
    """10 mesh steps, 10 torch steps from the gathered state saved with torch.save, 10 mesh steps
    from torch's state placed again: equal to 30 mesh steps (float64)."""
    r = mesh_run["checkpoint"]
    assert r["rel"] <= 1e-12, r
    assert r["bytes"] == r["plan_bytes"]


def test_a_plan_along_one_axis_of_a_two_axis_mesh(mesh_run):
    """Data 4 x model 2: the state sharded along "data", each "model" pair holding the same slice."""
    r = mesh_run["two_axes"]
    assert r["rel"] <= 1e-12, r
    assert r["bytes"] == r["plan_bytes"]


@pytest.mark.parametrize("name", ["muon", "adafactor", "soap"])
def test_hybrid_plan_steps_each_whole_param_on_its_owner_equal_to_optax(mesh_run, name):
    """``make_plan(..., "flat", optimizer="muon")`` (Adafactor: every param whole, for its per-param
    RMS clipping and scaling; SOAP, a user's own transformation, `jax_soap`) on 8 devices: 20
    float32 steps equal unsharded Optax."""
    r = mesh_run["hybrid"][name]
    assert r["rel"] <= 1e-5, r["rel"]
    assert r["compiles_after_first"] == 0
    assert r["collectives"]["all-reduce"] == 0  # no device computes another's whole param
    assert r["bytes"] == r["device_bytes"], "device_bytes predicts what each device holds"
    assert min(r["bytes"]) == max(r["bytes"]) >= max(r["own_bytes"]), "rows padded to the busiest rank's"
    if name in ("muon", "soap"):  # the plan counts the state tensors; the rows also carry the rule's counts (and
        assert 0 < r["bytes"][0] - r["mesh_bytes"][0] <= 64, (r["bytes"], r["mesh_bytes"])  # Muon's coefficients)


@pytest.mark.parametrize("name", ["muon", "adafactor"])
def test_hybrid_rules_step_matrices_and_vectors_fed_back_on_jax_make_meshs_mesh(mesh_run, name):
    """24 steps, each fed the last one's params, of a model with vectors beside its matrices, on
    ``jax.make_mesh``'s mesh (``Explicit`` axes, JAX's default): equal to Optax unsharded. Before,
    the step failed there, at the first step or the second."""
    r = mesh_run["hybrid_fed_back"][name]
    assert r["vectors"] == ["b1", "b2"] and r["axis_types"] == ["AxisType.Explicit"]
    assert r["rel"] <= 1e-5, r["rel"]


def test_a_damaged_orbax_checkpoint_is_refused_and_one_without_checksums_restores_with_a_warning(mesh_run):
    r = mesh_run["orbax"]["errors"]
    # a damaged data file: named by zero's checksum, or by tensorstore's own check of the file
    assert re.match(r"ValueError: the checkpoint at '.*orbax_damaged' is damaged, so nothing was restored: the "
                    r"checkpoint's state array '\w+(\.b\d+)?'(, elements \d+\.\.\d+, does not match its checksum| "
                    r"cannot be read \(ValueError: DATA_LOSS)", r["damaged"]), r["damaged"]
    assert re.match(r"ValueError: the checkpoint at '.*orbax_tampered' is damaged, so nothing was restored: the "
                    r"checkpoint's state array 'n\d+\.b\d+', elements \d+\.\.\d+, does not match its checksum",
                    r["mismatch"]), r["mismatch"]
    assert len(r["unverified"]) == 1 and r["unverified"][0].startswith(
        "UnverifiedCheckpointWarning: the checkpoint at") and "has no checksums (saved by an older zero)" in \
        r["unverified"][0]


def test_hybrid_muon_orthogonalises_each_matrix_once_on_its_owner(mesh_run):
    """Newton-Schulz is 5 steps of 3 matmuls a matrix: the compiled step holds as many dots as
    Optax's own unsharded step (each matrix once), all within device branches, each branch the
    15 of each matrix its rank owns (GSPMD would run them on every device)."""
    r = mesh_run["hybrid"]["muon"]
    owned = [sum(1 for rank in r["whole"].values() if rank == k) for k in range(8)]
    assert r["dots"] == r["unsharded_dots"] == 15 * len(r["whole"])
    assert r["branch_dots"] == [15 * n for n in owned], (r["branch_dots"], owned)


def test_hybrid_soap_decomposes_each_factor_once_on_its_owner(mesh_run):
    """Each factor's eigendecomposition (LAPACK's syevd, as XLA's CPU backend calls it) appears in
    the compiled step as often as in Optax's own unsharded step, each within the branch of the
    device that owns its param; and the JAX SOAP equals zero's torch SOAP in float64 (to the
    float32 QR's rounding, which two LAPACKs round apart)."""
    r = mesh_run["hybrid"]["soap"]
    factors = {"t": 3, "w1": 2, "w2": 2, "w3": 2}  # the vectors keep none
    assert sorted(r["whole"]) == sorted(factors)
    assert r["eighs"] == r["unsharded_eighs"] == sum(factors.values())
    assert r["branch_eighs"] == [sum(n for p, n in factors.items() if r["whole"][p] == k) for k in range(8)]
    assert mesh_run["soap_against_zero"] <= 1e-6, mesh_run["soap_against_zero"]


def test_orbax_save_at_8_flat_restores_at_4_whole_and_continues(mesh_run):
    """10 steps on 8 devices (flat plan), saved with Orbax over an older save, restored on 4
    devices under a whole-param plan, 10 more: equal to 20 uninterrupted steps; each device read
    exactly its own rank's state, the padding of its row none."""
    r = mesh_run["orbax"]
    assert r["rel"] <= 1e-6, r["rel"]
    assert r["reads"] == r["own_bytes"]
    assert r["restored_bytes"] == r["device_bytes"] == [max(r["own_bytes"])] * 4
    assert r["siblings"] == [], "a replaced checkpoint leaves nothing beside it"


def test_orbax_hybrid_muon_saved_at_8_restores_at_2_and_continues(mesh_run):
    """Muon's hybrid state (flat buffers and each rank's rows) saved at 8 devices, restored at 2,
    where each device owns several matrices: 10 more steps equal 20 uninterrupted; each device
    read its own state (its flat slice and its matrices' momenta), the padding of its rows none."""
    r = mesh_run["hybrid_orbax"]
    assert r["rel"] <= 1e-5, r["rel"]
    assert all(len(names) >= 2 for names in r["owned"]), r["owned"]
    assert r["bytes"] == r["device_bytes"]
    assert r["reads"] == r["own_bytes"] and max(r["reads"]) < r["bytes"][0], (r["reads"], r["bytes"])
    assert r["round_trip_equal"] and all(r["round_trip_equal"]), "Orbax -> DCP (Optax paths) -> Orbax changed it"
    assert r["no_tx"].startswith("ValueError: a hybrid plan's state"), r["no_tx"]


def test_per_head_muon_on_jax_attention_kernels_steps_each_head_matrix_on_its_owner(mesh_run):
    """Attention kernels in Flax's (in, heads, head_dim) layout, Optax's Muon reading the head axis
    as a batch axis, under a hybrid plan that costs each head's matrix (``muon(heads=...)`` by
    name: the 3-D kernels kept whole on owners): 20 float32 steps equal Optax unsharded, each
    owner's branch running its params' Newton-Schulz dots only; and in float64 the numbers of
    zero's torch per-head Muon on the same weights in torch's (heads * head_dim, in) layout."""
    r = mesh_run["hybrid"]["per_head_muon"]
    assert sorted(r["whole"]) == ["kv", "q", "w"], r["whole"]
    assert r["rel"] <= 1e-5, r["rel"]
    assert r["compiles_after_first"] == 0 and r["collectives"]["all-reduce"] == 0
    owned = [sum(1 for rank in r["whole"].values() if rank == k) for k in range(8)]
    assert r["dots"] == r["unsharded_dots"] == 15 * 3  # a kernel's heads in one batched dot a matmul
    assert r["branch_dots"] == [15 * n for n in owned], (r["branch_dots"], owned)
    assert mesh_run["per_head_against_zero"] <= 1e-12, mesh_run["per_head_against_zero"]
