"""The NCCL path: needs 2+ CUDA GPUs, so it skips on CPU-only machines (CI has none)."""

import pytest
import torch
import zero_workers as w
from distributed import run_ranks


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs for NCCL; this machine has "
                    f"{torch.cuda.device_count()}")
def test_nccl_matches_torch_zero_with_fused_adam():
    run_ranks(w.nccl_parity, 2, backend="nccl")
