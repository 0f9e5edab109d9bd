"""Data parallelism is exact: two gloo ranks sharing a global batch make the update one rank makes.

One rank generates a rollout (16 samples) and trains on it (N = 2 optimizer steps of 8 samples).
Two ranks then start from the same initial weights and train on the same samples, each holding
half of every mini-batch. Megatron's DDP averages the two ranks' gradients; the losses use the
global token/sequence counts, so parameters, grad norms and loss metrics must match the single
rank's to float tolerance (summation order is the only difference).
"""

from __future__ import annotations

import os

import pytest
import torch
from qwen3_moe_testing import spawn_ranks

OVERRIDES = dict(rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=8)


def _train_worker(rank, world_size, init_method, tmp_dir, samples_path, optimizer) -> None:
    from pathlib import Path

    from trainer_testing import rank_share, small_config

    from megatron_rl.train.trainer import Trainer

    config = small_config(Path(tmp_dir), loss="grpo", micro_batch_size=2, **optimizer, **OVERRIDES)
    trainer = Trainer(config, rank=rank, world_size=world_size, init_method=init_method)
    try:
        if world_size == 1:
            samples, _ = trainer.rollout()
            torch.save(samples, samples_path)
        samples = torch.load(samples_path, weights_only=False)
        before = {
            k: v.clone() for k, v in trainer.model.module.state_dict().items() if torch.is_tensor(v)
        }
        metrics = trainer.train_on(
            rank_share(samples, rank, world_size, config.schedule.global_batch_size)
        )
        after = trainer.model.module.state_dict()
        torch.save(
            {
                "before": before,
                "after": {k: v for k, v in after.items() if torch.is_tensor(v)},
                "metrics": metrics,
            },
            os.path.join(tmp_dir, f"result_ws{world_size}_rank{rank}.pt"),
        )
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "optimizer",
    [
        {},
        {"use_distributed_optimizer": True},
        {"use_distributed_optimizer": True, "overlap_grad_reduce": True},
    ],
    ids=["adam", "distributed_adam", "distributed_adam_overlap"],
)
def test_two_data_parallel_ranks_make_the_single_rank_update(tmp_path, optimizer):
    """With megatron's distributed optimizer each rank updates only its shard of the state;
    with overlap, gradients are reduced once, during the last micro-batch's backward."""
    samples_path = str(tmp_path / "samples.pt")
    for folder in ("dp1", "dp2"):
        (tmp_path / folder).mkdir()
    spawn_ranks(_train_worker, tmp_path / "dp1", 1, samples_path, optimizer)
    spawn_ranks(_train_worker, tmp_path / "dp2", 2, samples_path, optimizer)
    one = torch.load(tmp_path / "dp1" / "result_ws1_rank0.pt", weights_only=False)
    twos = [
        torch.load(tmp_path / "dp2" / f"result_ws2_rank{r}.pt", weights_only=False)
        for r in range(2)
    ]
    assert len(torch.load(samples_path, weights_only=False)) == 16
    for two in twos:
        for name, value in one["before"].items():
            if torch.is_tensor(value):
                assert torch.equal(value, two["before"][name]), name  # same starting point
        moved = 0
        for name, value in one["after"].items():
            if not torch.is_tensor(value) or not value.is_floating_point():
                continue
            torch.testing.assert_close(two["after"][name], value, rtol=1e-5, atol=2e-6)
            moved += int(not torch.equal(value, one["before"][name]))
        assert moved > 0  # the update really changed parameters
        assert two["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)
    assert one["metrics"]["grad_norm"] > 0
