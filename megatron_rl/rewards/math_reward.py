"""The "math" reward: Hugging Face Math-Verify compares the response's final answer with the gold.

What is compared:
- the response: the content of its last ``\\boxed{...}`` when it has one (re-wrapped as
  ``\\boxed{...}``); otherwise its last ``TAIL_CHARS`` characters, from which Math-Verify takes a
  ``final answer is ...`` / LaTeX / plain expression. Math-Verify by itself merges *all* boxed
  answers into a set (``\\boxed{3} ... \\boxed{1/2}`` becomes ``{3, 1/2}``); taking the last box
  instead matches how reasoning models are prompted ("put the final answer in \\boxed{}").
- the gold answer (e.g. DAPO's ``reward_model.ground_truth``): parsed as ``\\boxed{answer}``
  unless it already holds a ``\\boxed``; parses are cached, since a prompt's ``n`` samples share
  one answer. A gold answer Math-Verify cannot parse raises (the sample fails, with a message),
  since it is a data problem, not a wrong response.

Timeouts: Math-Verify bounds each parse and each comparison with ``signal.alarm``
(``TIMEOUT_SECONDS`` each; a timeout counts as "not equal", logged by Math-Verify). ``signal``
only works in the main thread, so called from another thread this reward disables Math-Verify's
timeouts (and warns once): run reward scoring in the main thread of a process (or in worker
processes) to keep the protection against adversarial inputs.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

TIMEOUT_SECONDS = 5
"""Math-Verify's per-parse and per-comparison limit (``signal.alarm`` takes whole seconds)."""
TAIL_CHARS = 2000
"""Characters at the end of a response without ``\\boxed`` that are searched for the answer."""

_BOXED = "\\boxed"
_warned_thread = False


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (balanced braces), or None."""
    start = text.rfind(_BOXED + "{")
    while start != -1:
        depth = 0
        for end in range(start + len(_BOXED), len(text)):
            if text[end] == "{":
                depth += 1
            elif text[end] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len(_BOXED) + 1 : end]
        start = text.rfind(_BOXED + "{", 0, start)  # unclosed: try the box before it
    return None


def _timeout() -> int | None:
    global _warned_thread
    if threading.current_thread() is threading.main_thread():
        return TIMEOUT_SECONDS
    if not _warned_thread:
        _warned_thread = True
        logger.warning(
            "math reward called outside the main thread: Math-Verify's signal-based timeouts "
            "are disabled; score rewards in the main thread to keep them"
        )
    return None


@functools.lru_cache(maxsize=65536)
def _parse_gold(answer: str, timeout: int | None) -> list[Any]:
    from math_verify import parse

    text = answer if _BOXED in answer else f"{_BOXED}{{{answer}}}"
    gold = parse(text, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"Math-Verify cannot parse the gold answer {answer!r}")
    return gold


def math_reward(response: str, answer: str) -> float:
    """1.0 when Math-Verify finds the response's final answer equal to ``answer``, else 0.0."""
    from math_verify import parse, verify

    timeout = _timeout()
    gold = _parse_gold(answer, timeout)
    boxed = last_boxed(response)
    text = f"{_BOXED}{{{boxed}}}" if boxed is not None else response[-TAIL_CHARS:]
    predicted = parse(text, parsing_timeout=timeout)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0
