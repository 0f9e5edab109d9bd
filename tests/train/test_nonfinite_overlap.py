"""A non-finite micro-batch on one rank, under overlapped gradient reduction: the step is skipped
on every rank and the run goes on (the reductions the backward launched are completed)."""

from __future__ import annotations

import json
import math
import os

import pytest
from qwen3_moe_testing import spawn_ranks

BAD_CALL = 3  # the third update forward of the bad rank: step 2, its first update
STEPS = 5  # the bad step, then 3 more to the end


def _poisoned_worker(rank, world_size, init_method, tmp_dir, overrides, bad_rank):
    import torch
    from trainer_testing import small_config

    import megatron_rl.train.trainer as trainer_module
    from megatron_rl.train.run import run

    real, calls = trainer_module.policy_logprobs, []

    def poisoned(logits, mb, temperature=1.0):
        out = real(logits, mb, temperature)
        if torch.is_grad_enabled() and rank == bad_rank:  # update passes only
            calls.append(1)
            if len(calls) == BAD_CALL:
                return out * float("nan")
        return out

    trainer_module.policy_logprobs = poisoned
    config = small_config(
        __import__("pathlib").Path(tmp_dir),
        train_iters=STEPS,
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        **overrides,
    )
    run(config, rank=rank, world_size=world_size, init_method=init_method)
    with open(os.path.join(tmp_dir, f"done{rank}.json"), "w") as handle:
        json.dump(len(calls), handle)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("overrides", "bad_rank"),
    [({}, 0), ({"pipeline_model_parallel_size": 2}, 1)],
    ids=["dp2", "pp2-last-stage"],
)
def test_a_bad_micro_batch_on_one_rank_skips_the_step_and_the_run_goes_on(
    tmp_path, overrides, bad_rank
):
    spawn_ranks(_poisoned_worker, tmp_path, 2, overrides, bad_rank)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    skipped = [r.get("update/skipped_nonfinite", 0.0) for r in rows]
    bad = [i for i, s in enumerate(skipped) if s > 0]
    assert len(bad) == 1 and bad[0] < STEPS - 3, skipped  # the poisoned update only
    # every later step ran its updates on both ranks (and every stage) without a skip
    for row in rows[bad[0] + 1 :]:
        assert "grad_norm" in row and math.isfinite(row["grad_norm"]), row["step"]
