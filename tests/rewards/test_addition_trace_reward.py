"""The addition-trace reward is exact: the whole trace and the answer, no partial credit."""

from __future__ import annotations

from megatron_rl.data.addition_trace import trace_text
from megatron_rl.data.addition_trace_tokenizer import EOS_ID, SYMBOLS, AdditionTraceTokenizer
from megatron_rl.rewards import get_reward_fn, score_addition_trace


def test_exact_trace_scores_one_and_any_one_token_change_scores_zero():
    tokenizer = AdditionTraceTokenizer()
    answer = trace_text(475, 389)
    ids = tokenizer.encode(answer)
    assert score_addition_trace(tokenizer.decode([*ids, EOS_ID]), answer) == 1.0
    visible = [i for i, s in enumerate(SYMBOLS) if s not in ("<pad>", "<eos>")]
    for position in range(len(ids)):
        for token in visible:
            if token == ids[position]:
                continue
            wrong = [*ids[:position], token, *ids[position + 1 :], EOS_ID]
            assert score_addition_trace(tokenizer.decode(wrong), answer) == 0.0, wrong


def test_missing_or_extra_tokens_score_zero():
    answer = trace_text(475, 389)
    symbols = answer.split()
    assert score_addition_trace(" ".join(symbols[:-1]), answer) == 0.0
    assert score_addition_trace(answer + " 4", answer) == 0.0
    assert score_addition_trace("<bos> " + answer, answer) == 0.0
    assert score_addition_trace("", answer) == 0.0
    # a right final sum after a wrong carry is still wrong
    wrong_carry = answer.replace("7 + 8 + 1 = 1 6", "7 + 8 + 0 = 1 6", 1)
    assert wrong_carry != answer and score_addition_trace(wrong_carry, answer) == 0.0
    assert score_addition_trace("  ".join(symbols), answer) == 1.0


def test_registered_by_name():
    assert get_reward_fn("addition-trace") is score_addition_trace
