"""``python -m megatron_rl.train --rollout-function module:function`` and ``--task calculator``
through the real CLI (in-process engine, tiny model on CPU).

A user module is written to the test's folder and put on the subprocess's ``PYTHONPATH``, as
``--reward module:function`` users do.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = (
    "--device", "cpu", "--no-progress", "--torch-threads", "1", "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4", "--global-batch-size", "8", "--micro-batch-size", "4",
    "--train-iters", "2", "--seed", "3",
)  # fmt: skip
USER_MODULE = '''
import os
import torch
from megatron_rl.train.rollout_function import RolloutOutput
from megatron_rl.train.rollouts.phase import single_turn_rollout


def same(request):
    """The built-in rollout, called from user code; counts its calls."""
    with open(os.environ["ROLLOUT_CALLS"], "a") as f:
        f.write(f"{len(request.records)} {request.n} {request.params.seed}\\n")
    return single_turn_rollout(request)


def first_token_only(request):
    """Trains each response's first token only and rewards it 1.0 when it is a digit."""
    outputs = []
    for sample in single_turn_rollout(request):
        mask = torch.zeros(sample.response_ids_R.numel(), dtype=torch.bool)
        mask[0] = True
        first = request.tokenizer.decode(sample.response_ids_R[:1].tolist())
        reward = float(first.isdigit())
        outputs.append(RolloutOutput(sample=sample, loss_mask_R=mask, reward=reward))
    return outputs


def broken(request):
    return single_turn_rollout(request)[:-1]
'''


def _run(tmp_path: Path, name: str, *flags: str) -> subprocess.CompletedProcess:
    (tmp_path / "user_rollout.py").write_text(USER_MODULE)
    command = [
        sys.executable, "-m", "megatron_rl.train", "--run-dir", str(tmp_path / name), *SMALL,
        *flags,
    ]  # fmt: skip
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": "1",
        "ROLLOUT_CALLS": str(tmp_path / f"{name}.calls"),
    }
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)


def _rows(tmp_path: Path, name: str, *flags: str) -> list[dict]:
    result = _run(tmp_path, name, *flags)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith("time/") and "per_s" not in k} for r in rows
    ]


@pytest.mark.slow
def test_a_user_module_calling_the_builtin_rollout_trains_the_default_run_exactly(tmp_path):
    """``--rollout-function user_rollout:same`` (the built-in function called from a module on
    PYTHONPATH) gives every logged value of the default run, and is called once per step."""
    default = _rows(tmp_path, "default")
    custom = _rows(tmp_path, "custom", "--rollout-function", "user_rollout:same")
    assert _untimed(custom) == _untimed(default)
    calls = (tmp_path / "custom.calls").read_text().split("\n")[:-1]
    assert len(calls) == 2 and all(c.startswith("4 4 ") for c in calls)


@pytest.mark.slow
def test_a_user_rollout_with_its_own_mask_and_rewards_trains(tmp_path):
    rows = _rows(
        tmp_path, "masked", "--rollout-function", "user_rollout:first_token_only",
        "--max-response-length", "3",
    )  # fmt: skip
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(row["policy/loss"]) and math.isfinite(row["grad_norm"])
        assert 0.0 <= row["reward/mean"] <= 1.0


@pytest.mark.slow
def test_a_rollout_function_returning_too_few_samples_stops_the_run_naming_it(tmp_path):
    result = _run(tmp_path, "broken", "--rollout-function", "user_rollout:broken")
    assert result.returncode != 0
    assert "rollout function user_rollout:broken returned 15 samples for 4 prompts" in (
        result.stderr
    )
    assert (
        not (tmp_path / "broken" / "metrics.jsonl").exists()
        or not (tmp_path / "broken" / "metrics.jsonl").read_text()
    )


@pytest.mark.slow
def test_an_unknown_rollout_function_is_a_start_up_error_naming_the_flag(tmp_path):
    result = _run(tmp_path, "unknown", "--rollout-function", "user_rollout:nothing")
    assert result.returncode != 0
    assert "--rollout-function 'user_rollout:nothing'" in result.stderr
    assert "has no attribute 'nothing'" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["off", "r3"])
def test_the_calculator_task_runs_multi_turn_steps_with_finite_metrics(tmp_path, replay):
    rows = _rows(
        tmp_path, f"calc-{replay}", "--task", "calculator", "--max-response-length", "12",
        "--routing-replay", replay,
    )  # fmt: skip
    assert len(rows) == 2
    for row in rows:
        for key in ("policy/loss", "grad_norm", "entropy", "reward/mean"):
            assert math.isfinite(row[key]), (key, row[key])
        assert row["response_length/mean"] <= 12
    if replay == "r3":  # the spliced routes are those the trainer's own routing picks
        assert rows[0]["routing/agreement/behaviour"] == 1.0
