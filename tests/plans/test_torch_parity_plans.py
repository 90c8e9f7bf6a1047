"""The plan layer reproduces torch's own decisions, checked against torch itself."""

import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch_reference import torch_ddp_assignment, torch_partition

from zero import assign_ddp_buckets, ddp_buckets, param_metas, partition


def random_groups(rng: random.Random):
    groups = []
    for _ in range(rng.randint(1, 4)):
        params = []
        for _ in range(rng.randint(0 if groups else 1, 25)):
            shape = [rng.choice([1, 2, 3, 7, 16, 64, 100]) for _ in range(rng.randint(1, 3))]
            params.append(torch.empty(shape, device="meta", requires_grad=rng.random() > 0.2))
        groups.append({"params": params, "lr": rng.random()})
    return groups


@pytest.mark.parametrize("seed", range(40))
def test_sorted_greedy_equals_torch(seed):
    rng = random.Random(seed)
    groups = random_groups(rng)
    world_size = rng.choice([1, 2, 3, 4, 5, 8, 16, 64])
    expected = torch_partition(groups, world_size)
    flat = [p for g in groups for p in g["params"]]
    got = partition(param_metas(groups), world_size)
    for rank in range(world_size):
        assert [flat[i] for i in got.params_of(rank)] == expected[rank], f"rank {rank}"


def test_sorted_greedy_ties_keep_registration_order():
    params = [torch.empty(10, device="meta", requires_grad=True) for _ in range(7)]
    expected = torch_partition(params, 3)
    got = partition(param_metas(params), 3)
    assert [[params[i] for i in got.params_of(r)] for r in range(3)] == expected


bucket_lists = st.lists(st.lists(st.integers(1, 1000), min_size=1, max_size=6), min_size=1, max_size=8)


@given(bucket_lists, st.integers(1, 6), st.booleans())
def test_assign_ddp_buckets_equals_torch_where_torch_succeeds(buckets, world_size, shard):
    try:
        expected = torch_ddp_assignment(buckets, world_size, shard)
    except AssertionError as e:  # torch's "All indices are disallowed"
        assert "disallowed" in str(e)
        return
    assert assign_ddp_buckets(buckets, world_size, shard) == expected


def test_assign_ddp_buckets_succeeds_where_torch_fails():
    buckets = [[1000, 1000, 1000]]
    with pytest.raises(AssertionError, match="All indices are disallowed"):
        torch_ddp_assignment(buckets, 2, True)
    got = assign_ddp_buckets(buckets, 2, shard_buckets=True)
    assert got == [{0: (0, 1)}, {0: (1, 2)}]


def _torch_rebuilt_buckets(tensors, order, limits):
    """What DDP's reducer computes when it rebuilds buckets in gradient-ready order."""
    indices, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], limits,
                                                         [], list(order))
    return [list(b) for b in indices]


@pytest.mark.parametrize("seed", range(20))
def test_ddp_buckets_equal_ddp_rule(seed):
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    tensors = [torch.empty(rng.choice([10, 1000, 50_000, 300_000, 2_000_000]), dtype=dtype, requires_grad=True)
               for _ in range(rng.randint(1, 40))]
    metas = param_metas(tensors)
    order = list(reversed(range(len(tensors))))
    assert ddp_buckets(metas) == _torch_rebuilt_buckets(
        tensors, order, [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 1024 * 1024])
    assert ddp_buckets(metas, bucket_cap_mb=2) == _torch_rebuilt_buckets(tensors, order, [2 * 1024 * 1024])
    shuffled = rng.sample(range(len(tensors)), len(tensors))
    assert ddp_buckets(metas, bucket_cap_mb=1, order=shuffled) == _torch_rebuilt_buckets(
        tensors, shuffled, [1024 * 1024])
