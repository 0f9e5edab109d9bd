"""Over-sampling with dynamic-sampling refill keeps every batch full of groups with signal.

The refill's logic is tested with a scripted generator (which prompts carry a signal is chosen by
the test, so a shortfall can be forced); the trainer runs it for real on the tiny model with a
reward under which half of the prompts' groups have zero variance, on one rank and on two gloo
ranks.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from qwen3_moe_testing import spawn_ranks
from trainer_testing import rendezvous, small_config

from megatron_rl.data import PromptSampler
from megatron_rl.train.batch import TrainSample
from megatron_rl.train.rollouts.dynamic_sampling import (
    DynamicSampling,
    first_draw,
    merge_rollout_metrics,
    refill_draw,
)
from megatron_rl.train.rollouts.source import RolloutBatch
from megatron_rl.train.run import run
from megatron_rl.train.trainer import Trainer

N = 4  # samples per prompt


def _group(prompt: int, signal: bool, truncated: bool = False) -> list[TrainSample]:
    advantages = [1.0, -1.0, 1.0, -1.0] if signal else [0.0] * N
    return [
        TrainSample(
            prompt_ids=torch.tensor([prompt]),
            response_ids=torch.tensor([1, 2]),
            rollout_logprobs=torch.zeros(2),
            advantage=a,
            reward=float(a > 0),
            in_loss=True,
            truncated=truncated,
        )
        for a in advantages
    ]


class ScriptedRollouts:
    """Draws from a real `PromptSampler`; a prompt's group has signal when ``signal(prompt)``."""

    def __init__(self, num_prompts, signal, dp=1, dp_rank=0, overlong=lambda p: False):
        self.sampler = PromptSampler(num_prompts, seed=3)
        self.signal, self.overlong, self.dp, self.dp_rank = signal, overlong, dp, dp_rank
        self.generated: list[int] = []

    def draw(self, count: int) -> list[int]:
        indices = self.sampler.next_batch(count)
        per_rank = count // self.dp
        return indices[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def generate(self, prompts: list[int], round_index: int):
        self.generated += prompts
        samples = [s for p in prompts for s in _group(p, self.signal(p), self.overlong(p))]
        return samples, {"accuracy": float(round_index), "response_length/max": 2.0 + round_index}

    def refill(self, batch_groups, ratio=0.1, max_rounds=3, drop_overlong=False, dp_group=None):
        sampling = DynamicSampling(
            batch_groups=batch_groups,
            group_size=N,
            ratio=ratio,
            max_rounds=max_rounds,
            drop_overlong=drop_overlong,
            dp=self.dp,
            dp_rank=self.dp_rank,
            dp_group=dp_group,
            draw=self.draw,
            generate=self.generate,
        )
        before = self.sampler.state_dict()
        prompts = self.draw(sampling.first_draw)
        samples, metrics = self.generate(prompts, 0)
        batch = RolloutBatch(
            samples=samples, metrics=metrics, prompts=prompts, sampler_before=before
        )
        return sampling.fill(batch)


def _groups(batch: RolloutBatch) -> list[list[TrainSample]]:
    return [batch.samples[i : i + N] for i in range(0, len(batch.samples), N)]


def test_first_and_refill_draw_sizes():
    assert first_draw(64, 0.1, 1) == 71  # ceil(70.4)
    assert first_draw(64, 0.1, 4) == 72  # a multiple of the data-parallel size
    assert first_draw(16, 0.0, 1) == 16
    assert refill_draw(8, 0.0, keep_rate=0.5, dp=1) == 16
    assert refill_draw(8, 0.1, keep_rate=0.0, dp=1) == 71  # at most 8 (1 + ratio) x the deficit
    assert refill_draw(1, 0.1, keep_rate=1.0, dp=4) == 4


def test_half_zero_variance_groups_are_refilled_to_a_full_batch():
    rollouts = ScriptedRollouts(100, signal=lambda p: p % 2 == 1)
    batch = rollouts.refill(batch_groups=16)
    groups = _groups(batch)
    assert len(groups) == 16
    assert all(any(s.advantage != 0 and s.in_loss for s in g) for g in groups)
    assert batch.prompts == [int(g[0].prompt_ids[0]) for g in groups]
    assert all(p % 2 == 1 for p in batch.prompts)
    # the batch is the first 16 kept groups in draw order
    kept_in_order = [p for p in rollouts.generated if p % 2 == 1][:16]
    assert batch.prompts == kept_in_order
    m = batch.metrics
    assert m["dynamic_sampling/short_groups"] == 0
    assert m["dynamic_sampling/groups_kept"] >= 16
    assert m["dynamic_sampling/groups_drawn"] == len(rollouts.generated)
    assert m["dynamic_sampling/rounds"] >= 2  # 18 drawn first, about 9 kept: a refill was needed
    assert m["dynamic_sampling/groups_dropped_zero_variance"] == sum(
        p % 2 == 0 for p in rollouts.generated
    )
    assert len(set(rollouts.generated)) == len(rollouts.generated)  # no prompt drawn twice


def test_a_prompt_is_never_drawn_twice_within_an_epoch():
    rollouts = ScriptedRollouts(40, signal=lambda p: p % 3 == 0)
    seen = []
    for _ in range(3):
        rollouts.refill(batch_groups=4)
        seen = rollouts.generated
    epoch = seen[: rollouts.sampler.num_records]
    assert len(set(epoch)) == len(epoch)


def test_spent_rounds_complete_the_batch_with_masked_groups():
    rollouts = ScriptedRollouts(100, signal=lambda p: p < 3)  # at most 3 groups with signal
    batch = rollouts.refill(batch_groups=8, max_rounds=1)
    groups = _groups(batch)
    assert len(groups) == 8  # the batch keeps its shape
    with_signal = [g for g in groups if g[0].in_loss]
    kept = batch.metrics["dynamic_sampling/groups_kept"]
    assert len(with_signal) == kept <= 3
    assert batch.metrics["dynamic_sampling/short_groups"] == 8 - kept
    assert batch.metrics["dynamic_sampling/rounds"] == 2  # the first and one extra
    assert all(not s.in_loss for g in groups if g not in with_signal for s in g)


def test_overlong_groups_are_dropped_when_asked():
    rollouts = ScriptedRollouts(100, signal=lambda p: True, overlong=lambda p: p % 2 == 0)
    batch = rollouts.refill(batch_groups=8, drop_overlong=True, max_rounds=5)
    assert all(p % 2 == 1 for p in batch.prompts) and len(batch.prompts) == 8
    assert batch.metrics["dynamic_sampling/groups_dropped_overlong"] > 0
    assert batch.metrics["dynamic_sampling/groups_dropped_zero_variance"] == 0


def test_round_metrics_merge_by_sample_count():
    merged = merge_rollout_metrics(
        [
            ({"accuracy": 0.0, "response_length/max": 3.0, "rollout/aborted": 1.0}, 8),
            ({"accuracy": 1.0, "response_length/max": 2.0, "rollout/aborted": 2.0}, 24),
        ]
    )
    assert merged == {"accuracy": 0.75, "response_length/max": 3.0, "rollout/aborted": 3.0}


def _dp_worker(rank, world_size, init_method, tmp_dir) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    rollouts = ScriptedRollouts(100, signal=lambda p: p % 2 == 1, dp=world_size, dp_rank=rank)
    batch = rollouts.refill(batch_groups=8, dp_group=dist.group.WORLD)
    result = {"prompts": batch.prompts, "generated": rollouts.generated, "metrics": batch.metrics}
    with open(f"{tmp_dir}/rank{rank}.json", "w") as handle:
        json.dump(result, handle)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_data_parallel_ranks_end_with_equal_shares_of_the_same_batch(tmp_path):
    """Each rank trains on half of the batch one rank would select from the same draws."""
    spawn_ranks(_dp_worker, tmp_path, 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [len(r["prompts"]) for r in ranks] == [4, 4]
    assert ranks[0]["metrics"] == ranks[1]["metrics"]  # global metrics, the same on each rank
    single = ScriptedRollouts(100, signal=lambda p: p % 2 == 1).refill(batch_groups=8)
    assert ranks[0]["prompts"] + ranks[1]["prompts"] == single.prompts
    generated = ranks[0]["generated"] + ranks[1]["generated"]
    assert len(set(generated)) == len(generated)


def _half_constant_reward(tmp_path, monkeypatch) -> str:
    """Prompts whose answer is 1-5 always score 1 (zero variance); the others are scored."""
    (tmp_path / "half_constant_reward.py").write_text(
        "from megatron_rl.rewards import score_builtin_response\n"
        "def reward(response, answer):\n"
        "    if answer in '12345':\n"
        "        return 1.0\n"
        "    return score_builtin_response(response, answer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "half_constant_reward:reward"


@pytest.mark.slow
def test_the_trainer_trains_on_full_batches_when_half_the_groups_have_zero_variance(
    tmp_path, monkeypatch
):
    reward = _half_constant_reward(tmp_path, monkeypatch)
    config = small_config(
        tmp_path,
        reward=reward,
        train_iters=3,
        dynamic_sampling=True,
        over_sampling_ratio=0.1,
        dynamic_sampling_max_rounds=6,
        n_samples_per_prompt=8,
        global_batch_size=16,
    )
    trainer = Trainer(config, **rendezvous(tmp_path))
    trained = []
    original = trainer.train_on
    trainer.train_on = lambda samples, stop=None: trained.append(samples) or original(samples, stop)
    try:
        rows = [trainer.step() for _ in range(3)]
    finally:
        trainer.close()
    for samples, row in zip(trained, rows, strict=True):
        groups = [samples[i : i + 8] for i in range(0, len(samples), 8)]
        assert len(groups) == 4
        assert all(any(s.in_loss and s.advantage != 0 for s in g) for g in groups)
        assert row["dynamic_sampling/short_groups"] == 0
        assert row["dynamic_sampling/groups_drawn"] >= math.ceil(1.1 * 4)
    assert sum(r["dynamic_sampling/groups_dropped_zero_variance"] for r in rows) > 0


@pytest.mark.slow
def test_dynamic_sampling_resumes_with_the_same_prompts(tmp_path, monkeypatch):
    """The sampler position after the refill rounds is what a checkpoint records."""
    reward = _half_constant_reward(tmp_path, monkeypatch)
    flags = dict(reward=reward, dynamic_sampling=True, over_sampling_ratio=0.1)
    straight = small_config(tmp_path / "a", train_iters=3, **flags)
    run(straight, **rendezvous(tmp_path, "rdzv_a"))
    first = small_config(tmp_path / "b", train_iters=2, save=str(tmp_path / "ckpt"), **flags)
    run(first, **rendezvous(tmp_path, "rdzv_b"))
    resumed = first.with_flags(train_iters=3, load=str(tmp_path / "ckpt"))
    run(resumed, **rendezvous(tmp_path, "rdzv_c"))

    def rows(folder):
        lines = (folder / "run" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3]
    for key in ("dynamic_sampling/groups_drawn", "reward/mean", "accuracy"):
        assert a[2][key] == b[2][key], key


@pytest.mark.slow
@pytest.mark.distributed
def test_the_cli_under_torchrun_refills_on_two_data_parallel_ranks_with_async_rollouts(
    tmp_path, monkeypatch
):
    """The real entry point, 2 gloo ranks: both ranks train full batches of groups with signal
    (round 0 generated ahead, the refill rounds in the foreground)."""
    import os
    import subprocess
    from pathlib import Path

    from ports import torchrun

    reward = _half_constant_reward(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    command = [
        *torchrun(2), "-m", "megatron_rl.train", "--run-dir", str(run_dir),
        "--device", "cpu", "--no-progress", "--train-iters", "3", "--torch-threads", "1",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--micro-batch-size", "4", "--max-response-length", "3", "--reward", reward,
        "--dynamic-sampling", "--over-sampling-ratio", "0.1", "--async-rollout",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert len(rows) == 3
    for row in rows:
        assert row["dynamic_sampling/short_groups"] == 0
        assert row["dynamic_sampling/groups_kept"] >= 4
        assert row["policy/num_seqs"] > 0
