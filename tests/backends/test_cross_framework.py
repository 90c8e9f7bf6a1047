"""One run moving between frameworks through `zero checkpoint convert`: AdamW on 2 gloo ranks
saved with `zero.backends.checkpoint.save` (DCP), converted to Orbax, continued on a 4-device
JAX mesh with ``optax.adamw`` (`zero.backends.jax_mesh.restore`), saved there with Orbax,
converted to DCP and continued by torch on 3 ranks: each leg equal to the other framework's own
continuation. The JAX side runs in a subprocess (`cross_framework_checks.py`: XLA's device count
is fixed when jax starts)."""

import json
import os
import pathlib
import subprocess
import sys

import cross_framework_workers as w
import numpy as np
import pytest
import torch
from helpers import run_ranks
from xla_devices import environ_with_devices

pytest.importorskip("orbax.checkpoint", reason="the Orbax checkpoints need the zero[jax] extra")

from zero.backends.checkpoint import convert  # noqa: E402
from zero.tools import cli  # noqa: E402

HERE = pathlib.Path(__file__).parent


def rel(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / np.max(np.abs(np.asarray(y))))
               for x, y in zip(a, b))


# the module on one worker under -n 2, its fixture once per session: a worker may run other
# modules' tests between this module's, and a module fixture would run the JAX side again
pytestmark = pytest.mark.xdist_group("cross_framework")


@pytest.fixture(scope="session")
def moves(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("cross")
    torch_at20 = run_ranks(w.train_save_continue, 2, str(folder / "dcp10"), timeout=240)[0]
    env = environ_with_devices(8, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(HERE / "cross_framework_checks.py"), str(folder)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    jax_side = json.loads(out.stdout)
    torch_at30 = run_ranks(w.load_continue, 3, str(folder / "dcp20"), timeout=240)[0]
    return {"folder": folder, "torch_at20": torch_at20, "torch_at30": torch_at30, **jax_side}


@pytest.mark.timeout(600)
def test_torch_run_converted_to_orbax_continues_on_a_mesh_as_in_torch(moves):
    """Steps 10-19 on the mesh from torch's step-10 checkpoint equal torch's own steps 10-19."""
    every = list(range(6))
    assert moves["nodes"] == [{"path": "0.mu", "per_param": True, "dtype": "float32", "params": every},
                              {"path": "0.nu", "per_param": True, "dtype": "float32", "params": every},
                              {"path": "0.count", "per_param": False}]
    assert rel(moves["at20"], moves["torch_at20"]) <= 1e-5


def test_mesh_run_converted_to_dcp_continues_in_torch_at_3_ranks_as_on_the_mesh(moves):
    """Steps 20-29 by torch (3 ranks, a whole-param plan) from the mesh's Orbax checkpoint equal
    the mesh's own steps 20-29."""
    assert rel(moves["torch_at30"], moves["at30"]) <= 1e-5


def test_optax_names_round_trip_bitwise(moves):
    """Orbax -> DCP under Optax's paths (a zero.functional rule's) -> Orbax: params and state unchanged."""
    assert moves["round_trip_equal"] and all(moves["round_trip_equal"])


def test_checkpoint_show_reads_both_formats(moves, capsys):
    folder = moves["folder"]
    assert cli.main(["checkpoint", "show", str(folder / "orbax20"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    keys = {e["key"]: e for e in shown["entries"]}
    assert shown["layout"] == "buffers" and shown["plan"]
    assert keys["state.0.weight.0.mu"]["shape"] == [33, 7] and keys["state.0.weight.0.mu"]["bytes"] == 33 * 7 * 4
    assert cli.main(["checkpoint", "show", str(folder / "orbax10"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"] == "params"
    assert cli.main(["checkpoint", "show", str(folder / "dcp20"), "--json"]) == 0
    dcp_keys = {r["key"] for r in json.loads(capsys.readouterr().out)}
    assert {"model.0.weight", "optim.state.0.weight.exp_avg", "optim.state.0.weight.step"} <= dcp_keys


def _dcp(path, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.ones(3)}, "optim": {"state": {"w": state}}}, checkpoint_id=str(path), no_dist=True)


@pytest.mark.parametrize("state, message", [
    ({"exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3), "max_exp_avg_sq": torch.ones(3)},  # AMSGrad's
     r"torch's optimizer state 'max_exp_avg_sq' has no Optax counterpart"),
    ({"master": torch.ones(3)}, r"the checkpoint holds master weights"),
])
@pytest.mark.filterwarnings("ignore::zero.backends.checksums.UnverifiedCheckpointWarning")  # dcp.save's own: none
def test_convert_refuses_state_it_cannot_name(tmp_path, state, message):
    _dcp(tmp_path / "src", state)
    with pytest.raises(ValueError, match=message):
        convert.to_orbax(tmp_path / "src", tmp_path / "dst")
    assert not (tmp_path / "dst").exists() and os.listdir(tmp_path) == ["src"], "nothing half-written"


def test_convert_cli_needs_a_destination_and_a_format(tmp_path, capsys):
    assert cli.main(["checkpoint", "convert", str(tmp_path)]) == 2
    assert "zero checkpoint convert SRC DST --to orbax|dcp" in capsys.readouterr().err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rule", ["sgd", "functional", "fsdp2"])
@pytest.mark.filterwarnings("ignore::zero.backends.checksums.UnverifiedCheckpointWarning")  # FSDP2's carry none
def test_sgd_momentum_a_zero_functional_rule_and_fsdp2_convert_too(tmp_path, rule):
    """torch's SGD with momentum (``momentum_buffer`` -> ``0.trace``) and zero.functional's adamw
    (state saved under Optax's paths) on one rank, and AdamW under FSDP2 on 2 ranks (saved by
    torch's own ``get_state_dict`` and ``dcp.save``), converted, continued by ``optax.sgd`` /
    ``optax.adamw`` on one device: equal to torch's own continuation."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh
    from jax_mesh_twin import SHAPES, grads

    import zero
    from zero.backends import jax_mesh

    torch_at10 = (run_ranks(w.fsdp2_save_continue, 2, str(tmp_path / "dcp5"), timeout=240) if rule == "fsdp2" else
                  run_ranks(w.other_rule_save_continue, 1, rule, str(tmp_path / "dcp5"), timeout=240))[0]
    meta = convert.to_orbax(tmp_path / "dcp5", tmp_path / "orbax5")
    names = [f"{layer}.{kind}" for layer in range(3) for kind in ("weight", "bias")]
    template = {n: jnp.zeros(s, jnp.float32) for n, s in zip(names, SHAPES)}
    plan, mesh = zero.make_plan(zero.param_metas(template), 1, "flat"), Mesh(np.array(jax.devices()[:1]), ("data",))
    tx = {"sgd": optax.sgd(w.LR, momentum=0.9),
          "functional": optax.inject_hyperparams(optax.adamw)(  # zf.adamw's state
              learning_rate=w.LR, b1=w.BETAS[0], b2=w.BETAS[1], eps=w.EPS, weight_decay=w.WD),
          "fsdp2": optax.adamw(w.LR, b1=w.BETAS[0], b2=w.BETAS[1], eps=w.EPS, weight_decay=w.WD)}[rule]
    params, state = jax_mesh.restore(tmp_path / "orbax5", tx, template, plan, mesh)
    step = jax_mesh.update(tx, plan, mesh)
    for k in range(5, 10):
        params, state = step({n: jnp.asarray(g, jnp.float32) for n, g in zip(names, grads(k))}, state, params)
    per_param = [n["path"] for n in meta["nodes"] if n["per_param"]]
    assert per_param == {"sgd": ["0.trace"], "functional": ["inner_state.0.mu", "inner_state.0.nu"],
                         "fsdp2": ["0.mu", "0.nu"]}[rule]
    assert rel([np.asarray(params[n]) for n in names], torch_at10) <= 1e-5


@pytest.mark.parametrize("zarr3", [False, True])
def test_restore_reads_ranges_of_orbax_arrays_in_either_zarr_version(tmp_path, zarr3):
    """Orbax writes zarr v2 arrays by default and zarr v3 when asked; a restore reads pieces of either."""
    import orbax.checkpoint as ocp

    from zero.backends.orbax_format import Source

    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=zarr3)).save(
        tmp_path / "state", ocp.args.PyTreeSave({"x": np.arange(10.0, dtype=np.float32)}))
    source = Source(tmp_path, {"layout": "params", "nodes": [], "names": []})
    assert source.array("state", "x")[2:5].read().result().tolist() == [2.0, 3.0, 4.0]
