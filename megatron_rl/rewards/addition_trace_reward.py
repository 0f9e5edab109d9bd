"""The addition-trace task's reward: the whole written trace and the answer, exactly."""

from __future__ import annotations


def score_addition_trace(response: str, answer: str) -> float:
    """1.0 when the symbols of ``response`` are exactly those of ``answer``, else 0.0.

    ``answer`` is the reference response (`megatron_rl.data.addition_trace.trace_text`, e.g.
    ``"5 + 9 + 0 = 1 4 ; ... ; = 8 6 4"``); ``response`` the decoded response (``<eos>`` and
    padding dropped). No partial credit: one wrong, missing or extra symbol anywhere (a wrong
    carry, a right answer after a wrong column, a token after the answer) scores 0.0. Whitespace
    is not a symbol, so ``"1  4"`` equals ``"1 4"``.
    """
    return 1.0 if response.split() == answer.split() else 0.0
