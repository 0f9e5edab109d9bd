"""The addition-trace task: its trace format, response lengths, tokenizer, held-out rule, and its
selection by --task."""

from __future__ import annotations

import pytest

from megatron_rl.data import Tokenizer
from megatron_rl.data.addition_trace import (
    HELDOUT_PER_DIGITS,
    MAX_DIGITS,
    AdditionTraceConfig,
    addition_trace_heldout,
    addition_trace_task,
    is_heldout_pair,
    response_tokens,
    trace_text,
)
from megatron_rl.data.addition_trace_tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SYMBOLS,
    AdditionTraceTokenizer,
)
from megatron_rl.rewards import score_addition_trace
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.task import build_task


def _operands(record) -> tuple[int, int]:
    a, b = record.prompt_text.removeprefix("<bos> ").removesuffix(" =").split(" + ")
    return int(a.replace(" ", "")), int(b.replace(" ", ""))


def test_trace_writes_each_column_with_its_carries_then_the_sum():
    assert trace_text(475, 389) == ("5 + 9 + 0 = 1 4 ; 7 + 8 + 1 = 1 6 ; 4 + 3 + 1 = 0 8 ; = 8 6 4")
    assert trace_text(999, 999).endswith("9 + 9 + 1 = 1 9 ; = 1 9 9 8")
    with pytest.raises(ValueError, match="same number of digits"):
        trace_text(99, 100)


def test_every_record_answers_its_sum_with_a_response_of_32_to_128_tokens():
    tokenizer, records = addition_trace_task(AdditionTraceConfig(num_prompts=600))
    heldout = addition_trace_heldout(AdditionTraceConfig())
    lengths = set()
    for record in records + heldout:
        a, b = _operands(record)
        assert record.answer == trace_text(a, b)
        assert record.answer.split("= ")[-1].replace(" ", "") == str(a + b)
        length = len(tokenizer.encode(record.answer)) + 1  # <eos>
        assert length == response_tokens(a, b)
        lengths.add(length)
    assert min(lengths) == 32 and max(lengths) >= 82  # digit counts 3..8
    assert AdditionTraceConfig().longest_response_tokens == 83
    longest = AdditionTraceConfig(min_digits=MAX_DIGITS, max_digits=MAX_DIGITS)
    assert longest.longest_response_tokens == 123 <= 128
    assert response_tokens(10**11 * 9, 10**11 * 9) == 123


def test_tokenizer_ids_are_fixed_and_round_trip():
    tokenizer = AdditionTraceTokenizer()
    assert isinstance(tokenizer, Tokenizer)
    assert ("<pad>", "<bos>", "<eos>", "+", "=", ";", *"0123456789") == SYMBOLS
    assert (tokenizer.vocab_size, PAD_ID, BOS_ID, EOS_ID) == (16, 0, 1, 2)
    assert tokenizer.encode("4 7 + 0 = ;") == [10, 13, 3, 6, 4, 5]
    _, records = addition_trace_task(AdditionTraceConfig(num_prompts=50))
    for record in records:
        assert tokenizer.decode(tokenizer.encode(record.answer)) == record.answer
        assert tokenizer.decode(record.prompt_ids) == record.prompt_text
        assert tokenizer.encode(record.prompt_text) == list(record.prompt_ids)
    # <eos> and <pad> vanish from a response, a stray <bos> does not
    assert tokenizer.decode([10, EOS_ID, PAD_ID]) == "4"
    assert tokenizer.decode([10, BOS_ID]) == "4 <bos>"
    with pytest.raises(ValueError, match="outside"):
        tokenizer.decode([16])
    with pytest.raises(ValueError, match="not in the addition-trace"):
        tokenizer.encode("4 ?")


def test_heldout_pairs_never_appear_in_training_in_either_order():
    heldout = addition_trace_heldout(AdditionTraceConfig())
    pairs = {_operands(r) for r in heldout}
    assert len(pairs) == len(heldout) == 6 * HELDOUT_PER_DIGITS
    assert all(is_heldout_pair(a, b) for a, b in pairs)
    digit_counts = [len(str(a)) for a, _ in map(_operands, heldout)]
    assert digit_counts == sorted(digit_counts) and set(digit_counts) == set(range(3, 9))
    for seed in (0, 1, 1234):
        _, records = addition_trace_task(AdditionTraceConfig(num_prompts=2000, seed=seed))
        training = {_operands(r) for r in records}
        assert len(training) == 2000
        assert not any(is_heldout_pair(a, b) for a, b in training)
        assert not training & pairs
        assert not training & {(b, a) for a, b in pairs}
        # the held-out set is fixed: the run's seed never changes it
        assert addition_trace_heldout(AdditionTraceConfig(seed=seed)) == heldout


def test_heldout_rule_keeps_about_one_pair_in_ten():
    held = sum(is_heldout_pair(a, a + 7) for a in range(1000, 6000))
    assert 400 < held < 600
    assert all(is_heldout_pair(a, b) == is_heldout_pair(b, a) for a, b in [(123, 456), (7, 99)])


def test_training_prompts_follow_the_seed():
    config = AdditionTraceConfig(num_prompts=30, seed=3)
    assert addition_trace_task(config)[1] == addition_trace_task(config)[1]
    assert (
        addition_trace_task(config)[1]
        != addition_trace_task(AdditionTraceConfig(num_prompts=30, seed=4))[1]
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_digits": 2}, "min_digits"),
        ({"max_digits": 13}, "max_digits"),
        ({"min_digits": 5, "max_digits": 4}, "max_digits"),
        ({"num_prompts": 0}, "num_prompts"),
        ({"seed": -1}, "seed"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AdditionTraceConfig(**kwargs)


def test_task_flag_builds_the_trace_task_with_its_reward_and_heldout_set():
    config = TrainConfig.from_flags(
        task="addition-trace", model="tiny-mismatch", max_response_length=128, eval_interval=5
    )
    task = build_task(config.task, config.eval)
    assert isinstance(task.tokenizer, AdditionTraceTokenizer)
    assert task.reward_fn is score_addition_trace and task.eval_reward_fn is score_addition_trace
    assert task.eval_sets["builtin"] == addition_trace_heldout(AdditionTraceConfig())
    assert task.hf_config.vocab_size == 16 and task.hf_config.num_experts == 64
    assert task.records == addition_trace_task(AdditionTraceConfig(seed=1234))[1]


def test_task_flag_refuses_a_response_length_too_short_for_the_trace():
    config = TrainConfig.from_flags(task="addition-trace", max_response_length=64)
    with pytest.raises(ValueError, match=r"--max-response-length 64: .* pass --max-response-len"):
        build_task(config.task)
    config = TrainConfig.from_flags(
        task="addition-trace",
        max_response_length=83,
        eval_interval=5,
        eval_max_response_length=40,
    )
    with pytest.raises(ValueError, match="--eval-max-response-length 40"):
        build_task(config.task, config.eval)


def test_task_flag_and_prompt_data_exclude_each_other():
    with pytest.raises(ValueError, match=r"--task='addition-trace': .*--prompt-data"):
        TrainConfig.from_flags(task="addition-trace", prompt_data="x.jsonl")
    with pytest.raises(ValueError, match="--task"):
        TrainConfig.from_flags(task="nope")
