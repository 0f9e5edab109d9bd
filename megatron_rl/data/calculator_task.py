"""The multi-turn tool-use built-in task (``--task calculator``): products with a calculator tool.

A prompt asks for the product of two digits ``a, b`` in ``1..9`` (81 prompts)::

    <bos> 7 * 8 =

The response may call the calculator: ``[`` an expression ``]``. The expression is digits and
``+`` / ``*`` (``*`` binds first); an empty one, ``[ ]``, means the prompt's own question. When a
turn of the model ends with ``]`` the environment appends the tool's answer (`tool_answer`: the
value's digits, or ``?`` for a malformed expression) and the model goes on in a new turn. Correct
episodes, the tool's tokens in parentheses::

    [ ] (5 6) <eos>     [ 7 * 8 ] (5 6) <eos>     [ ] (5 6) 5 6 <eos>

The tool's tokens were not sampled by the policy, so the multi-turn rollout
(`megatron_rl.train.tool_rollout.calculator_rollout`) masks them out of the loss.

Reward (`episode_reward`, computed by that rollout from the tokens' roles, not from text): 1.0
when the episode ends at ``<eos>`` and its final answer is exactly the product's digits; the final
answer is the model's own tokens after the last tool answer (``<eos>`` excluded) or, when it
writes none (``<eos>`` right after the tool's answer), the tool's answer, which the model thereby
accepts. Otherwise ``CALL_BONUS`` when the last tool answer was a value (a well-formed call: a
small shaping term that gives a randomly initialised policy a signal to start from), else 0.0.

Tokenizer (`CalculatorTokenizer`, fixed ids): ``<pad> <bos> <eos> + * = [ ] ?`` then the digits
``0..9`` (ids 9..18), 19 symbols (the ``tiny`` presets pad the vocabulary to 24). ``decode``
hides ``<pad>`` and ``<eos>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_rl.data.records import PromptRecord
from megatron_rl.data.symbol_tokenizer import SymbolTokenizer

PAD_ID, BOS_ID, EOS_ID, PLUS_ID, TIMES_ID, EQUALS_ID, CALL_ID, END_CALL_ID, ERROR_ID = range(9)
DIGIT0_ID = 9
SYMBOLS: tuple[str, ...] = (
    "<pad>", "<bos>", "<eos>", "+", "*", "=", "[", "]", "?", *map(str, range(10)),
)  # fmt: skip
CALL_BONUS = 0.1
"""Reward of an episode with a well-formed tool call but a wrong final answer."""
MIN_RESPONSE_TOKENS = 8
"""A ``[ a * b ]`` call, the tool's two digits and ``<eos>``: 8 tokens."""


class CalculatorTokenizer(SymbolTokenizer):
    """Whitespace tokenizer over `SYMBOLS` (the `Tokenizer` protocol)."""

    SYMBOLS = SYMBOLS
    HIDDEN_IDS = frozenset({PAD_ID, EOS_ID})
    VOCABULARY = "the calculator vocabulary"
    eos_token_id: int = EOS_ID
    pad_token_id: int = PAD_ID
    bos_token_id: int = BOS_ID


@dataclass(frozen=True, kw_only=True, slots=True)
class CalculatorConfig:
    """``seed``: the order of the 81 prompts (every ``a * b`` with ``a, b`` in 1..9)."""

    seed: int = 0

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed={self.seed!r}: pass a non-negative int")


def calculator_task(config: CalculatorConfig) -> tuple[CalculatorTokenizer, list[PromptRecord]]:
    """The tokenizer and the 81 records in the seed's order; ``answer`` is the product."""
    tokenizer = CalculatorTokenizer()
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    order = np.random.default_rng(config.seed).permutation(len(pairs))
    records = []
    for index, k in enumerate(order):
        a, b = pairs[int(k)]
        text = f"<bos> {a} * {b} ="
        records.append(PromptRecord(index, tuple(tokenizer.encode(text)), str(a * b), text))
    return tokenizer, records


def calculator_heldout(config: CalculatorConfig) -> list[PromptRecord]:
    """None: the evaluation generates single-turn, which cannot answer a tool call."""
    raise ValueError(
        "the built-in task calculator has no held-out split (the evaluation generates "
        "single-turn, without the tool); drop --eval-interval / --eval-prompt-data builtin"
    )


def digits(value: int) -> list[int]:
    """Token ids of ``value``'s decimal digits."""
    return [DIGIT0_ID + int(c) for c in str(value)]


def evaluate(expression: Sequence[int]) -> int | None:
    """The value of ``expression`` (token ids: numbers of digits, ``+``, ``*``; ``*`` first), or
    None when it is malformed (empty, an operator at either end or twice in a row, another
    symbol)."""
    terms: list[int] = []  # products of the sum
    factors: list[int] = []
    number: int | None = None
    for token in expression:
        if DIGIT0_ID <= token < DIGIT0_ID + 10:
            number = (number or 0) * 10 + token - DIGIT0_ID
        elif token in (PLUS_ID, TIMES_ID) and number is not None:
            factors.append(number)
            number = None
            if token == PLUS_ID:
                terms.append(int(np.prod(factors, dtype=object)))
                factors = []
        else:
            return None
    if number is None:
        return None
    factors.append(number)
    terms.append(int(np.prod(factors, dtype=object)))
    return sum(terms)


def question(prompt_ids: Sequence[int]) -> list[int]:
    """The prompt's expression: its tokens between ``<bos>`` and the final ``=``."""
    ids = list(prompt_ids)
    start = 1 if ids and ids[0] == BOS_ID else 0
    end = len(ids) - 1 if ids and ids[-1] == EQUALS_ID else len(ids)
    return ids[start:end]


def tool_answer(turn_ids: Sequence[int], prompt_ids: Sequence[int]) -> tuple[list[int], bool]:
    """``(tokens the environment appends, well-formed)`` for a model turn ending in ``]``: the
    value of the expression after the turn's last ``[`` (an empty one: the prompt's question) as
    digits, or ``[?]`` when there is no ``[`` or the expression is malformed."""
    ids = list(turn_ids)
    if not ids or ids[-1] != END_CALL_ID or CALL_ID not in ids:
        return [ERROR_ID], False
    start = len(ids) - 1 - ids[::-1].index(CALL_ID)
    expression = ids[start + 1 : -1] or question(prompt_ids)
    value = evaluate(expression)
    return ([ERROR_ID], False) if value is None else (digits(value), True)


def episode_reward(
    final_answer: Sequence[int], last_tool_answer: Sequence[int], answer: str, *, ended: bool
) -> tuple[float, bool]:
    """``(reward, correct)`` of an episode (module docstring): ``final_answer`` is the model's
    tokens after the last tool answer (``<eos>`` included when it ended), ``last_tool_answer``
    that answer's tokens (empty without a call), ``ended``: the episode ended at ``<eos>``."""
    own = [int(t) for t in final_answer if t != EOS_ID]
    given = own if own or not last_tool_answer else [int(t) for t in last_tool_answer]
    if ended and given == digits(int(answer)):
        return 1.0, True
    return (
        (CALL_BONUS, False)
        if last_tool_answer and ERROR_ID not in last_tool_answer
        else (
            0.0,
            False,
        )
    )
