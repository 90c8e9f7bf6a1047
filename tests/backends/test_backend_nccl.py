"""The NCCL path: two tests need 2+ CUDA GPUs, the world-size-1 ones one; all skip on CPU-only
machines (CI has none)."""

import pytest
import torch
import zero_workers as w
from helpers import run_ranks


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs for NCCL; this machine has "
                    f"{torch.cuda.device_count()}")
def test_nccl_matches_torch_zero_with_fused_adam():
    run_ranks(w.nccl_parity, 2, backend="nccl")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for NCCL; this machine has none")
@pytest.mark.parametrize("strategy", ["sorted_greedy", "flat"])
def test_nccl_one_gpu_masters_with_fused_adamw(strategy):
    """World size 1 on NCCL: bf16 params on fp32 masters, fused AdamW, equal to the recipe by hand;
    masters + state bytes exactly the plan's, and no more than that (plus the fp32 grad casts'
    caching) left allocated on the GPU."""
    import master_workers as mw

    (r,) = run_ranks(mw.cuda_masters, 1, strategy, backend="nccl", timeout=300)
    assert r["equal"]
    assert r["held"] == r["planned"], r
    print(f"{strategy}: planned {r['planned']} B, held {r['held']} B, allocated since {r['allocated_since']} B")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for NCCL; this machine has none")
def test_nccl_one_gpu_matches_torch_zero():
    run_ranks(w.nccl_parity, 1, backend="nccl", timeout=300)
