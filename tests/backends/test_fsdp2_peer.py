"""FSDP2 measured as the peer (`zero.backends.fsdp2_peer`): the lazily made chunks are FSDP2's own."""

import pytest
import torch

import zero
from zero.backends.fsdp2_peer import _Chunks, fsdp2_peak
from zero.plans.presets import preset


@pytest.mark.parametrize("shape, n, dim", [((10, 3), 4, 0), ((3, 5), 8, 0), ((0, 4), 3, 0), ((6, 9), 4, 1),
                                           ((1,), 1024, 0), ((4096, 8), 1024, 0)])
def test_each_chunk_is_the_view_fsdp2_makes(shape, n, dim):
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    t = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    want, got = _chunk_with_empty(t, n, dim), _Chunks(t, n, dim)
    assert len(got) == len(want) == n
    for i in (*range(min(n, 6)), n - 1, -1):
        assert (got[i].shape, got[i].stride(), got[i].storage_offset()) == \
            (want[i].shape, want[i].stride(), want[i].storage_offset()), i
        assert torch.equal(got[i], want[i])
    with pytest.raises(IndexError):
        got[n]


@pytest.mark.parametrize("world, rank", [(3, 2), (64, 63)])
def test_the_peak_is_the_same_with_every_chunk_made(world, rank):
    metas = preset("gpt2") if world == 64 else zero.param_metas({"a": (37, 24), "b": (5,), "layers.0.w": (2, 7),
                                                                 "layers.1.w": (24, 37), "head": (1, 3)})
    options = dict(master_dtype=torch.float32, reduce_dtype=torch.float32)
    assert fsdp2_peak(metas, world, rank, **options) == fsdp2_peak(metas, world, rank, every_chunk=True, **options)


def test_the_peak_only_tracker_measures_what_torchs_own_does(monkeypatch):
    """`run`'s tracker keeps the rank's peak alone (`zero.backends.fake_runs.peak_only`), not each
    module's: its run, the peak, every category at it and the bytes sent, equals torch's own
    ``FSDPMemTracker``'s, under FSDP2 with torch's AdamW and under HSDP with zero's state."""
    import zero.backends.fsdp2_peer as peer

    metas = zero.param_metas({"a": (37, 24), "b": (5,), "layers.0.w": (2, 7), "layers.0.v": (24, 24),
                              "layers.1.w": (24, 37), "head": (1, 3)})
    cases = [dict(world_size=3, rank=2), dict(world_size=4, rank=1, replicas=2, zero=True)]
    ours = [peer.run(metas, **case) for case in cases]
    ours_only = peer.peak_only  # torch's own per-module update in its place, the restart kept
    monkeypatch.setattr(peer, "peak_only", lambda tracker_class: type(
        "Torchs", (ours_only(tracker_class),), {"_update_peak_stats": tracker_class._update_peak_stats}))
    assert [peer.run(metas, **case) for case in cases] == ours
