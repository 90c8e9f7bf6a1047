"""Low-bit Adam (`zero.functional.contrib.adamw_8bit` ...): torchao's quantization and numbers,
its rule for which params keep full precision decided by the whole param, and blocks that no
layout changes."""

import math

import helpers
import optree
import pytest
import torch

import zero
import zero.functional as zf
from zero.functional import quantize as Q
from zero.functional import sharding
from zero.functional.contrib import adam_8bit, adamw_4bit, adamw_8bit, scale_by_adam_4bit, scale_by_adam_8bit
from zero.plans.accounting import state_bytes

# mixed sizes: quantized (whole blocks, >= 4,096), over the threshold but not whole blocks, small
SHAPES = [(64, 128), (100,), (4096,), (48, 96), (41, 100), (8192,), (33,)]


def _grads(k: int, shapes=SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(k)
    return [torch.randn(s, generator=gen) for s in shapes]


def _params(shapes=SHAPES, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def _dequantized(moment, bits: int, signed: bool) -> torch.Tensor:
    return Q.dequantize(moment, Q.qmap(bits, signed), bits) if isinstance(moment, Q.Quantized) else moment.reshape(-1)


# -- torchao: the same maps, the same numbers (its first step compiles: one run per rule) ---------

@pytest.mark.parametrize("bits", [8, 4])
def test_the_quantization_maps_are_torchaos(bits):
    ao = pytest.importorskip("torchao.optim.subclass_8bit" if bits == 8 else "torchao.optim.subclass_4bit",
                             reason="torchao is a test dependency (make installs it)")
    for signed, theirs in ((True, ao.get_qmap_signed()), (False, ao.get_qmap_unsigned())):
        assert torch.equal(Q.qmap(bits, signed), torch.tensor(theirs, dtype=torch.float32))


@pytest.mark.parametrize("bits,block", [(8, 256), (4, 128)])
def test_quantize_rounds_to_the_nearest_code_as_torchao(bits, block):
    pytest.importorskip("torchao.optim", reason="torchao is a test dependency (make installs it)")
    from torchao.optim import quant_utils as qu
    x = torch.randn(64 * block, generator=torch.Generator().manual_seed(3))
    x[:block] = 0  # a block of zeros
    for signed in (True, False):
        v = x if signed else x.abs()
        table = Q.qmap(bits, signed)
        ours = Q.quantize(v, table, bits, block, tuple(v.shape))
        scaled, scale = qu.scale_tensor(v, block)
        codes = (qu.quantize_8bit_with_qmap if bits == 8 else qu.quantize_4bit_with_qmap)(scaled, table)
        theirs = codes if bits == 8 else (codes[::2] << 4) | codes[1::2]
        assert torch.equal(ours.codes, theirs) and torch.equal(ours.scale, scale)
        assert torch.equal(Q.dequantize(ours, table, bits), qu.dequant_with_qmap(codes, table, scale))


@pytest.mark.parametrize("bits", [8, 4])
def test_codes_at_the_edges_are_torchaos(bits):
    """Each map value, each half-way point and the floats beside them (where rounding turns):
    the code torchao's binary search and rounding give."""
    ao = pytest.importorskip("torchao.optim.quant_utils", reason="torchao is a test dependency (make installs it)")
    search = ao.quantize_8bit_with_qmap if bits == 8 else ao.quantize_4bit_with_qmap
    for signed in (True, False):
        table = Q.qmap(bits, signed)
        halves = table[:-1] + (table[1:] - table[:-1]) * 0.5
        points = torch.cat([table, halves, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1e-12])])
        edges = torch.cat([points, *(torch.nextafter(points, torch.full_like(points, d)) for d in (2.0, -2.0))])
        edges = edges[(edges >= -1) & (edges <= 1)]
        assert torch.equal(Q.codes_of(edges, table), search(edges, table))


@pytest.mark.parametrize("rule,cls,inplace", [(adamw_8bit, "AdamW8bit", True), (adamw_4bit, "AdamW4bit", True),
                                              (adam_8bit, "Adam8bit", False)])
def test_twenty_steps_equal_torchaos(rule, cls, inplace):
    """One process, 20 steps, params within rel 1e-3 (measured: under 1e-6), the moments' codes
    within one step of torchao's and their scales equal to rounding; the params below the
    threshold keep full-precision moments in both, within 1e-5 of their largest. ``inplace``:
    `zero.functional.Optimizer`'s kernel; else the pure ``update``."""
    torchao_optim = helpers.torchao_optim()
    decay = 0.1 if "W" in cls else 0.01
    ours, theirs = _params(), [p.clone().requires_grad_() for p in _params()]
    ao = getattr(torchao_optim, cls)(theirs, lr=1e-2, weight_decay=decay)
    tx = rule(1e-2, weight_decay=decay)
    opt = zf.Optimizer([p.requires_grad_() for p in ours], tx) if inplace else None
    state = tx.init(ours) if not inplace else None
    for k in range(20):
        for p, q, g in zip(ours, theirs, _grads(k)):
            p.grad, q.grad = g.clone(), g.clone()
        ao.step()
        if inplace:
            opt.step()
        else:
            updates, state = tx.update([p.grad for p in ours], state, [p.detach() for p in ours])
            ours = [p.detach() + u for p, u in zip(ours, updates)]
    for p, q in zip(ours, theirs):
        assert (p.detach() - q.detach()).abs().max() <= 1e-3 * q.detach().abs().max()
    core = (opt.set_states(0)[tuple(range(len(SHAPES)))].inner_state if inplace else state)[0 if "W" in cls else 1]
    bits = 8 if "8" in cls else 4
    for i, q in enumerate(theirs):
        for field, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
            mine, their = getattr(core, field)[i], ao.state[q][key]
            assert isinstance(mine, Q.Quantized) == hasattr(their, "codes"), (i, field)
            if isinstance(mine, Q.Quantized):
                codes = lambda c: torch.stack([c >> 4, c & 15], -1).reshape(-1) if bits == 4 else c.reshape(-1)  # noqa: E731
                assert (codes(mine.codes).int() - codes(their.codes).int()).abs().max() <= 1, (i, field)
                torch.testing.assert_close(mine.scale, their.scale, rtol=1e-5, atol=0)
            else:
                their = their.detach()
                assert (mine - their).abs().max() <= 1e-5 * their.abs().max(), (i, field)


# -- which params are quantized, and what they hold ----------------------------------------------

@pytest.mark.parametrize("bits,block", [(8, 256), (4, 128)])
def test_which_params_are_quantized_and_their_bytes(bits, block):
    """torchao's rule on the whole param (>= 4,096 elements, whole blocks); 8-bit codes shaped
    like the param, 4-bit two a byte; the bytes are the plan's."""
    tx = (adamw_8bit if bits == 8 else adamw_4bit)(1e-3)
    params = {f"p{k}": torch.zeros(s) for k, s in enumerate(SHAPES + [(4096 + block,), (4095,)])}
    state = tx.init(params)[0]
    for name, p in params.items():
        mu = state.mu[name]
        assert isinstance(mu, Q.Quantized) == (p.numel() >= 4096 and p.numel() % block == 0), name
        if isinstance(mu, Q.Quantized):
            assert mu.codes.dtype == torch.uint8 and mu.scale.dtype == torch.float32
            assert mu.codes.shape == (p.shape if bits == 8 else (p.numel() // 2,))
            assert mu.scale.shape == (p.numel() // block,)
        measured = sum(x.nbytes for x in optree.tree_leaves((state.mu[name], state.nu[name])))
        meta = zero.param_metas({name: tuple(p.shape)})[0]
        assert measured == state_bytes(meta, f"adamw{bits}bit"), name


def test_a_param_in_bfloat16_keeps_full_precision_moments_in_its_dtype():
    """As torchao (``zeros_like(p)``): a small bf16 param's moments are bf16."""
    state = adamw_8bit(1e-3).init([torch.zeros(10, dtype=torch.bfloat16), torch.zeros(4096, dtype=torch.bfloat16)])[0]
    assert state.mu[0].dtype == torch.bfloat16 and isinstance(state.mu[1], Q.Quantized)


# -- blocks in each param's own element space: no layout changes the numbers --------------------

def _sharded_rules(numels: list[int], block: int, cuts: list[tuple[int, int, int]]):
    """A `sharding.Sharding` for leaves that are pieces ``(tensor, start, end)`` of whole 1-D tensors."""
    pieces = {}
    leaves = []
    for t, s, e in cuts:
        leaf = torch.zeros(e - s)
        leaves.append(leaf)
        pieces[id(leaf)] = sharding.Pieces((t,), (e - s,), (s,), block)
    rules = sharding.Sharding(pieces, tuple(torch.float32 for _ in numels), lambda x: x, numels=tuple(numels),
                              shapes=tuple((n,) for n in numels), names=tuple(f"t{k}" for k in range(len(numels))))
    return rules, leaves


@pytest.mark.parametrize("core,block", [(scale_by_adam_8bit, 256), (scale_by_adam_4bit, 128)])
def test_pieces_cut_at_block_edges_step_as_the_whole_bit_for_bit(core, block):
    """A 6,144-element tensor stepped whole, and as two leaves cut at a block edge (a flat plan
    made for the rule): the same bits. Stepped as torchao steps a shard, each piece a tensor of
    its own (its own size decides, 3,072 < 4,096: full precision), the numbers differ: the
    alignment and the whole param's size are what make them equal."""
    n, cut, tx = 6144, 12 * 256, core()
    whole = torch.randn(n, generator=torch.Generator().manual_seed(1))
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(10 + k)) for k in range(5)]

    def run(leaves, rules=None):
        state, out = None, []
        with sharding.installed(rules) if rules else torch.no_grad():
            state = tx.init(leaves)
            for g in grads:
                pieces = [g[:cut], g[cut:]] if len(leaves) == 2 else [g]
                with sharding.stepping(leaves) if rules else torch.no_grad():
                    u, state = tx.update(pieces, state, leaves)
                out.append(torch.cat(u))
        return torch.stack(out), state

    ref, _ = run([whole.clone()])
    rules, leaves = _sharded_rules([n], block, [(0, 0, cut), (0, cut, n)])
    aligned, state = run(leaves, rules)
    assert all(isinstance(m, Q.Quantized) for m in state.mu)
    assert torch.equal(aligned, ref)
    as_torchao, state = run([torch.zeros(cut), torch.zeros(n - cut)])
    assert not any(isinstance(m, Q.Quantized) for m in state.mu)
    assert not torch.equal(as_torchao, ref)


def test_a_cut_inside_a_block_differs():
    """Quantizing a moment in blocks that start off the param's own block edges (what a shard cut
    anywhere would do) gives other codes than its own blocks."""
    x = torch.randn(4 * 256, generator=torch.Generator().manual_seed(2))
    table = Q.qmap(8, True)
    own = Q.dequantize(Q.quantize(x, table, 8, 256, (1024,)), table, 8)
    shifted = torch.cat([x[:100], x[100:100 + 768]])  # blocks from element 100: a cut inside a block
    moved = Q.dequantize(Q.quantize(shifted[100:], table, 8, 256, (768,)), table, 8)
    assert not torch.equal(moved, own[100:868])


def test_a_flat_shard_cut_anywhere_is_refused_naming_the_param():
    rules, leaves = _sharded_rules([6144], 0, [(0, 0, 3000), (0, 3000, 6144)])
    with sharding.installed(rules), pytest.raises(ValueError, match=r"param 0 \(t0\).*blocks of 256.*adamw8bit"):
        adamw_8bit(1e-3).init(leaves)


def test_the_rule_says_which_params_and_blocks_a_plan_must_respect():
    found = sharding.block_sizes(adamw_4bit(1e-3), {"w": ((64, 128), torch.float32), "b": ((128,), torch.float32)})
    assert found == {"w": (4, 128)}
    assert sharding.block_sizes(zf.adamw(1e-3), {"w": ((64, 128), torch.float32)}) == {}


# -- errors at the boundary ---------------------------------------------------------------------

@pytest.mark.parametrize("block", [0, 3, 2.0, True])
def test_a_bad_block_size_is_named(block):
    with pytest.raises(ValueError, match=f"block_size must be an even int >= 2.*{block!r}"):
        adamw_8bit(1e-3, block_size=block)


def test_block_size_stays_fixed_in_an_optimizers_param_groups():
    """A group's settings come from the alias's numeric arguments, but the block size shapes the
    state: it is not one of them."""
    opt = zf.Optimizer([torch.zeros(4096, requires_grad=True)], adamw_8bit(1e-3, block_size=128))
    assert "block_size" not in opt.param_groups[0] and math.isclose(opt.param_groups[0]["lr"], 1e-3)


@pytest.mark.parametrize("rule", [adamw_8bit, adamw_4bit])
def test_the_in_place_step_takes_large_params_in_chunks_with_the_same_bits(monkeypatch, rule):
    """A param of 3.2 chunks (and one below the threshold) stepped in place chunk by chunk, and in
    one piece: the same params and the same codes and scales."""
    from zero.functional.kernels import lowbit

    shapes = [(3 * lowbit.CHUNK_NUMEL + 5 * 256 + 64 * 16,), (300,)]

    def run():
        params = [p.requires_grad_() for p in _params(shapes)]
        opt = zf.Optimizer(params, rule(1e-2))
        for k in range(3):
            for p, g in zip(params, _grads(k, shapes)):
                p.grad = g
            opt.step()
        return params, opt.set_states(0)[(0, 1)]

    chunked = run()
    monkeypatch.setattr(lowbit, "CHUNK_NUMEL", 1 << 30)
    whole = run()
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(chunked), optree.tree_leaves(whole)))


def test_the_plans_rules_are_the_kernels():
    """`zero.plans` (no torch) states torchao's threshold and the step's chunk again: they agree
    with the rule's, size by size, so the plan's bytes and cuts are the rule's."""
    from zero.functional.contrib._lowbit import quantizes
    from zero.plans.costs import cost_of

    assert cost_of("adamw8bit").step_chunk == cost_of("adamw4bit").step_chunk == Q.CHUNK_NUMEL
    for name, block in (("adamw8bit", 256), ("adamw4bit", 128), ("adamw8bit/64", 64)):
        spec = cost_of(name)
        assert spec.block_size == block
        assert [spec.quantizes(n) for n in range(3800, 9000)] == [quantizes(n, block) for n in range(3800, 9000)]


def test_float64_params_step_and_complex_ones_are_refused():
    """float64 params compute in float64, their quantized moments rounded to float32 first (as
    torchao computes in float32); a complex param is a TypeError naming its dtype."""
    params = [torch.randn(4096, dtype=torch.float64), torch.randn(10, dtype=torch.float64)]
    tx = adamw_8bit(1e-2)
    state = tx.init(params)
    for k in range(3):
        updates, state = tx.update([g.double() for g in _grads(k, [(4096,), (10,)])], state, params)
        params = zf.apply_updates(params, updates)
    assert isinstance(state[0].mu[0], Q.Quantized) and state[0].mu[1].dtype == torch.float64
    assert all(p.dtype == torch.float64 and torch.isfinite(p).all() for p in params)
    with pytest.raises(TypeError, match=r"scale_by_adam_8bit keeps real moments.*complex64"):
        tx.init([torch.zeros(8, dtype=torch.complex64)])
