"""The calculator task: its prompts, the tool's arithmetic and answers, the episode reward."""

from __future__ import annotations

import pytest

from megatron_rl.data.builtin_tasks import builtin_task_spec
from megatron_rl.data.calculator_task import (
    CALL_BONUS,
    CalculatorConfig,
    CalculatorTokenizer,
    calculator_task,
    episode_reward,
    evaluate,
    tool_answer,
)

TOK = CalculatorTokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def test_the_prompts_are_every_product_of_two_digits_once_in_the_seeds_order():
    tokenizer, records = calculator_task(CalculatorConfig(seed=3))
    texts = [tokenizer.decode(r.prompt_ids) for r in records]
    assert len(set(texts)) == 81 and texts[0].startswith("<bos> ")
    for record in records:
        _, a, _, b, _ = tokenizer.decode(record.prompt_ids).split()
        assert record.answer == str(int(a) * int(b))
    _, again = calculator_task(CalculatorConfig(seed=3))
    _, other = calculator_task(CalculatorConfig(seed=4))
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in records]
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in records]
    assert builtin_task_spec("calculator").rollout_function.endswith(":calculator_rollout")


@pytest.mark.parametrize(
    ("expression", "value"),
    [("7 * 8", 56), ("1 2 + 3 * 4", 24), ("2 * 3 + 4 * 5", 26), ("9", 9), ("0 * 7", 0)],
)
def test_the_calculator_multiplies_before_it_adds(expression, value):
    assert evaluate(ids(expression)) == value


@pytest.mark.parametrize("expression", ["", "+ 3", "3 +", "3 * * 4", "3 = 4", "[ 3"])
def test_a_malformed_expression_has_no_value(expression):
    assert evaluate(ids(expression)) is None


def test_the_tool_answers_the_last_call_or_the_question_when_it_is_empty():
    prompt = ids("<bos> 7 * 8 =")
    assert tool_answer(ids("[ 2 * 3 ]"), prompt) == (ids("6"), True)
    assert tool_answer(ids("5 [ 1 ] [ 9 * 9 ]"), prompt) == (ids("8 1"), True)
    assert tool_answer(ids("[ ]"), prompt) == (ids("5 6"), True)
    assert tool_answer(ids("4 ]"), prompt) == (ids("?"), False)
    assert tool_answer(ids("[ 4 + ]"), prompt) == (ids("?"), False)


def test_the_episode_reward_reads_the_models_final_answer_or_the_accepted_tool_answer():
    tool = ids("5 6")
    assert episode_reward(ids("5 6 <eos>"), tool, "56", ended=True) == (1.0, True)
    assert episode_reward(ids("<eos>"), tool, "56", ended=True) == (1.0, True)  # accepted
    assert episode_reward(ids("5 6 <eos>"), [], "56", ended=True) == (1.0, True)  # no tool
    assert episode_reward(ids("5 6"), tool, "56", ended=False) == (CALL_BONUS, False)
    assert episode_reward(ids("5 7 <eos>"), tool, "56", ended=True) == (CALL_BONUS, False)
    assert episode_reward(ids("<eos>"), ids("?"), "56", ended=True) == (0.0, False)
    assert episode_reward(ids("4 <eos>"), [], "56", ended=True) == (0.0, False)
