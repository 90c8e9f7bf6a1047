"""param_metas: every input kind, and a clear error for each bad one."""

import re

import pytest
import torch
from torch import nn

from zero import ParamMeta, param_metas


def test_tensors_and_groups():
    a, b = torch.zeros(3, 4, requires_grad=True), torch.zeros(5, dtype=torch.bfloat16, requires_grad=True)
    c = torch.zeros(2)
    metas = param_metas([{"params": [a, b], "lr": 1.0}, {"params": c}])
    assert [(m.shape, m.dtype, m.group, m.requires_grad) for m in metas] == [
        ((3, 4), "float32", 0, True), ((5,), "bfloat16", 0, True), ((2,), "float32", 1, False)]
    assert metas[0].numel == 12 and metas[0].nbytes == 48 and metas[1].nbytes == 10
    assert [m.name for m in param_metas(iter([a, b]))] == ["0", "1"]


def test_module_names_and_meta_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.LayerNorm(4096))
    metas = param_metas(model)
    assert [m.name for m in metas] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert metas[0].device == "meta" and metas[0].numel == 4096 * 4096
    assert param_metas(model, device="cuda:0")[0].device == "cuda:0"


def test_mapping_of_shapes():
    metas = param_metas({"w": (3, 4), "b": 4, "e": {"shape": [10, 2], "dtype": "bfloat16",
                                                     "requires_grad": False}})
    assert metas == [ParamMeta("w", (3, 4)), ParamMeta("b", (4,)),
                     ParamMeta("e", (10, 2), "bfloat16", requires_grad=False)]


def test_jax_pytree_of_arrays_and_shape_dtype_structs():
    jax = pytest.importorskip("jax", reason="JAX is the optional zero[jax] extra")
    import jax.numpy as jnp

    tree = {"dense": {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros(4, jnp.bfloat16)},
            "emb": [jax.ShapeDtypeStruct((10, 2), jnp.float32)]}
    metas = param_metas(tree)
    by_name = {m.name: m for m in metas}
    assert by_name["dense.kernel"].shape == (3, 4)
    assert by_name["dense.bias"].dtype == "bfloat16"
    assert by_name["dense.bias"].device == "cpu"
    assert by_name["emb.0"].device == "meta"
    # tree_flatten's order, so per-param values map back through the treedef
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    assert [m.shape for m in metas] == [tuple(x.shape) for x in leaves]
    back = jax.tree_util.tree_unflatten(treedef, [m.name for m in metas])
    assert back == {"dense": {"bias": "dense.bias", "kernel": "dense.kernel"}, "emb": ["emb.0"]}


def test_jax_and_torch_name_the_same_params_alike():
    pytest.importorskip("jax", reason="JAX is the optional zero[jax] extra")
    import jax.numpy as jnp

    torch_names = [m.name for m in param_metas(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)))]
    tree = [{"weight": jnp.zeros((3, 2)), "bias": jnp.zeros(3)}, {"weight": jnp.zeros((1, 3)), "bias": jnp.zeros(1)}]
    assert sorted(m.name for m in param_metas(tree)) == sorted(torch_names)
    clash = {"a.b": jnp.zeros(1), "a": {"b": jnp.zeros(2)}}
    with pytest.raises(ValueError, match=re.escape("both named 'a.b' in dotted form (['a']['b'] and ['a.b'])")):
        param_metas(clash)


@pytest.mark.parametrize("obj, exc, words", [
    ([], ValueError, "empty"),
    ({}, ValueError, "empty"),
    ([torch.zeros(2), "x"], TypeError, "params[1] is a str"),
    (torch.zeros(3), TypeError, "single tensor"),
    (42, TypeError, "cannot read parameters: got int"),
    ([{"lr": 1.0}], ValueError, "param group 0 has no 'params'"),
    ({"w": "big"}, TypeError, "parameter 'w'"),
    ({"w": (3, -1)}, ValueError, "shape[1] must be >= 0, got -1"),
    ({"w": {"shape": [2], "dtype": "float13"}}, ValueError, "float13"),
])
def test_bad_inputs_name_the_problem(obj, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        param_metas(obj)


def test_duplicate_and_sparse_parameters():
    a = torch.zeros(3)
    with pytest.raises(ValueError, match=r"params\[1\] is the same tensor as params\[0\]"):
        param_metas([a, a])
    with pytest.raises(ValueError, match=r"params\[2\] is the same tensor as params\[0\]"):
        param_metas([{"params": [a, torch.zeros(1)]}, {"params": [a]}])
    with pytest.raises(ValueError, match="sparse"):
        param_metas([torch.zeros(3, 3).to_sparse()])


def test_a_parameter_generator_with_jax_loaded_warns_nothing():
    pytest.importorskip("jax", reason="the check needs jax imported")
    import warnings

    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [m.shape for m in param_metas(model.parameters())] == [(2, 3), (2,)]


def test_a_meta_is_an_immutable_value_whose_sizes_follow_its_fields():
    m = ParamMeta("w", [3, 4], "bfloat16", group=1)
    assert (m.shape, m.numel, m.nbytes) == ((3, 4), 12, 24)
    same = ParamMeta("w", (3, 4), "bfloat16", "cpu", 1, True)
    assert m == same and hash(m) == hash(same)
    assert m != ParamMeta("w", (3, 4), "bfloat16", group=0)
    moved = m._replace(shape=(5,), dtype="float64")
    assert (moved.numel, moved.nbytes, moved.group) == (5, 40, 1), "replacing fields recomputes the sizes"
    with pytest.raises(AttributeError):
        m.shape = (1,)
    assert repr(m) == "ParamMeta(name='w', shape=(3, 4), dtype='bfloat16', device='cpu', group=1, requires_grad=True)"
    assert ParamMeta.from_dict(m.to_dict()) == m
    with pytest.raises(TypeError, match=re.escape("parameter 'x': shape[1] must be an int, got 2.0")):
        ParamMeta("x", (3, 2.0))
    with pytest.raises(TypeError, match="group must be an int"):
        ParamMeta("x", (3,), group=True)


def test_every_input_kind_gives_the_same_metas():
    jax = pytest.importorskip("jax", reason="JAX is the optional zero[jax] extra")
    shapes = {f"l{i}": (i % 5 + 1, 3) for i in range(50)} | {"b": (7,)}
    with torch.device("meta"):
        module = nn.ParameterDict({k: nn.Parameter(torch.empty(v)) for k, v in shapes.items()})
    tree = {k: jax.ShapeDtypeStruct(v, jax.numpy.float32) for k, v in shapes.items()}

    def by_name(metas):  # a ParameterDict and a JAX dict both list their keys sorted
        return {m.name.strip("[']"): (m.shape, m.dtype, m.numel, m.nbytes) for m in metas}

    plain = by_name(param_metas(shapes))
    assert len(plain) == 51 and by_name(param_metas(module)) == plain == by_name(param_metas(tree))
    assert {m.device for m in param_metas(module)} == {"meta"} == {m.device for m in param_metas(tree)}


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_paused_restores_the_collector(enabled):
    import gc

    from zero.plans.meta import gc_paused

    (gc.enable if enabled else gc.disable)()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), gc_paused():
            raise RuntimeError
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_metadata_pickles_as_built():
    """Sent to another process (a simulation's, a pool's) it arrives whole, numel and nbytes derived."""
    import pickle

    metas = param_metas({"w": (3, 4), "b": (5,)})
    assert pickle.loads(pickle.dumps(metas)) == metas and pickle.loads(pickle.dumps(metas[0])).nbytes == 48
