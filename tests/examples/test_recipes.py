"""The papers' recipes (`megatron_rl/recipes.py`) through the launchers: every arm of every recipe
gives a torchrun command (DRY_RUN=1) that the trainer's own parser accepts, with the table's
values in the parsed config; the R3 arm's servers return routes; the embedded study runs the same
arms' objective and protocol."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_launchers import ROOT, SCRIPT, SCRIPT_235B, _dry_run, _train_argv, _trainer_config

from megatron_rl.recipes import EPIC_PAPER, RECIPES, VESPO_PAPER, get_recipe, main

EVAL_DATA = "aime24=/shared/aime24.jsonl aime25=/shared/aime25.jsonl amc23=/shared/amc23.jsonl"
ARMS = [(name, arm) for name, recipe in RECIPES.items() for arm in recipe.arms]
TEACHER = "sglang:http://teacher-node:30000"  # a distillation arm's teacher, given by the user

# EPIC Table 2's clipping parameters per arm (loss config field -> value)
EPIC_TABLE_2 = {
    "grpo": {"clip_low": 0.2, "clip_high": 0.2},
    "dapo": {"clip_low": 0.2, "clip_high": 0.28},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4},
    "ctpo": {"clip_low": 0.025, "clip_high": 0.05},
    "ripo": {"delta_low": 0.05, "delta_high": 0.05},
    "epic": {"delta_low": 5e-4, "delta_high": 2e-3, "variant": "dual"},
    "epic-raw-prob": {"delta_low": 5e-4, "delta_high": 2e-3, "variant": "raw-prob"},
    "epic-cumulative-ratio": {"delta_low": 5e-4, "delta_high": 2e-3, "variant": "cumulative-ratio"},
    "grpo-r2": {"clip_low": 0.2, "clip_high": 0.28},
    "grpo-r3": {"clip_low": 0.2, "clip_high": 0.28},
}


@pytest.mark.parametrize(("recipe", "arm"), ARMS)
def test_every_recipe_arm_passes_the_trainer_checks_through_the_launcher(recipe, arm):
    teacher = {"TRAIN_EXTRA_ARGS": f"--loss-teacher {TEACHER}"} if "opd" in arm else {}
    out = _dry_run(0, RECIPE=recipe, ARM=arm, EVAL_DATA=EVAL_DATA, **teacher)
    config = _trainer_config(_train_argv(out))
    expected = get_recipe(recipe)
    assert config.teacher.loss_teacher == (TEACHER if teacher else None)
    if arm == "opd":
        assert config.teacher.task_weight == 0.0
    assert config.objective.loss == expected.arms[arm][1]
    assert config.rollout.n_samples_per_prompt == 8 and config.rollout.top_p == 1.0
    assert [s.split("=")[0] for s in EVAL_DATA.split()] == [name for name, _ in _eval_sets(config)]
    samples = config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
    assert config.schedule.global_batch_size == expected.minibatch_samples
    assert samples // config.schedule.global_batch_size == expected.staleness
    if recipe in ("epic-paper", "study"):  # the study keeps EPIC's protocol and scale
        loss_config = config.objective.loss_config
        for field, value in EPIC_TABLE_2.get(arm, {}).items():
            assert getattr(loss_config, field) == value, field
        assert config.rollout.dynamic_sampling and config.rollout.over_sampling_ratio == 0.1
        assert config.eval.eval_interval == (5 if recipe == "epic-paper" else 10)
        assert config.eval.eval_top_p == 0.7
        assert config.objective.kl_coef == 1e-3 and config.optimizer.lr_warmup_iters == 10
        assert config.rollout.rollout_batch_size == 64 and config.schedule.train_iters == 300
        replay = {"grpo-r2": "r2", "grpo-r3": "r3", "grpo-r3rec": "r3"}.get(arm, "off")
        assert config.replay.mode == replay
        assert config.replay.record_only == (arm == "grpo-r3rec")
    else:
        assert config.objective.kl_coef == 0.0
        assert config.rollout.rollout_batch_size == 256 and config.schedule.train_iters == 1500


def _eval_sets(config) -> list[tuple[str, str]]:
    """``(name, path)`` of each --eval-prompt-data entry of ``config``."""
    return [tuple(entry.split("=", 1)) for entry in config.eval.eval_prompt_data]


def test_the_r3_arm_starts_servers_that_return_routes():
    env = dict(RECIPE="epic-paper", EVAL_DATA=EVAL_DATA)
    assert "--enable-return-routed-experts" in _dry_run(2, ARM="grpo-r3", **env)
    assert "--enable-return-routed-experts" not in _dry_run(2, ARM="grpo-r2", **env)
    config = _trainer_config(_train_argv(_dry_run(0, ARM="grpo-r3", **env)))
    assert config.engine.sglang_return_routed_experts


def test_vespo_staleness_sets_the_rollout_not_the_minibatch():
    out = _dry_run(0, RECIPE="vespo-paper", ARM="vespo", EVAL_DATA=EVAL_DATA, STALENESS="32")
    config = _trainer_config(_train_argv(out))
    assert config.schedule.global_batch_size == 256
    assert config.rollout.rollout_batch_size == 32 * 256 // 8
    assert config.updates_per_rollout == 32


def test_the_235b_launcher_takes_a_recipe():
    out = _dry_run(0, SCRIPT_235B, RECIPE="epic-paper", ARM="ctpo", EVAL_DATA=EVAL_DATA)
    config = _trainer_config(_train_argv(out))
    assert config.objective.loss == "ctpo" and config.eval.eval_interval == 5


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RECIPE": "epic-paper", "EVAL_DATA": EVAL_DATA}, "set ARM"),
        ({"RECIPE": "epic-paper", "ARM": "ctpo"}, "set EVAL_DATA"),
        ({"RECIPE": "epic-paper", "ARM": "nope", "EVAL_DATA": EVAL_DATA}, "unknown arm"),
    ],
)
def test_a_recipe_without_its_arm_or_data_is_refused(env, message):
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        env={**_launch_env(), **env},
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and message in result.stderr


def _launch_env() -> dict:
    from test_launchers import _base_env

    return _base_env(MASTER_ADDR="node0", ROLLOUT_HOSTS="node2 node3", NODE_RANK="0", DRY_RUN="1")


def test_the_recipe_cli_lists_and_prints_flags(capsys):
    assert main(["--list"]) == 0
    assert "epic-paper" in capsys.readouterr().out
    assert main(["epic-paper", "ctpo"]) == 0
    flags = capsys.readouterr().out.split()
    assert flags[-6:] == ["--loss", "ctpo", "--clip-low", "0.025", "--clip-high", "0.05"]
    result = subprocess.run(
        [sys.executable, "-m", "megatron_rl.recipes", "vespo-paper", "vespo", "--scale"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "--rollout-batch-size\n256" in result.stdout


def test_a_staleness_that_does_not_fill_whole_prompts_is_refused():
    with pytest.raises(ValueError, match="staleness 0"):
        VESPO_PAPER.flags("vespo", scale=True, staleness=0)
    assert EPIC_PAPER.flags("epic", scale=True)[-1] == "64"


@pytest.mark.parametrize("loss", ["epic", "grpo", "dapo", "gspo", "gspo_token", "vespo", "ctpo"])
def test_the_launchers_kl_default_is_the_recipes_policy(loss):
    """The launchers' --kl-coef without KL_COEF is `default_kl_coef` (EPIC's 1e-3 for epic and its
    baselines, 0 otherwise), read from megatron_rl/recipes.py rather than a bash table."""
    from megatron_rl.recipes import default_kl_coef

    assert default_kl_coef(loss) == (
        1e-3 if loss in ("epic", "grpo", "dapo", "gspo", "gspo_token") else 0.0
    )
    config = _trainer_config(_train_argv(_dry_run(0, LOSS=loss)))
    assert config.objective.kl_coef == default_kl_coef(loss)
    script = (ROOT / "examples" / "qwen3_moe" / "common.sh").read_text()
    assert "--kl-default" in script and 'case "${LOSS}"' not in script
