"""--carry-over-groups with --async-rollout --max-staleness 2 on two data-parallel ranks (gloo,
spawned, through `run`): each rank trains every group it drew once (one group per rank is still
carried at the end), the ranks' prompts are disjoint shares of the sampler's draws, no sample's
newest token is more than K + ceil(M / B) versions behind (K: generated ahead; a finished group
may wait that many rollouts in the pool), and a run killed mid-way and resumed from its
checkpoint trains the same groups as the uninterrupted run from the checkpoint on.
"""

from __future__ import annotations

import collections
import json

import pytest
from qwen3_moe_testing import spawn_ranks

WORLD = 2
STEPS, SAVE_INTERVAL, KILL_AFTER = 6, 2, 3
OVERRIDES = dict(
    async_rollout=True,
    max_staleness=2,
    carry_over_groups=2,  # one per rank
    carry_over_round_tokens=1,
    behavior_logprobs="rollout",
    rollout_batch_size=4,  # 2 prompts per rank
    n_samples_per_prompt=2,
    global_batch_size=8,
    micro_batch_size=2,
    max_response_length=4,
)


def _worker(rank, world_size, init_method, tmp_dir) -> None:
    from pathlib import Path

    from trainer_testing import StepRecorder, killed_after, small_config

    from megatron_rl.backend import destroy_distributed
    from megatron_rl.train.run import run

    tmp = Path(tmp_dir)
    dist_kwargs = lambda name: dict(  # noqa: E731
        rank=rank, world_size=world_size, init_method=f"file://{tmp / name}"
    )
    result: dict = {}
    recorder = StepRecorder()
    steps = recorder.steps
    straight = small_config(tmp / "p1", train_iters=STEPS, **OVERRIDES)
    run(straight, **dist_kwargs("rdzv_p1"))
    destroy_distributed()
    result["straight"] = steps

    recorder.close()
    steps = StepRecorder().steps
    ckpt = tmp / "p2" / "ckpt"
    first = small_config(
        tmp / "p2", train_iters=STEPS, save=str(ckpt), save_interval=SAVE_INTERVAL, **OVERRIDES
    )
    try:
        with killed_after(KILL_AFTER):
            run(first, **dist_kwargs("rdzv_p2a"))
    finally:
        destroy_distributed()
    result["latest"] = int((ckpt / "latest").read_text())
    run(first.with_flags(load=first.checkpoint.save), **dist_kwargs("rdzv_p2b"))
    destroy_distributed()
    result["resumed"] = steps
    with open(tmp / f"result_rank{rank}.json", "w") as f:
        json.dump(result, f)


def _drawn_shares(rank: int, tmp_path) -> list[int]:
    """Rank ``rank``'s shares of the sampler's draws of rollouts 0..STEPS-1: the pool's first
    draw of B + M prompts, then B a rollout."""
    from trainer_testing import small_config

    from megatron_rl.train.task import build_task

    sampler = build_task(small_config(tmp_path, **OVERRIDES).task).new_sampler()
    batch, carry = OVERRIDES["rollout_batch_size"], OVERRIDES["carry_over_groups"]
    out = []
    for count in [batch + carry] + [batch] * (STEPS - 1):
        drawn, per_rank = sampler.next_batch(count), count // WORLD
        out.extend(drawn[rank * per_rank : (rank + 1) * per_rank])
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_carry_groups_over_once_each_within_k_and_resume_the_same_groups(tmp_path):
    spawn_ranks(_worker, tmp_path, WORLD)
    results = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in range(WORLD)]
    n, k = OVERRIDES["n_samples_per_prompt"], OVERRIDES["max_staleness"]
    # a group finished but carried waits ceil(M / B) rollouts more (M = 1, B = 2 per rank)
    wait = 1
    for rank, result in enumerate(results):
        steps = result["straight"]
        assert len(steps) == STEPS and all(len(s["prompts"]) == 2 for s in steps)
        for step in steps:  # each sample belongs to a prompt its step claims, n per prompt
            assert sorted(step["sample_prompts"]) == sorted(p for p in step["prompts"] * n)
            behind = [step["trainer_version"] - v for v in step["newest"]]
            assert max(behind) <= k + wait, behind
        trained = collections.Counter(p for s in steps for p in s["prompts"])
        drawn = collections.Counter(_drawn_shares(rank, tmp_path))
        assert not trained - drawn, "a group trained that this rank never drew (or twice)"
        assert sum((drawn - trained).values()) == 1  # the one group per rank still carried
    # resume: killed after step 3, resumed from step 2: steps 3.. train the same groups
    for result in results:
        assert result["latest"] == SAVE_INTERVAL
        resumed = [s["prompts"] for s in result["resumed"]]
        straight = [s["prompts"] for s in result["straight"]]
        assert resumed[:KILL_AFTER] == straight[:KILL_AFTER]
        assert resumed[KILL_AFTER:] == straight[SAVE_INTERVAL:]
