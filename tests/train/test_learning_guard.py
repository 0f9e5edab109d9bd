"""A run that cannot learn stops early and says why: no learning signal, or a failing reward.

Unit tests of `LearningGuard` and of how failed rewards leave the loss, then tiny CPU runs: a
near-zero temperature stops the CLI with exit status 1, a reward that always raises stops the run
naming it, and one that fails on 1 sample in 8 runs on with the metric reported.
"""

from __future__ import annotations

import json

import pytest
import torch
from forked_ranks import forkserver_context
from trainer_testing import rendezvous, small_config

from megatron_rl.data import BuiltinTaskConfig, builtin_task
from megatron_rl.rollout import InProcessEngine
from megatron_rl.train.__main__ import main
from megatron_rl.train.advantages import group_advantages
from megatron_rl.train.learning_guard import LearningGuard
from megatron_rl.train.rollouts.phase import RolloutConfig, run_rollout, scored_group_advantages
from megatron_rl.train.run import TrainingStopped, run
from megatron_rl.train.task import TaskConfig, load_policy_config


def _guard(max_steps=3, fraction=0.5, prompts_per_step=64) -> LearningGuard:
    return LearningGuard(
        max_steps, fraction, prompts_per_step=prompts_per_step, reward="mod:fn", temperature=1e-6
    )


def _step(signal=0.0, failed=0.0) -> dict:
    return {"rollout/learning_signal_frac": signal, "reward/failed_frac": failed, "reward/mean": 0}


def test_consecutive_no_signal_steps_exhaust_the_guard_and_a_signal_resets_it():
    guard = _guard()
    guard.record(_step(), step=1)
    guard.record(_step(), step=2)
    assert guard.no_signal == 2 and not guard.exhausted
    guard.record(_step(), step=3)
    assert guard.exhausted and not guard.reward_exhausted
    message = guard.stop_message(step=3)
    assert "no learning signal for 3 steps in a row (192 prompts)" in message
    assert "--temperature 1e-06" in message and "--max-no-signal-steps" in message


def test_a_no_signal_streak_must_span_64_prompts_so_toy_runs_are_not_stopped_by_chance():
    guard = _guard(max_steps=2, prompts_per_step=4)  # 16 steps of 4 prompts
    for step in range(1, 16):
        guard.record(_step(), step=step)
    assert not guard.exhausted
    guard.record(_step(), step=16)
    assert guard.exhausted


def test_after_the_first_signal_equal_rewards_do_not_stop_a_run_that_solved_its_prompts():
    guard = _guard(max_steps=1)
    guard.record(_step(signal=0.25), step=1)
    for step in range(2, 6):
        guard.record(_step(signal=0.0), step=step)
    assert not guard.exhausted and guard.signal_seen
    resumed = _guard(max_steps=1)
    resumed.load_state_dict(guard.state_dict())  # the trainer checkpoints it
    resumed.record(_step(signal=0.0), step=6)
    assert not resumed.exhausted


def test_a_distillation_teachers_dense_signal_never_counts_equal_rewards():
    guard = LearningGuard(
        1, 0.5, prompts_per_step=64, reward="mod:fn", temperature=1.0, dense_signal=True
    )
    for step in range(1, 5):
        guard.record(_step(), step=step)
    assert guard.no_signal == 0 and not guard.exhausted
    guard.record(_step(failed=1.0), step=5)  # a failing reward still stops it
    assert guard.reward_exhausted


def test_a_resume_mid_streak_stops_at_the_step_the_uninterrupted_run_would():
    """Both streaks are in the checkpoint: 2 no-signal steps and 2 failing steps before the
    save, 1 after it stops the resumed run, as it stops the run that was never interrupted."""
    for bad in (_step(signal=0.0), _step(signal=0.5, failed=0.9)):
        guard = _guard(max_steps=3)
        guard.record(bad, step=1)
        guard.record(bad, step=2)
        resumed = _guard(max_steps=3)
        resumed.load_state_dict(guard.state_dict())
        resumed.record(bad, step=3)
        guard.record(bad, step=3)
        assert resumed.exhausted and guard.exhausted
    old = _guard(max_steps=3)
    old.load_state_dict({"signal_seen": False})  # a checkpoint from before the streaks: none
    assert old.no_signal == 0 and old.reward_failing == 0


def test_reward_failures_over_the_fraction_count_and_the_message_names_reward_and_error():
    guard = _guard(max_steps=2, fraction=0.5)
    guard.record(_step(signal=0.5, failed=0.5), step=1)  # at the fraction: not counted
    assert guard.reward_failing == 0
    guard.record(_step(signal=0.5, failed=0.75), step=2)
    guard.record(_step(signal=0.5, failed=1.0), step=3)
    assert guard.reward_exhausted and guard.exhausted
    guard.first_error = "sample 0: reward function fn raised KeyError: 'x'"
    message = guard.stop_message(step=3)
    assert "--reward mod:fn failed on 100% of the samples for 2 steps" in message
    assert "raised KeyError" in message


def test_zero_steps_turns_both_checks_off():
    guard = _guard(max_steps=0)
    for step in range(1, 10):
        guard.record(_step(signal=0.0, failed=1.0), step=step)
    assert not guard.exhausted


def test_failed_samples_leave_their_group_statistics():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0])
    scored = torch.tensor([True, True, False, True, True, True, False, False])
    advantages, zero = scored_group_advantages(rewards, scored, 4, "grpo")
    expected, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, "grpo")
    torch.testing.assert_close(advantages[[0, 1, 3]], expected)
    assert advantages[2] == 0 and advantages[4:].abs().sum() == 0
    assert zero.tolist() == [False] * 4 + [True] * 4  # group 2: its two scored rewards are equal
    everything = torch.ones(8, dtype=torch.bool)  # nothing failed: group_advantages itself
    torch.testing.assert_close(
        scored_group_advantages(rewards, everything, 4, "drgrpo")[0],
        group_advantages(rewards, 4, "drgrpo")[0],
    )


def test_a_failed_reward_masks_its_sample_out_of_the_loss_and_is_reported():
    tokenizer, records = builtin_task(BuiltinTaskConfig(seed=0))
    hf_config, _ = load_policy_config(TaskConfig(), tokenizer)
    engine = InProcessEngine.from_hf_config(hf_config, seed=0)
    calls = []

    def every_fourth_fails(response, answer):
        calls.append(response)
        if len(calls) % 4 == 0:
            return float("nan")
        return float(len(calls) % 2)

    config = RolloutConfig(n_samples_per_prompt=4, max_response_length=2)
    result = run_rollout(
        engine, records[:2], tokenizer, every_fourth_fails, config, seed=0, return_routes=False
    )
    assert [s.in_loss for s in result.samples] == [True, True, True, False] * 2
    assert result.samples[3].advantage == 0.0
    assert result.metrics["reward/failed_frac"] == 0.25
    assert result.metrics["reward/mean"] == pytest.approx(2 / 3)  # scored samples 1, 0, 1
    assert result.metrics["rollout/learning_signal_frac"] == 0.75
    assert "sample 3" in result.reward_error and "non-finite" in result.reward_error


def _rows(tmp_path) -> list[dict]:
    with open(tmp_path / "run" / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


def test_a_near_zero_temperature_stops_the_cli_with_exit_status_1(tmp_path, capsys):
    """Every prompt's samples are identical: no group has a signal; the run saves and stops."""
    argv = [
        "--model", "tiny", "--device", "cpu", "--no-progress", "--seed", "7",
        "--train-iters", "20", "--rollout-batch-size", "32", "--n-samples-per-prompt", "2",
        "--global-batch-size", "32", "--micro-batch-size", "16", "--max-response-length", "2",
        "--temperature", "1e-6", "--max-no-signal-steps", "2",
        "--run-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ckpt"),
    ]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "stopped: no learning signal for 2 steps in a row (64 prompts)" in err, err[-2000:]
    assert "--temperature 1e-06 too low" in err
    rows = _rows(tmp_path)
    assert len(rows) == 2 and all(r["rollout/learning_signal_frac"] == 0 for r in rows)
    assert int((tmp_path / "ckpt" / "latest").read_text()) == 2  # saved before stopping


def test_a_reward_that_always_raises_stops_the_run_naming_it(tmp_path, monkeypatch):
    (tmp_path / "always_failing_reward.py").write_text(
        "def reward(response, answer):\n    raise RuntimeError('verifier offline')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = small_config(
        tmp_path, reward="always_failing_reward:reward", train_iters=10, max_no_signal_steps=2
    )
    with pytest.raises(TrainingStopped) as stopped:
        run(config, **rendezvous(tmp_path))
    message = str(stopped.value)
    assert "--reward always_failing_reward:reward failed on 100% of the samples" in message
    assert "raised RuntimeError: verifier offline" in message
    rows = _rows(tmp_path)
    assert len(rows) == 2 and rows[-1]["reward/failed_frac"] == 1.0
    assert rows[-1]["update/skipped_empty"] == 2.0  # nothing left in the loss: no update


def test_a_reward_failing_on_one_sample_in_eight_runs_on_with_the_metric(tmp_path, monkeypatch):
    (tmp_path / "one_in_eight_reward.py").write_text(
        "calls = 0\n\n\n"
        "def reward(response, answer):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls % 8 == 0:\n"
        "        raise ValueError('unparsable')\n"
        "    return float(sum(map(ord, response)) % 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = small_config(
        tmp_path, reward="one_in_eight_reward:reward", train_iters=3, max_no_signal_steps=1
    )
    last = run(config, **rendezvous(tmp_path))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["reward/failed_frac"] == 0.125 for r in rows)  # 2 of 16 samples per step
    assert last["grad_norm"] > 0  # the scored samples still train


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_stop_together_naming_the_error_only_rank_1_saw(tmp_path):
    """Rank 1's reward fails on all its samples (half the step's): both ranks count the same
    steps from the averaged metrics, stop at the same step, and name rank 1's error."""
    (tmp_path / "rank1_reward.py").write_text(
        "import torch.distributed as dist\n\n\n"
        "def reward(response, answer):\n"
        "    if dist.get_rank() == 1:\n"
        "        raise KeyError('only on rank 1')\n"
        "    return float(sum(map(ord, response)) % 2)\n"
    )
    ctx = forkserver_context()  # ranks forked from a pre-imported server (tests/forked_ranks.py)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_stopping_rank, args=(r, str(tmp_path), queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert results[0] == results[1]
    message = results[0]
    assert "failed on 50% of the samples for 2 steps" in message
    assert "stopped at step 2" in message and "raised KeyError: 'only on rank 1'" in message
    assert len(_rows(tmp_path)) == 2


def _stopping_rank(rank, tmp, queue):
    import sys
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, tmp)
    from trainer_testing import small_config

    config = small_config(
        Path(tmp),
        reward="rank1_reward:reward",
        train_iters=6,
        max_no_signal_steps=2,
        max_reward_failure_fraction=0.25,
    )
    try:
        run(config, rank=rank, world_size=2, init_method=f"file://{tmp}/rdzv2")
        queue.put((rank, "not stopped"))
    except TrainingStopped as stopped:
        queue.put((rank, str(stopped)))
