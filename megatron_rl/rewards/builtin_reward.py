"""The built-in task's reward: the first symbol of the response is the answer digit."""

from __future__ import annotations


def score_builtin_response(response: str, answer: str) -> float:
    """1.0 when the first whitespace-separated symbol of ``response`` equals ``answer``, else 0.0.

    ``response`` is the decoded response (special tokens dropped), e.g. ``"3"`` or ``"3 + 1"``
    (only ``"3"`` counts); an empty response scores 0.0.
    """
    symbols = response.split()
    return 1.0 if symbols and symbols[0] == answer.strip() else 0.0
