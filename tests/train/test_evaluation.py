"""Evaluation during training: mean@n / pass@k against enumeration, flags, and runs whose
training is bit-identical to a run without evaluation, resumes, ranks and the CLI."""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from trainer_testing import killed_after, rendezvous, small_config

import megatron_rl.train.run as run_module
from megatron_rl.train.__main__ import main
from megatron_rl.train.config import TrainConfig, parse_args
from megatron_rl.train.evaluation import (
    Evaluator,
    PromptScore,
    eval_metrics,
    eval_seed,
    pass_at_k,
    set_metrics,
)
from megatron_rl.train.run import run

ROOT = Path(__file__).resolve().parents[2]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


_TIMING = ("eval/", "time/", "async/overlap_fraction")  # overlap: a ratio of wall-clock times


def _training_part(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(_TIMING)}


def _eval_part(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("eval/")}


# ---------------------------------------------------------------------------------- metric math
def _brute_force(n: int, c: int, k: int) -> tuple[Fraction, Fraction]:
    """(mean accuracy of one sample, chance that k of the n samples hold a correct one), by
    enumerating every k-subset of n samples of which the first c are correct."""
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(i < c for i in subset) for subset in subsets)
    mean = Fraction(sum(i < c for i in range(n)), n)
    return mean, Fraction(hits, len(subsets))


def test_pass_at_k_and_mean_equal_brute_force_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                mean, passed = _brute_force(n, c, k)
                assert pass_at_k(n, c, k) == float(passed), (n, c, k)
                got = set_metrics([PromptScore(0, n, c, 0)], k)[0]
                assert got == pytest.approx(float(mean), rel=1e-15, abs=0), (n, c, k)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 2, 5), (4, 2, 0)):
        with pytest.raises(ValueError, match="need 0 <= c <= n and 1 <= k <= n"):
            pass_at_k(n, c, k)


def test_sets_average_with_equal_weight_and_lengths_per_sample():
    small = [PromptScore(0, 4, 4, 8)]  # one prompt, all correct, 2 tokens per sample
    large = [PromptScore(i, 4, 0, 4) for i in range(9)]  # nine prompts, none correct
    metrics = eval_metrics({"a": small, "b": large}, n=4, k=2)
    assert metrics["eval/a/mean@4"] == 1.0 and metrics["eval/b/mean@4"] == 0.0
    assert metrics["eval/mean@4"] == 0.5  # not 1/10: each set counts once
    assert metrics["eval/a/pass@2"] == 1.0 and metrics["eval/pass@2"] == 0.5
    assert metrics["eval/a/response_length"] == 2.0 and metrics["eval/b/response_length"] == 1.0
    mixed = [PromptScore(0, 4, 1, 0), PromptScore(1, 4, 3, 0)]
    mean, passed, _ = set_metrics(mixed, 2)
    assert mean == 0.5 and passed == pytest.approx((0.5 + 1.0) / 2)  # 1 - C(3,2)/C(4,2) = 1/2


def test_eval_seeds_are_stable_and_differ_by_step_set_and_replica():
    seeds = {
        eval_seed(7, step, name, replica)
        for step in (0, 5)
        for name in ("a", "b")
        for replica in (0, 1)
    }
    assert len(seeds) == 8 and all(0 <= s < 2**31 for s in seeds)
    assert eval_seed(7, 5, "a", 0) == eval_seed(7, 5, "a", 0)
    assert eval_seed(7, 5, "a", 0) != eval_seed(8, 5, "a", 0)


# ---------------------------------------------------------------------------------- flags
def test_flags_default_to_the_training_rollout_and_name_the_sets(tmp_path):
    config = parse_args(
        ["--eval-interval", "5", "--temperature", "0.9", "--top-k", "7",
         "--max-response-length", "6", "--eval-top-p", "0.7",
         "--eval-prompt-data", "data/aime24.jsonl", "--eval-prompt-data", "math=x/m.parquet"]
    )  # fmt: skip
    evaluation = config.eval
    assert evaluation.enabled and evaluation.due(10) and not evaluation.due(7)
    assert (evaluation.temperature, evaluation.top_p, evaluation.top_k) == (0.9, 0.7, 7)
    assert evaluation.max_response_length == 6 and evaluation.pass_k == 8
    assert evaluation.reward == "builtin"
    assert evaluation.sets == (("aime24", "data/aime24.jsonl"), ("math", "x/m.parquet"))
    assert parse_args(["--eval-interval", "2"]).eval.sets == (("builtin", "builtin"),)
    assert not parse_args([]).eval.enabled
    changed = TrainConfig.from_flags(eval_interval=2, eval_pass_k=4, reward="math")
    assert changed.eval.pass_k == 4 and changed.eval.reward == "math"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--eval-interval", "-1"], "--eval-interval=-1: must be an integer >= 0"),
        (["--eval-top-p", "0.7"], "--eval-top-p=0.7: has no effect without evaluation"),
        (["--eval-prompt-data", "a.jsonl"], "--eval-prompt-data=('a.jsonl',): has no effect"),
        (["--eval-interval", "2", "--eval-pass-k", "9"], "--eval-pass-k=9: must be an integer in"),
        (["--eval-interval", "2", "--n-samples-per-eval-prompt", "0"], "must be an integer >= 1"),
        (["--eval-interval", "2", "--eval-temperature", "-1"], "--eval-temperature=-1.0: must"),
        (["--eval-interval", "2", "--eval-top-p", "0"], "--eval-top-p=0.0: must be in (0, 1]"),
        (["--eval-interval", "2", "--eval-top-k", "0"], "--eval-top-k=0: must be -1"),
        (["--eval-interval", "2", "--eval-max-response-length", "0"], "must be an integer >= 1"),
        (
            ["--eval-interval", "2", "--prompt-data", "train.jsonl"],
            "pass --eval-prompt-data NAME=PATH",
        ),
        (
            ["--eval-interval", "2", "--prompt-data", "t.jsonl", "--eval-prompt-data", "builtin"],
            "the built-in held-out set needs the built-in task",
        ),
        (
            [
                "--eval-interval",
                "2",
                "--eval-prompt-data",
                "a/x.jsonl",
                "--eval-prompt-data",
                "b/x",
            ],
            "two sets are named 'x'",
        ),
        (["--eval-interval", "2", "--eval-prompt-data", "a b=x.jsonl"], "set name 'a b'"),
        (["--eval-interval", "2", "--eval-prompt-data", "a="], "names no file"),
    ],
)
def test_bad_evaluation_flags_are_errors_naming_the_flag(argv, message):
    with pytest.raises(ValueError) as caught:
        parse_args(argv)
    assert message in str(caught.value)


def test_cli_reports_a_missing_eval_file_in_one_line_naming_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_module, "run", lambda *a, **k: pytest.fail("run was called"))
    missing = tmp_path / "held.jsonl"
    assert main(["--eval-interval", "2", "--eval-prompt-data", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"error: --eval-prompt-data held={missing}: prompt dataset" in err, err
    assert "Traceback" not in err


def test_the_task_loads_eval_files_like_prompt_data_with_the_eval_response_length(tmp_path):
    from megatron_rl.train.task import build_task

    held = tmp_path / "held.jsonl"
    held.write_text(
        json.dumps({"prompt": "<bos> 3 + 0 =", "answer": "4"}) + "\n"
        + json.dumps({"prompt": "<bos> 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 =", "answer": "1"}) + "\n"
    )  # fmt: skip
    config = parse_args(
        ["--eval-interval", "2", "--eval-prompt-data", f"held={held}",
         "--eval-prompt-data", "builtin", "--max-prompt-length", "10",
         "--prompt-too-long", "drop"]
    )  # fmt: skip
    task = build_task(config.task, config.eval)
    assert list(task.eval_sets) == ["held", "builtin"]
    assert [r.prompt_ids for r in task.eval_sets["held"]] == [(1, 8, 3, 5, 4)]  # 17 tokens: dropped
    assert len(task.eval_sets["builtin"]) == 10
    assert task.records == build_task(config.task).records  # training prompts unchanged
    # the tiny model's context is 512 tokens: 2 are left for a prompt
    too_long = config.with_flags(eval_prompt_data=("builtin",), eval_max_response_length=510)
    with pytest.raises(ValueError, match="--eval-prompt-data builtin=builtin: the built-in"):
        build_task(too_long.task, too_long.eval)


# ---------------------------------------------------------------------------------- math-verify
class _TextTokenizer:
    """Decodes id i to ``texts[i]`` (a stand-in for a HF tokenizer)."""

    eos_token_id = 0

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.vocab_size = len(texts)

    def decode(self, ids):
        return "".join(self.texts[i] for i in ids)


class _ScriptedEngine:
    """Answers sample j of prompt i with token ``script[i][j]``; records the sampling params."""

    def __init__(self, script: list[list[int]]) -> None:
        self.script, self.params, self.aborted = script, [], 2

    def generate(self, prompts, params, *, n, return_routed_experts=False):
        from megatron_rl.rollout.types import RolloutSample

        assert not return_routed_experts
        self.params.append(params)
        return [
            RolloutSample(
                prompt_index=i,
                sample_index=j,
                prompt_ids_P=torch.tensor(p),
                response_ids_R=torch.tensor([self.script[p[0]][j]]),
                logprobs_R=torch.zeros(1),
                finish_reason="stop",
                weight_version=0,
            )
            for i, p in enumerate(prompts)
            for j in range(n)
        ]

    def take_aborted(self) -> int:
        aborted, self.aborted = self.aborted, 0
        return aborted


def test_math_eval_sets_are_scored_with_math_verify(tmp_path):
    from megatron_rl.data import PromptRecord
    from megatron_rl.rewards.math_reward import math_reward
    from megatron_rl.train.task import add_eval_sets, build_task

    pytest.importorskip("math_verify")
    held = tmp_path / "math.jsonl"
    held.write_text(json.dumps({"prompt": "<bos> 1 =", "answer": "\\frac{1}{2}"}) + "\n")
    config = parse_args(["--eval-interval", "1", "--eval-prompt-data", str(held)])
    config = config.with_flags(eval_reward="math")
    task = add_eval_sets(build_task(config.task), config.task, config.eval)
    assert task.eval_reward_fn is math_reward
    texts = ["<eos>", "\\boxed{0.5}", "\\boxed{2}", "the answer is 1/2"]
    records = [PromptRecord(0, (0,), task.eval_sets["math"][0].answer)]
    engine = _ScriptedEngine([[1, 1, 2, 3, 2, 2, 2, 2]])  # 0.5 and 1/2 equal 1/2: 3 of 8
    evaluator = Evaluator(
        config.eval, {"math": records}, task.eval_reward_fn, _TextTokenizer(texts), engine=engine
    )
    metrics = evaluator.evaluate(step=1)
    assert metrics["eval/math/mean@8"] == 3 / 8
    assert metrics["eval/math/pass@8"] == 1.0 and metrics["eval/pass@8"] == 1.0
    assert metrics["eval/aborted"] == 2.0 and engine.aborted == 0  # taken from the engine
    assert engine.params[0].seed == eval_seed(config.eval.seed, 1, "math", 0)


# ---------------------------------------------------------------------------------- runs
@pytest.mark.slow
@pytest.mark.parametrize("schedule", [{}, {"async_rollout": True}], ids=["sync", "async"])
def test_a_run_with_evaluation_trains_bit_identically_and_evaluates_at_its_steps(
    tmp_path, schedule, monkeypatch
):
    plotted = []
    real_plot = run_module.plot_learning_curve
    monkeypatch.setattr(
        run_module, "plot_learning_curve", lambda *a: plotted.append(a[2]) or real_plot(*a)
    )
    plain = small_config(tmp_path / "plain", train_iters=4, **schedule)
    run(plain, **rendezvous(tmp_path, "rdzv_plain"))
    evaluated = plain.with_flags(
        run_dir=str(tmp_path / "eval" / "run"), eval_interval=2, eval_before_train=True
    )
    last = run(evaluated, **rendezvous(tmp_path, "rdzv_eval"))
    without, with_eval = _rows(tmp_path / "plain" / "run"), _rows(tmp_path / "eval" / "run")
    assert [r["step"] for r in with_eval] == [0, 1, 2, 3, 4]
    assert set(with_eval[0]) == {"step", "time/eval"} | set(_eval_part(with_eval[2]))
    assert [_training_part(r) for r in with_eval[1:]] == [_training_part(r) for r in without]
    assert [bool(_eval_part(r)) for r in with_eval] == [True, False, True, False, True]
    keys = {"eval/builtin/mean@8", "eval/builtin/pass@8", "eval/builtin/response_length",
            "eval/mean@8", "eval/pass@8", "eval/aborted"}  # fmt: skip
    assert set(_eval_part(with_eval[4])) == keys and "time/eval" in with_eval[4]
    assert all(r["rollout/aborted"] == 0.0 for r in with_eval[1:])
    assert _eval_part(last) == _eval_part(with_eval[4])
    assert plotted[-1] == ("accuracy", "reward/mean", "eval/mean@8", "eval/pass@8")
    assert (tmp_path / "eval" / "run" / "learning_curve.svg").read_text().count("<polyline") == 4


@pytest.mark.slow
def test_a_resumed_run_evaluates_at_the_same_steps_with_the_same_results(tmp_path, monkeypatch):
    flags = dict(train_iters=4, eval_interval=2, eval_before_train=True, save_interval=2)
    straight = small_config(tmp_path / "a", save=str(tmp_path / "a" / "ckpt"), **flags)
    run(straight, **rendezvous(tmp_path, "rdzv_a"))
    first = small_config(tmp_path / "b", save=str(tmp_path / "b" / "ckpt"), **flags)
    with killed_after(3):  # step 2 saved
        run(first, **rendezvous(tmp_path, "rdzv_b1"))
    run(first.with_flags(load=first.checkpoint.save), **rendezvous(tmp_path, "rdzv_b2"))
    uninterrupted, resumed = _rows(tmp_path / "a" / "run"), _rows(tmp_path / "b" / "run")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]  # no second step-0 evaluation
    assert [_eval_part(r) for r in resumed] == [_eval_part(r) for r in uninterrupted]
    assert _eval_part(resumed[4])  # evaluated after the resume


def test_progress_line_shows_the_evaluation(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megatron_rl.train.run_logger")
    config = small_config(
        tmp_path, train_iters=1, eval_before_train=True, n_samples_per_eval_prompt=4,
        eval_pass_k=2, eval_temperature=0.0,
    )  # fmt: skip
    config = config.with_flags(no_progress=False)
    run(config, **rendezvous(tmp_path))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines[0].startswith("step 0/1  eval/mean@4=") and "eval/pass@2=" in lines[0]
    assert "eval/" not in lines[1]  # --eval-before-train alone: step 0 only
    row = _rows(tmp_path / "run")[0]
    assert row["eval/builtin/mean@4"] == row["eval/builtin/pass@2"]  # greedy: c is 0 or n


def _dp_worker(rank, world_size, init_method, tmp_dir) -> None:
    from trainer_testing import small_config

    config = small_config(
        Path(tmp_dir), train_iters=2, eval_interval=2, eval_before_train=True,
        eval_temperature=0.0, micro_batch_size=2,
    )  # fmt: skip
    metrics = run(config, rank=rank, world_size=world_size, init_method=init_method)
    torch.save(metrics, os.path.join(tmp_dir, f"metrics_rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_data_parallel_ranks_split_the_prompts_and_agree(tmp_path):
    from qwen3_moe_testing import spawn_ranks

    for world_size in (1, 2):
        (tmp_path / f"ws{world_size}").mkdir()
        spawn_ranks(_dp_worker, tmp_path / f"ws{world_size}", world_size)
    one = torch.load(tmp_path / "ws1" / "metrics_rank0.pt", weights_only=False)
    twos = [
        torch.load(tmp_path / "ws2" / f"metrics_rank{r}.pt", weights_only=False) for r in (0, 1)
    ]
    assert _eval_part(twos[0]) == _eval_part(twos[1]) and _eval_part(twos[0])
    step0 = [_rows(tmp_path / f"ws{w}" / "run")[0] for w in (1, 2)]
    assert _eval_part(step0[0]) == _eval_part(step0[1])  # greedy, same initial weights
    assert _eval_part(one).keys() == _eval_part(twos[0]).keys()


@pytest.mark.slow
def test_the_cli_evaluates_every_interval(tmp_path):
    held = tmp_path / "zeros.jsonl"
    held.write_text(
        "".join(json.dumps({"prompt": f"<bos> 0 + {d} =", "answer": str(d + 1)}) + "\n"
                for d in range(9))
    )  # fmt: skip
    command = [
        sys.executable, "-m", "megatron_rl.train", "--device", "cpu", "--train-iters", "2",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--micro-batch-size", "4", "--max-response-length", "3", "--run-dir", str(tmp_path / "r"),
        "--eval-interval", "2", "--eval-prompt-data", "builtin",
        "--eval-prompt-data", str(held), "--n-samples-per-eval-prompt", "4",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2]
    assert {"eval/builtin/mean@4", "eval/zeros/mean@4", "eval/mean@4"} <= set(rows[1])
    assert not _eval_part(rows[0])
    assert "step 2/2" in result.stderr and "eval/mean@4=" in result.stderr


def test_the_evaluator_needs_held_out_sets():
    config = TrainConfig.from_flags(eval_interval=1)
    with pytest.raises(ValueError, match="no held-out set"):
        Evaluator(config.eval, {}, len, None, engine=None)
