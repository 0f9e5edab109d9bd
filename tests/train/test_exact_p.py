"""The teacher-forced held-out metric (megatron_rl/train/exact_p.py), its flags and its sets."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_testing import rendezvous, small_config

from megatron_rl.data.addition_trace import AdditionTraceConfig, addition_trace_heldout
from megatron_rl.data.records import PromptRecord
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.train.config import parse_args
from megatron_rl.train.exact_p import ReferenceScorer, exact_metrics, reference_sample

ROOT = Path(__file__).resolve().parents[2]


def test_exact_metrics_average_probabilities_and_log_probabilities_per_set():
    out = exact_metrics({"a": [math.log(0.5), math.log(0.25)], "b": [0.0]})
    assert out["eval/a/exact_p"] == pytest.approx(0.375)
    assert out["eval/a/exact_logp"] == pytest.approx((math.log(0.5) + math.log(0.25)) / 2)
    assert out["eval/b/exact_p"] == 1.0 and out["eval/b/exact_logp"] == 0.0
    assert out["eval/exact_p"] == pytest.approx((0.375 + 1.0) / 2)  # each set counts once
    with pytest.raises(ValueError, match="'a' has no scored prompt"):
        exact_metrics({"a": []})
    with pytest.raises(ValueError, match=r"'a' has log-probabilities \[0.5\]"):
        exact_metrics({"a": [0.5]})


def test_a_reference_sample_scores_the_answer_and_its_eos():
    record = addition_trace_heldout(AdditionTraceConfig())[0]
    from megatron_rl.data.addition_trace_tokenizer import AdditionTraceTokenizer

    tokenizer = AdditionTraceTokenizer()
    sample = reference_sample(record, tokenizer)
    ids = sample.response_ids.tolist()
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[:-1]) == record.answer
    assert sample.prompt_ids.tolist() == list(record.prompt_ids)


def test_larger_builtin_sets_extend_the_default_one_per_digit_count():
    default = addition_trace_heldout(AdditionTraceConfig())
    larger = addition_trace_heldout(AdditionTraceConfig(), per_digits=10)
    assert len(default) == 24 and len(larger) == 60
    for k in range(6):  # digit counts 3..8, in order
        assert [r.prompt_text for r in larger[10 * k : 10 * k + 4]] == [
            r.prompt_text for r in default[4 * k : 4 * k + 4]
        ]
    with pytest.raises(ValueError, match="per_digits=0"):
        addition_trace_heldout(AdditionTraceConfig(), per_digits=0)


def test_exact_flags_name_their_sets_and_sampling_can_be_sparser():
    config = parse_args(
        ["--task", "addition-trace", "--max-response-length", "128", "--eval-interval", "5",
         "--eval-exact-p-data", "builtin:100", "--eval-exact-p-data", "small=builtin:2",
         "--eval-prompt-data", "builtin:22", "--eval-sampled-interval", "20"]
    )  # fmt: skip
    evaluation = config.eval
    assert evaluation.exact_sets == (("builtin-100", "builtin:100"), ("small", "builtin:2"))
    assert evaluation.sets == (("builtin-22", "builtin:22"),)
    assert [s for s in range(0, 41, 5) if evaluation.samples_at(s)] == [0, 20, 40]
    only_exact = parse_args(["--eval-interval", "5", "--eval-exact-p-data", "builtin"]).eval
    assert only_exact.sets == ()  # nothing is sampled unless asked for


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--eval-exact-p-data", "builtin"], "--eval-exact-p-data=('builtin',): has no effect"),
        (
            ["--eval-interval", "5", "--eval-sampled-interval", "7"],
            "--eval-sampled-interval=7: must be a positive multiple of --eval-interval (5)",
        ),
        (
            ["--eval-interval", "2", "--eval-exact-p-data", "x=a.jsonl", "--eval-prompt-data",
             "x=b.jsonl"],
            "two sets are named 'x'",
        ),
        (
            ["--eval-interval", "2", "--prompt-data", "t.jsonl", "--eval-exact-p-data",
             "builtin:3"],
            "--eval-exact-p-data=('builtin:3',): 'builtin:3': the built-in held-out set needs",
        ),
    ],
)  # fmt: skip
def test_bad_exact_flags_are_errors_naming_the_flag(argv, message):
    with pytest.raises(ValueError) as caught:
        parse_args(argv)
    assert message in str(caught.value)


def test_a_task_without_sized_held_out_sets_refuses_a_size(tmp_path):
    from megatron_rl.train.task import build_task

    config = parse_args(["--eval-interval", "1", "--eval-exact-p-data", "builtin:3"])
    with pytest.raises(ValueError, match=r"builtin-3=builtin:3 \(--task successor\): builtin:3: "):
        build_task(config.task, config.eval)


def test_exact_logp_is_the_engines_log_probability_of_the_same_response(tmp_path):
    """The teacher-forced sum over a response and its <eos> equals the fp32 in-process engine's
    own log-probs of that response, sampled at temperature 1: the quantity is the probability
    that the sampler writes it. (A separate code path: the engine's decoding loop with its KV
    cache, against one megatron forward of the trainer.)"""
    from megatron_rl.train.trainer import Trainer

    config = small_config(tmp_path, task="addition-trace", max_response_length=128, temperature=1.0)
    trainer = Trainer(config, **rendezvous(tmp_path))
    try:
        tokenizer = trainer.tokenizer
        held = addition_trace_heldout(AdditionTraceConfig())[:6]
        params = SamplingParams(
            temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=40,
            stop_token_ids=(tokenizer.eos_token_id,), seed=3,
        )  # fmt: skip
        generated = trainer.engine.generate([list(r.prompt_ids) for r in held], params, n=2)
        sets, expected = {}, {}
        for s in generated:
            ids = s.response_ids_R.tolist()
            text = tokenizer.decode(ids[:-1])
            if s.finish_reason != "stop" or list(tokenizer.encode(text)) != ids[:-1]:
                continue  # the reference must be this exact token sequence and end with <eos>
            name = f"p{s.prompt_index}s{s.sample_index}"
            prompt = held[s.prompt_index]
            sets[name] = [PromptRecord(0, prompt.prompt_ids, text, prompt.prompt_text)]
            expected[name] = float(s.logprobs_R.double().sum())
        assert len(sets) >= 4, "too few sampled responses ended with <eos> to compare"
        scorer = ReferenceScorer(
            sets, tokenizer, model=trainer.model, ranks=trainer.ranks,
            schedule=config.schedule, temperature=1.0,
        )  # fmt: skip
        metrics = scorer.score()
    finally:
        trainer.close()
    for name, logp in expected.items():
        assert metrics[f"eval/{name}/exact_logp"] == pytest.approx(logp, abs=1e-4)
        assert metrics[f"eval/{name}/exact_p"] == pytest.approx(math.exp(logp), rel=1e-4)


@pytest.mark.slow
def test_the_cli_scores_the_exact_sets_at_every_evaluation_and_samples_at_its_interval(tmp_path):
    command = [
        sys.executable, "-m", "megatron_rl.train", "--device", "cpu", "--task",
        "addition-trace", "--max-response-length", "128", "--train-iters", "2",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
        "--micro-batch-size", "4", "--run-dir", str(tmp_path / "r"), "--eval-before-train",
        "--eval-interval", "1", "--eval-exact-p-data", "builtin:2", "--eval-prompt-data",
        "sampled=builtin:1", "--eval-sampled-interval", "2", "--n-samples-per-eval-prompt", "2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [
        json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [0, 1, 2]
    exact = {
        "eval/builtin-2/exact_p",
        "eval/builtin-2/exact_logp",
        "eval/exact_p",
        "eval/exact_logp",
    }
    sampled = {"eval/sampled/mean@2", "eval/mean@2"}
    assert all(exact <= set(r) for r in rows)
    assert [sampled <= set(r) for r in rows] == [True, False, True]
    assert all(0.0 < r["eval/exact_p"] < 1.0 and r["eval/exact_logp"] < 0.0 for r in rows)
    assert "step 0/2" in result.stderr and "eval/exact_p=" in result.stderr
