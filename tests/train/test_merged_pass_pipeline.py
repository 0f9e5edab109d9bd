"""Merged forward-only passes through megatron's pipeline schedule (PP = 2, gloo, CPU).

Each stage holds one MoE layer of the tiny model; the merged behaviour pass runs through
`run_pass`'s pipeline schedule. It must give the last stage every micro-batch's own log-probs
(bitwise with one thread when only equal widths merge, else to 1e-6) with replay off, R2 and R3,
and leave on every stage the R2 recording of each micro-batch bitwise as its own forward records
it, also when narrower micro-batches merge with wider ones.
"""

from __future__ import annotations

import pytest
from qwen3_moe_testing import spawn_ranks


def _worker(rank, world_size, init_method, tmp_dir) -> None:
    from pathlib import Path

    import torch
    from merged_pass_testing import behaviour_logprobs, micro_batches

    from megatron_rl.backend import ParallelConfig, init_distributed
    from megatron_rl.model import ModelOptions, build_model, preset_config
    from megatron_rl.moe_layers import moe_layer_numbers
    from megatron_rl.routing.modes import ReplayConfig
    from megatron_rl.routing.passes import TokenLayout, build_replay_passes

    init_distributed(
        ParallelConfig(pipeline_parallel=2, seed=5),
        rank=rank,
        world_size=world_size,
        init_method=init_method,
        device="cpu",
    )
    config = preset_config("tiny")
    model = build_model(config, ModelOptions(routing_replay=True)).eval()
    mbs = micro_batches(config)
    last = rank == world_size - 1
    checked = []
    for mode, pad_widths in (("off", False), ("r2", False), ("r3", False), ("r2", True)):
        passes = build_replay_passes(
            model,
            ReplayConfig(mode=mode),
            num_experts=config.num_experts,
            topk=config.num_experts_per_tok,
            moe_layer_numbers=moe_layer_numbers(config),
            layout=TokenLayout(),
        )
        want, _ = behaviour_logprobs(model, mbs, passes, None)
        recorded = dict(passes.driver._recorded) if mode == "r2" else {}
        passes.end_step()
        got, forwards = behaviour_logprobs(model, mbs, passes, 10_000, pad_widths=pad_widths)
        assert forwards == (1 if pad_widths else 2), (mode, forwards)  # by width, or all
        for k in range(len(mbs)):
            assert (got[k] is None) == (want[k] is None) == (not last)
            if last:
                real = torch.zeros_like(mbs[k].loss_mask_BT)
                for row, n in enumerate(mbs[k].lengths):
                    real[row, : n - 1] = True
                torch.testing.assert_close(got[k][real], want[k][real], rtol=0, atol=1e-6)
                # bitwise on AVX-512 kernels, not on AVX2 ones (MKL picks by row count)
                torch.testing.assert_close(got[k][real], want[k][real], rtol=0, atol=1e-6)
        if mode == "r2":
            assert recorded and set(passes.driver._recorded) == set(recorded)
            for key, blob in recorded.items():
                assert torch.equal(passes.driver._recorded[key].data, blob.data), key
        passes.close()
        checked.append((mode, pad_widths))
    torch.save(checked, Path(tmp_dir) / f"checked{rank}.pt")


@pytest.mark.slow
@pytest.mark.distributed
def test_merged_behaviour_pass_through_the_pipeline_schedule_equals_one_forward_each(tmp_path):
    import torch

    spawn_ranks(_worker, tmp_path, 2)
    for rank in range(2):
        checked = torch.load(tmp_path / f"checked{rank}.pt")
        assert checked == [("off", False), ("r2", False), ("r3", False), ("r2", True)]
