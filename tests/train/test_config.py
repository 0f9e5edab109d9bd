"""Bad configurations fail before any model is built, naming the flags and the fix."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from megatron_rl.train.__main__ import main
from megatron_rl.train.config import TrainConfig, build_parser, parse_args

FLAGS_BEFORE_THE_NESTED_CONFIG = """
--adam-beta1 --adam-beta2 --adam-eps --advantage-estimator --async-rollout --async-save
--balance-data --behavior-logprobs --bf16 --c1-neg --c1-pos --c2-neg --c2-pos --ckpt-format
--clip-grad --clip-high --clip-low --clip-ratio-c --context-parallel-size
--decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers --delta-high
--delta-low --device --expert-model-parallel-size --filter-zero-variance-groups
--global-batch-size --help --kl-coef --kl-estimator --load --load-fallback --loss
--loss-agg-mode --lr --max-bad-steps --max-prompt-length --max-response-length --max-staleness
--max-tokens-per-gpu --micro-batch-size --model --n-samples-per-prompt --no-progress
--no-reference-offload --optimizer-cpu-offload --optimizer-offload-fraction
--overlap-grad-reduce --pipeline-model-parallel-size --prompt-data --prompt-too-long
--recompute-granularity --reward --rollout-batch-size --rollout-correction --rollout-dtype
--rollout-engine --routing-dtype --routing-record-only --routing-replay --run-dir --save
--save-interval --seed --sequence-parallel --sglang-engine-ranks --sglang-min-servers
--sglang-request-timeout --sglang-return-routed-experts --sglang-router-url
--sglang-startup-timeout --sglang-url --tau-neg --tau-pos --temperature
--tensor-model-parallel-size --tokenizer --top-k --top-p --torch-threads --train-iters
--transformer-impl --use-distributed-optimizer --variant --wandb-exp-name --wandb-mode
--wandb-project --weight-decay --weight-sync-min-gbps --weight-sync-transport -h
"""


def test_megatron_flag_names_and_rl_flags_parse_into_one_config():
    config = parse_args(
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "16",
            "--lr",
            "1e-5",
            "--loss",
            "epic",
            "--delta-high",
            "3e-3",
            "--routing-replay",
            "r2",
            "--routing-dtype",
            "packed",
            "--rollout-batch-size",
            "8",
            "--n-samples-per-prompt",
            "8",
            "--kl-coef",
            "0.001",
        ]
    )
    assert config.parallel.tensor_parallel == 2 and config.parallel.sequence_parallel
    assert config.objective.loss_params == (("delta_high", 3e-3),)
    assert config.updates_per_rollout == 4  # 64 samples / global batch 16


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--loss", "grpo", "--c1-pos", "2"], "--c1-pos is not a hyperparameter of --loss grpo"),
        (["--loss", "vespo", "--c1-pos", "-1"], "c1_pos must be a finite number > 0"),
        (["--global-batch-size", "48"], "not a multiple of --micro-batch-size 32"),
        (["--rollout-batch-size", "5"], "40 samples, not a multiple of --global-batch-size 64"),
        (["--routing-record-only"], "--routing-record-only needs --routing-replay r2 or r3"),
        (["--rollout-engine", "sglang"], "needs at least one --sglang-url"),
        (
            ["--routing-replay", "r3", "--rollout-engine", "sglang", "--sglang-url", "http://h:1"],
            "--enable-return-routed-experts",
        ),
        (["--context-parallel-size", "2"], "--context-parallel-size > 1 is not supported"),
        (["--decoder-first-pipeline-num-layers", "2"], "needs --pipeline-model-parallel-size > 1"),
        (["--async-save"], "--async-save needs --ckpt-format torch_dist"),
        (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
        (["--lr", "0"], "--lr=0.0: must be a finite number > 0"),
    ],
)
def test_bad_combinations_name_the_flags(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_args(argv)


def test_world_size_and_batch_divisibility_are_checked_before_building():
    config = TrainConfig.from_flags(
        tensor_model_parallel_size=2, global_batch_size=64, micro_batch_size=32
    )
    with pytest.raises(ValueError, match="world size 3 is not divisible"):
        config.data_parallel_size(3)
    with pytest.raises(ValueError, match="micro-batch-size x data-parallel size = 32 x 4"):
        config.data_parallel_size(8)


def test_cli_reports_bad_flags_with_exit_code_2(capsys):
    assert main(["--loss", "grpo", "--tau-pos", "1.0"]) == 2
    assert "--tau-pos is not a hyperparameter of --loss grpo" in capsys.readouterr().err


def test_string_loss_hyperparameters_parse_and_bad_values_are_named():
    config = parse_args(["--loss", "epic", "--variant", "plain", "--delta-high", "1e-3"])
    assert dict(config.objective.loss_params) == {"variant": "plain", "delta_high": 1e-3}
    assert config.objective.loss_config.variant == "plain"
    with pytest.raises(ValueError, match="variant='wide'"):
        parse_args(["--loss", "epic", "--variant", "wide"])
    with pytest.raises(ValueError, match="--variant is not a hyperparameter of --loss grpo"):
        parse_args(["--loss", "grpo", "--variant", "plain"])


def test_sections_carry_the_flags_and_derived_values_have_one_owner():
    argv = "--tensor-model-parallel-size 2 --sequence-parallel --routing-replay r2 --lr 1e-4"
    argv += " --rollout-batch-size 8 --kl-coef 0.01 --bf16 --run-dir out --temperature 0.7"
    argv += " --routing-dtype uint8 --seed 7 --max-response-length 6 --train-iters 9"
    config = parse_args(argv.split())
    assert config.parallel.tensor_parallel == 2 and config.parallel.sequence_parallel is True
    assert config.replay.mode == "r2" and config.model.routing_replay is True
    assert config.optimizer.lr == 1e-4
    assert config.optimizer.use_distributed_optimizer is False  # the CLI's default
    assert parse_args(["--use-distributed-optimizer"]).optimizer.use_distributed_optimizer
    assert config.objective.kl_coef == 0.01
    assert config.rollout.temperature == 0.7
    assert config.model.dtype == "bfloat16"
    # derived: each value has one flag and one owner; its copies follow it
    assert config.task.tensor_parallel == 2 and config.task.seed == 7
    assert config.engine.routing_dtype == "uint8"
    assert config.engine.weight_sync_dir == os.path.join("out", "weight_sync")
    assert config.task.max_response_length == config.objective.max_response_length == 6
    assert config.logging.run_dir == "out" and config.logging.total_steps == 9
    changed = config.with_flags(seed=3, run_dir="elsewhere")
    assert changed.task.seed == 3 and changed.engine.weight_sync_dir.startswith("elsewhere")


def test_every_flag_name_of_the_flat_parser_still_parses():
    """The flags before the nested config (commit 73d31ba's parser), each still accepted."""
    option_strings = {o for action in build_parser()._actions for o in action.option_strings}
    assert set(FLAGS_BEFORE_THE_NESTED_CONFIG.split()) <= option_strings


def test_from_flags_takes_the_flags_values_and_refuses_unknown_names():
    config = TrainConfig.from_flags(bf16=True, no_progress=True, transformer_impl="local")
    assert config.model.dtype == "bfloat16" and config.model.spec == "local"
    assert config.logging.show_progress is False
    assert TrainConfig.from_flags(delta_high=1e-3, loss="epic").objective.loss_params == (
        ("delta_high", 1e-3),
    )
    with pytest.raises(TypeError, match="no flag --not-a-flag"):
        TrainConfig.from_flags(not_a_flag=1)
    assert TrainConfig.from_flags() == parse_args([])


@pytest.mark.slow
def test_help_answers_without_importing_megatron_or_transformers():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from megatron_rl.train.__main__ import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('megatron.core', 'transformers') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert "--routing-replay" in out.stdout
    assert "HEAVY []" in out.stdout
    assert "Warning" not in out.stderr


def test_transformer_impl_chooses_the_layer_spec():
    assert parse_args([]).model.spec == "auto"
    assert parse_args(["--transformer-impl", "local"]).model.spec == "local"
    assert parse_args(["--transformer-impl", "transformer_engine"]).model.spec == "te"
    assert parse_args(["--recompute-granularity", "full"]).model.recompute is True
    for argv in (["--transformer-impl", "te"], ["--recompute-granularity", "selective"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


def test_a_load_path_without_a_checkpoint_is_an_error_unless_it_is_the_save_folder(tmp_path):
    from megatron_rl.train.run import resolve_load

    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"--load .*nope does not exist"):
        resolve_load(parse_args(["--load", missing]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        resolve_load(parse_args(["--load", str(tmp_path / "empty")]))
    assert resolve_load(parse_args(["--load", missing, "--save", missing])) is None  # fresh
    assert main(["--load", missing]) == 2


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--temperature", "-1"], "--temperature=-1.0"),
        (["--temperature", "0"], "nothing is learned"),
        (["--top-p", "0"], "--top-p=0.0"),
        (["--top-p", "2"], "--top-p=2.0"),
        (["--top-k", "0"], "--top-k=0"),
        (["--lr", "inf"], "--lr=inf"),
        (["--kl-coef", "nan"], "--kl-coef=nan"),
        (["--kl-coef", "inf"], "--kl-coef=inf"),
        (["--save-interval", "5"], "without --save"),
    ],
)
def test_sampling_and_optimiser_values_are_checked_at_parse_time(argv, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_args(argv)


def test_a_router_carries_generation_and_the_workers_control():
    argv = "--rollout-engine sglang --sglang-url http://w0:30000"
    config = parse_args([*argv.split(), "--sglang-router-url", "http://router:29000"])
    assert config.engine.sglang_router_url == "http://router:29000"


def _documented_commands() -> list[tuple[str, list[str]]]:
    """Every ``python|torchrun ... -m megatron_rl.train ...`` line in a code block of README.md
    and docs/*.md (continuation lines joined, comments dropped): (where, its flags)."""
    root = Path(__file__).resolve().parents[2]
    found = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        inside, pending = False, ""
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```"):
                inside, pending = not inside, ""
                continue
            if not inside:
                continue
            line = pending + line
            if line.rstrip().endswith("\\"):
                pending = line.rstrip()[:-1] + " "
                continue
            pending = ""
            if not line.lstrip().startswith(("python ", "torchrun ")):
                continue
            words = shlex.split(line, comments=True)
            if "megatron_rl.train" in words:
                flags = words[words.index("megatron_rl.train") + 1 :]
                found.append((f"{path.name}:{number}", flags))
    return found


def test_every_command_line_in_the_readme_and_docs_parses():
    commands = _documented_commands()
    assert len(commands) >= 5  # the README's examples at least
    for where, flags in commands:
        try:
            parse_args(flags)
        except (SystemExit, ValueError) as err:
            pytest.fail(f"{where}: {' '.join(flags)} does not parse: {err!r}")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--n-samples-per-prompt", "1"], "--n-samples-per-prompt=1: --advantage-estimator grpo"),
        (
            ["--n-samples-per-prompt", "1", "--advantage-estimator", "drgrpo"],
            "pass --n-samples-per-prompt 2 or more",
        ),
        (["--clip-grad", "-1"], "--clip-grad=-1.0: must be a finite number >= 0"),
        (["--clip-grad", "nan"], "--clip-grad=nan"),
        (["--adam-beta1", "1"], "--adam-beta1=1.0: must be in [0, 1)"),
        (["--adam-beta2", "-0.1"], "--adam-beta2=-0.1: must be in [0, 1)"),
        (["--adam-eps", "0"], "--adam-eps=0.0: must be a finite number > 0"),
        (["--weight-decay", "-0.01"], "--weight-decay=-0.01: must be a finite number >= 0"),
        (["--weight-decay", "inf"], "--weight-decay=inf"),
        (["--max-no-signal-steps", "-1"], "--max-no-signal-steps=-1: must be an integer >= 0"),
        (["--max-reward-failure-fraction", "1.5"], "--max-reward-failure-fraction=1.5"),
        (["--max-reward-failure-fraction", "nan"], "--max-reward-failure-fraction=nan"),
        (["--answer-key", "label"], "--prompt-key / --answer-key name fields of --prompt-data"),
        (["--prompt-data", "d.jsonl", "--answer-key", "a..b"], "--answer-key='a..b'"),
    ],
)
def test_every_value_is_checked_at_parse_time_naming_its_flag(argv, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_args(argv)


def test_clip_grad_zero_turns_clipping_off_and_the_learning_guard_can_be_turned_off():
    config = parse_args(["--clip-grad", "0", "--max-no-signal-steps", "0"])
    assert config.optimizer.clip_grad == 0.0 and config.schedule.max_no_signal_steps == 0


@pytest.mark.parametrize(
    "world, argv, match",
    [
        ("3", ["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size x "),
        ("4", ["--expert-model-parallel-size", "8"], "--expert-model-parallel-size x "),
        (
            "3",
            [
                *("--rollout-batch-size", "16", "--n-samples-per-prompt", "3"),
                *("--global-batch-size", "48", "--micro-batch-size", "16"),
            ],
            "--rollout-batch-size 16 prompts do not split over 3",
        ),
        ("3", [], "(WORLD_SIZE=3, set by torchrun)"),
    ],
)
def test_parallel_sizes_are_checked_against_torchruns_world_size_at_parse_time(
    monkeypatch, world, argv, match
):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_args(argv)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert parse_args(["--global-batch-size", "64", "--micro-batch-size", "32"]) is not None


def test_the_cli_refuses_a_bad_world_layout_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert main(["--tensor-model-parallel-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "world size 6 is not divisible by --tensor-model-parallel-size" in err
