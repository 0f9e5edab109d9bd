"""`megatron_rl.collectives`: the same answers in one process and across gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from qwen3_moe_testing import spawn_ranks

from megatron_rl import collectives


def test_without_torch_distributed_a_process_is_its_own_world():
    assert not dist.is_initialized()
    assert collectives.rank_and_world_size() == (0, 1)
    assert collectives.group_device() == torch.device("cpu")
    assert collectives.any_rank(True) and not collectives.any_rank(False)
    assert collectives.all_ranks_agree(True) and not collectives.all_ranks_agree(False)
    assert collectives.sum_over_ranks([1.5, 2]) == [1.5, 2.0]
    out = collectives.mean_over_ranks({"a": 2.0, "b": float("inf")})
    assert out["a"] == 2.0 and math.isnan(out["b"])  # non-finite means become NaN
    collectives.barrier()


def _collectives_worker(rank, world_size, init_method, tmp_dir) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    assert collectives.rank_and_world_size() == (rank, 2)
    assert collectives.group_device() == torch.device("cpu")  # gloo takes CPU tensors
    assert collectives.any_rank(rank == 1) is True
    assert collectives.any_rank(False) is False
    assert collectives.all_ranks_agree(rank == 1) is False
    assert collectives.all_ranks_agree(True) is True
    assert collectives.sum_over_ranks([rank + 0.5, 1.0]) == [2.0, 2.0]
    means = collectives.mean_over_ranks({"x": float(rank), "y": 4.0})
    assert means == {"x": 0.5, "y": 4.0}
    bad = {"x": 1.0, f"only_rank_{rank}": 1.0}
    with pytest.raises(RuntimeError, match=r"only_rank_0.*only_rank_1"):
        collectives.mean_over_ranks(bad)
    collectives.barrier()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_gloo_ranks_agree_sum_and_average():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_collectives_worker, tmp, 2)


def test_an_nccl_group_gets_tensors_on_the_current_cuda_device(monkeypatch):
    """NCCL rejects CPU tensors: the device follows the group's backend (checked without a GPU)."""
    monkeypatch.setattr(collectives, "is_distributed", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.group_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collectives.group_device() == torch.device("cpu")
