"""The "math" reward: Math-Verify equivalence of the response's final answer and the gold."""

from __future__ import annotations

import threading

import pytest

from megatron_rl.rewards import compute_rewards, get_reward_fn
from megatron_rl.rewards.math_reward import last_boxed, math_reward

CASES = [
    (r"So the answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"Thus $x = \boxed{3}$", "3", 1.0),
    (r"\boxed{\dfrac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),
    ("The final answer is 34", "34", 1.0),
    (r"First \boxed{7}, no wait: \boxed{34}", "34", 1.0),
    (r"First \boxed{34}, no wait: \boxed{7}", "34", 0.0),
    (r"\boxed{0.25}", "0.5", 0.0),
    (r"\boxed{4}", "3", 0.0),
    ("I do not know", "3", 0.0),
    ("", "3", 0.0),
]


@pytest.mark.parametrize(("response", "answer", "expected"), CASES)
def test_math_reward_equivalent_forms_and_wrong_answers(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_registry_math_is_math_verify_and_batches():
    responses, answers, expected = zip(*CASES, strict=True)
    out = compute_rewards(get_reward_fn("math"), list(responses), list(answers))
    assert out.rewards == list(expected) and not any(out.failed)


def test_unparsable_gold_fails_the_sample_not_the_batch():
    out = compute_rewards(get_reward_fn("math"), [r"\boxed{3}", r"\boxed{3}"], ["3", " "])
    assert out.rewards == [1.0, 0.0] and out.failed == [False, True]
    assert "cannot parse the gold answer" in out.errors[1]


def test_last_boxed_handles_nested_and_unclosed_braces():
    assert last_boxed(r"a \boxed{\frac{1}{2}} b") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{1} then \boxed{2") == "1"
    assert last_boxed("no box") is None


def test_math_reward_works_outside_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(math_reward(r"\boxed{2}", "2")))
    thread.start()
    thread.join()
    assert results == [1.0]
