"""The contract every contrib rule passes (after Optax's ``contrib/_common_test.py`` and
``_sharding_test.py``): stepped in place in one process, over an in-process two-piece sharding,
under a whole-param plan and under a hybrid plan on gloo ranks, it steps what its own pure
``update`` steps on the unsharded params, in float64: the pure route over pieces bit for bit,
the in-place routes (their own kernels: a low-bit step fused param by param, ``param += update``
folded in) within 1e-12 of the largest magnitude.

A new contrib rule adds one row to `RULES`: its factory's keywords and its cost model's name
(`zero.plans.costs`).
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import fixed_grads, run_ranks

import zero
import zero.functional as F
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.functional import sharding
from zero.plans.costs import cost_of

# rule -> (factory, keywords, cost model, block its 1-D pieces are cut at)
RULES = {
    "muon": (F.contrib.muon, {"learning_rate": 0.02, "weight_decay": 0.01}, "muon", 0),
    "adam_8bit": (F.contrib.adam_8bit, {"learning_rate": 1e-2, "weight_decay": 0.01}, "adam8bit", 256),
    "adamw_8bit": (F.contrib.adamw_8bit, {"learning_rate": 1e-2}, "adamw8bit", 256),
    "adam_4bit": (F.contrib.adam_4bit, {"learning_rate": 1e-2}, "adam4bit", 128),
    "adamw_4bit": (F.contrib.adamw_4bit, {"learning_rate": 1e-2, "weight_decay": 0.1}, "adamw4bit", 128),
    "soap": (F.contrib.soap, {"learning_rate": 1e-2, "weight_decay": 0.01, "precondition_frequency": 2}, "soap", 0),
    # the vector v is read as (1, 8192) and preconditioned in blocks of 512 (whole); the bias b steps by the graft
    "shampoo": (F.contrib.shampoo, {"learning_rate": 1e-2, "graft_type": "rmsprop", "start_preconditioning_step": 2,
                                    "preconditioning_compute_steps": 2}, "shampoo", 0),
    "adopt": (F.contrib.adopt, {"learning_rate": 1e-2}, "adopt", 0),
    "ademamix": (F.contrib.ademamix, {"learning_rate": 1e-2, "weight_decay": 0.01}, "ademamix", 0),
    "schedule_free_adamw": (F.contrib.schedule_free_adamw, {"learning_rate": 1e-2, "warmup_steps": 2},
                            "schedule_free_adamw", 0),
    "prodigy": (F.contrib.prodigy, {"weight_decay": 0.01}, "prodigy", 0),
    "dog": (F.contrib.dog, {"init_step": ("heuristic", 1e-4)}, "dog", 0),
    "mechanize": (lambda: F.contrib.mechanize(F.adam(1e-2)), {}, "adam", 0),
    "galore": (F.contrib.galore, {"learning_rate": 1e-2, "rank": 8, "update_proj_gap": 2}, "galore", 0),
    "sophia": (lambda: F.contrib.sophia(1e-2, update_interval=2, hessian_diagonal_fn=F.stateless(
        lambda u, p: F.base.tree_map(lambda g: g * g, u))), {}, "sophia", 0),
    "sam": (lambda: F.contrib.sam(F.adam(1e-2), F.chain(F.contrib.normalize(), F.sgd(0.05))), {}, "adam", 0),
    # Optax's transformations that read whole tensors or the whole model, chained
    "normalize_by_update_norm": (lambda: F.chain(F.normalize_by_update_norm(2.0), F.sgd(1e-2)), {}, "sgd", 0),
    "param_block_norm": (lambda: F.chain(F.scale_by_param_block_norm(0.5), F.adam(1e-2)), {}, "adam", 0),
    "distance_over_gradients": (lambda: F.chain(F.scale_by_distance_over_gradients(1e-2), F.scale(-0.1)), {},
                                "sgd", 0),
}
# rules whose per-tensor norms (Shampoo's graft) join the pieces' partial sums: over pieces within 1e-12, as the
# in-place routes, not bit for bit (a sum in two parts rounds as it will)
JOINS_NORMS = {"shampoo", "prodigy", "dog", "mechanize", "sam", "normalize_by_update_norm", "param_block_norm",
               "distance_over_gradients"}  # (and sums over the model)
SHAPES = {"w1": (64, 96), "w2": (96, 48), "v": (8192,), "b": (37,)}  # quantized matrices and vector, a small bias
STEPS = 5


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(shape, generator=g, dtype=torch.float64) for n, shape in SHAPES.items()}


def _grads(step: int) -> dict[str, torch.Tensor]:
    trainable = [p.requires_grad_() for p in _params().values()]
    return dict(zip(SHAPES, fixed_grads(trainable, step)))


def pure(rule: str) -> dict[str, torch.Tensor]:
    """The rule's own ``update`` on the unsharded params: the reference every executor meets
    (updates added in place, as over pieces). Run once a process (Shampoo's takes 3 s), copied out."""
    return {n: p.clone() for n, p in _pure(rule).items()}


@functools.cache
def _pure(rule: str) -> dict[str, torch.Tensor]:
    factory, kwargs, _, _ = RULES[rule]
    tx, params = factory(**kwargs), _params()
    state = tx.init(params)
    for step in range(STEPS):
        updates, state = tx.update(_grads(step), state, params)
        for n, u in updates.items():
            params[n].add_(u)
    return params


def _assert_equal(ours: dict, ref: dict, where: str, exact: bool = False) -> None:
    for name in SHAPES:
        got, want = ours[name].reshape(ref[name].shape), ref[name]
        off = float((got - want).abs().max() / want.abs().max())
        assert (torch.equal(got, want) if exact else off <= 1e-12), f"{where}: {name} is off by {off:.2e}"


@pytest.mark.parametrize("rule", sorted(RULES))
def test_in_place_in_one_process(rule):
    factory, kwargs, _, _ = RULES[rule]
    params = {n: torch.nn.Parameter(p) for n, p in _params().items()}
    opt = F.Optimizer(list(params.items()), factory(**kwargs))
    for step in range(STEPS):
        for n, g in _grads(step).items():
            params[n].grad = g
        opt.step()
    _assert_equal({n: p.detach() for n, p in params.items()}, pure(rule), "in place")


@pytest.mark.parametrize("rule", sorted(RULES))
def test_over_two_pieces_in_one_process(rule):
    """Each tensor the rule takes element by element cut in two 1-D pieces at a block edge (as a
    flat plan made for it cuts), the matrices a Newton-Schulz rule needs kept whole (as a hybrid
    plan keeps them): the reductions over an installed `Sharding` join the pieces."""
    factory, kwargs, cost, block = RULES[rule]
    model = cost_of(cost)
    metas = {n: zero.ParamMeta(n, SHAPES[n], "float32") for n in SHAPES}
    leaves, pieces, names = [], {}, list(SHAPES)
    for t, n in enumerate(names):
        numel = metas[n].numel
        cuts = [(0, numel)] if model.whole(metas[n]) else _halves(numel, block)
        for start, end in cuts:
            whole = len(cuts) == 1
            leaf = _params()[n].clone() if whole else _params()[n].reshape(-1)[start:end].clone()
            leaves.append((n, start, end, leaf))
            cut_at = block if model.block_for(metas[n]) else 0
            pieces[id(leaf)] = sharding.Pieces((t,), (end - start,), (start,), cut_at)
    installed = sharding.Sharding(pieces, (torch.float64,) * len(names), lambda x: x, numels=tuple(
        metas[n].numel for n in names), shapes=tuple(SHAPES[n] for n in names), names=tuple(names))
    tx, tree = factory(**kwargs), [leaf for *_, leaf in leaves]
    with sharding.installed(installed):
        with sharding.stepping(tree):  # as the optimizers start a state: a start that reads whole tensors asks
            state = tx.init(tree)
        for step in range(STEPS):
            g = _grads(step)
            grads = [g[n] if leaf.shape == g[n].shape else g[n].reshape(-1)[s:e] for n, s, e, leaf in leaves]
            with sharding.stepping(tree):
                updates, state = tx.update(grads, state, tree)
            for leaf, u in zip(tree, updates):  # in place: the installed sharding knows the leaves by identity
                leaf.add_(u)
    out = {n: torch.cat([leaf.reshape(-1) for (m, *_), leaf in zip(leaves, tree) if m == n]) for n in names}
    _assert_equal(out, pure(rule), "two pieces", exact=rule not in JOINS_NORMS)


def _halves(numel: int, block: int) -> list[tuple[int, int]]:
    cut = numel // 2 // block * block if block else numel // 2
    return [(0, cut), (cut, numel)] if 0 < cut < numel else [(0, numel)]


def _whole(cost: str, metas: list) -> list[str]:
    """The matrices, and every other param the rule's cost model says it steps whole (Shampoo's long vector)."""
    return [m.name for m in metas if m.name in ("w1", "w2") or cost_of(cost).whole(m)]


def under_plans(rank: int, world_size: int, kind: str) -> dict[str, dict[str, torch.Tensor]]:
    """Every rule under a whole-param plan or a hybrid plan (its matrices whole, the rest flat)."""
    out = {}
    for rule, (factory, kwargs, cost, _) in RULES.items():
        params = {n: torch.nn.Parameter(p) for n, p in _params().items()}
        metas = zero.param_metas(list(params.items()))
        plan = (zero.make_plan(metas, world_size, "sorted_greedy", optimizer=cost) if kind == "whole" else
                zero.make_plan(metas, world_size, "flat", optimizer=cost, whole=_whole(cost, metas)))
        opt = Zero(list(params.items()), factory, plan=plan, **kwargs)
        for step in range(STEPS):
            for n, g in _grads(step).items():
                params[n].grad = g
            opt.step()
        out[rule] = {n: p.detach().clone() for n, p in params.items()}
    return out


@pytest.mark.parametrize("kind", ["whole", "hybrid"])
def test_under_a_plan_on_two_ranks(kind):
    for rank, ours in enumerate(run_ranks(under_plans, 2, kind, timeout=240)):
        for rule in RULES:
            _assert_equal(ours[rule], pure(rule), f"rank {rank}, {kind} plan, {rule}")
