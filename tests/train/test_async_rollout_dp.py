"""--async-rollout with two data-parallel ranks (gloo, spawned): every prompt of the sampler's
sequence is trained exactly once, by exactly one rank, with the samples it was drawn for; the
staleness bound holds on both ranks (an extra weight sync forces a drop-and-regenerate on both);
and a run killed mid-way and resumed from its checkpoint continues the data position.

One spawn of two ranks runs every phase, each phase with its own rendezvous file in the spawn's
own folder (the ranks tear the process group down between phases, as `run` does).
"""

from __future__ import annotations

import json
import os

import pytest
from qwen3_moe_testing import spawn_ranks

WORLD = 2
STEPS = 6  # phase 1: steps of the uninterrupted Trainer
EXTRA_SYNC_BEFORE = 3  # phase 1: an extra weight sync before this step (0-based)
RESUME_ITERS, SAVE_INTERVAL, KILL_AFTER = 5, 2, 3  # phase 2: killed after step 3, ckpt at 2
OVERRIDES = dict(
    async_rollout=True,
    max_staleness=1,
    rollout_batch_size=4,  # 2 prompts per rank
    n_samples_per_prompt=2,
    global_batch_size=8,
    micro_batch_size=2,
    max_response_length=2,
)


def _worker(rank, world_size, init_method, tmp_dir) -> None:
    from pathlib import Path

    from trainer_testing import StepRecorder, killed_after, small_config

    from megatron_rl.backend import destroy_distributed
    from megatron_rl.train.run import run
    from megatron_rl.train.trainer import Trainer

    tmp = Path(tmp_dir)
    dist_kwargs = lambda name: dict(  # noqa: E731
        rank=rank, world_size=world_size, init_method=f"file://{tmp / name}"
    )
    result: dict = {}

    # phase 1: the Trainer directly, one sync per step and an extra one before step 3
    recorder = StepRecorder()
    steps = recorder.steps
    config = small_config(tmp / "p1", train_iters=STEPS, **OVERRIDES)
    trainer = Trainer(config, **dist_kwargs("rdzv_p1"))
    rows = []
    try:
        result["num_records"] = trainer.rollouts.sampler.num_records
        result["sampler_seed"] = trainer.rollouts.sampler.seed
        for k in range(STEPS):
            if k == EXTRA_SYNC_BEFORE:
                trainer.sync_weights(version=trainer.weight_version + 1)
            rows.append(trainer.step())
        result["final_version"] = trainer.weight_version
    finally:
        trainer.close()
        destroy_distributed()
    result["straight"] = {"steps": steps, "rows": rows}

    # phase 2: run() saving every 2 steps, killed after step 3, resumed from step 2's checkpoint
    recorder.close()
    steps = StepRecorder().steps
    ckpt = tmp / "p2" / "ckpt"
    first = small_config(
        tmp / "p2",
        train_iters=RESUME_ITERS,
        save=str(ckpt),
        save_interval=SAVE_INTERVAL,
        **OVERRIDES,
    )
    try:
        with killed_after(KILL_AFTER):
            run(first, **dist_kwargs("rdzv_p2a"))
        result["killed"] = True
    finally:
        destroy_distributed()
    result["latest"] = int((ckpt / "latest").read_text())
    killed_steps = len(steps)
    run(first.with_flags(load=first.checkpoint.save), **dist_kwargs("rdzv_p2b"))
    destroy_distributed()
    result["resumed"] = {"steps": steps, "killed_steps": killed_steps}
    with open(tmp / f"result_rank{rank}.json", "w") as f:
        json.dump(result, f)


def _expected_shares(num_records: int, seed: int, batches: int) -> list[list[list[int]]]:
    """Per step, each rank's share of the sampler's next ``rollout_batch_size`` prompts."""
    from megatron_rl.data.sampler import PromptSampler

    sampler = PromptSampler(num_records, seed=seed)
    batch, per_rank = OVERRIDES["rollout_batch_size"], OVERRIDES["rollout_batch_size"] // WORLD
    out = []
    for _ in range(batches):
        indices = sampler.next_batch(batch)
        out.append([indices[r * per_rank : (r + 1) * per_rank] for r in range(WORLD)])
    return out


def _check_samples_match_prompts(steps: list[dict]) -> None:
    n = OVERRIDES["n_samples_per_prompt"]
    for k, step in enumerate(steps):
        assert sorted(step["sample_prompts"]) == sorted(
            p for p in step["prompts"] for _ in range(n)
        )
        assert None not in step["versions"], k


@pytest.mark.slow
@pytest.mark.distributed
def test_two_data_parallel_ranks_async_every_prompt_once_bounded_staleness_and_resume(tmp_path):
    spawn_ranks(_worker, tmp_path, WORLD)
    results = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in range(WORLD)]
    num_records, seed = results[0]["num_records"], results[0]["sampler_seed"]
    expected = _expected_shares(num_records, seed, STEPS)

    # (a) no prompt lost or duplicated: per step the two ranks' prompts are disjoint halves of
    # the sampler's batch, in order, and each rank trained exactly the samples of its prompts
    for rank, result in enumerate(results):
        steps = result["straight"]["steps"]
        assert len(steps) == STEPS
        assert [s["prompts"] for s in steps] == [e[rank] for e in expected]
        _check_samples_match_prompts(steps)
    trained = [
        p
        for k in range(STEPS)
        for r in range(WORLD)
        for p in results[r]["straight"]["steps"][k]["prompts"]
    ]
    assert len(trained) == STEPS * OVERRIDES["rollout_batch_size"]
    for start in range(0, len(trained) - num_records + 1, num_records):  # every full epoch
        assert sorted(trained[start : start + num_records]) == list(range(num_records))
    if len(trained) <= num_records:
        assert len(set(trained)) == len(trained)

    # (b) staleness: one version behind (0 at the first step; 0 again where the extra sync put
    # the waiting batch 2 behind, which both ranks dropped and regenerated), never above 1
    for result in results:
        steps, rows = result["straight"]["steps"], result["straight"]["rows"]
        assert result["final_version"] == STEPS + 1  # one sync per step plus the extra one
        for k, step in enumerate(steps):
            behind = {step["trainer_version"] - v for v in step["versions"]}
            assert max(behind) <= OVERRIDES["max_staleness"], k
            assert behind == ({0} if k in (0, EXTRA_SYNC_BEFORE) else {1}), k
        dropped = [r["async/dropped_batches"] for r in rows]
        assert dropped == [float(k == EXTRA_SYNC_BEFORE) for k in range(STEPS)]
        assert all(r["async/staleness_mean"] <= OVERRIDES["max_staleness"] for r in rows)
        assert all(r["async/staleness_hist/1"] + r["async/staleness_hist/0"] > 0 for r in rows)
    for a, b in zip(results[0]["straight"]["rows"], results[1]["straight"]["rows"], strict=True):
        for key in ("async/staleness_mean", "async/dropped_batches", "rollout/weight_version"):
            assert a[key] == b[key], key  # averaged over the ranks: every rank logs the same

    # (c) resume: steps 1-3 of the killed run, then steps 3-5 again from the step-2 checkpoint;
    # the resumed run's first batch is generated in the foreground (0 versions behind)
    resume_expected = _expected_shares(num_records, seed, RESUME_ITERS)
    for rank, result in enumerate(results):
        assert result["killed"] and result["latest"] == SAVE_INTERVAL
        steps, killed_steps = result["resumed"]["steps"], result["resumed"]["killed_steps"]
        assert killed_steps == KILL_AFTER
        prompts = [s["prompts"] for s in steps]
        mine = [e[rank] for e in resume_expected]
        assert prompts[:KILL_AFTER] == mine[:KILL_AFTER]
        assert prompts[KILL_AFTER:] == mine[SAVE_INTERVAL:]
        _check_samples_match_prompts(steps)
        first_resumed = steps[KILL_AFTER]
        assert {first_resumed["trainer_version"] - v for v in first_resumed["versions"]} == {0}
        for step in steps:
            assert max(step["trainer_version"] - v for v in step["versions"]) <= 1
    metrics = tmp_path / "p2" / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.open()]
    assert [r["step"] for r in rows] == list(range(1, RESUME_ITERS + 1))
    assert rows[SAVE_INTERVAL]["async/staleness_mean"] == 0.0
    assert os.path.exists(tmp_path / "p2" / "ckpt" / "latest")
