"""The long-response built-in task: column-wise addition written out with its carries.

A prompt is two ``k``-digit numbers (no leading zero), most significant digit first::

    <bos> 4 7 5 + 3 8 9 =

The one correct response is the written method, one column per step from the right, then the
answer (`trace_text`)::

    5 + 9 + 0 = 1 4 ; 7 + 8 + 1 = 1 6 ; 4 + 3 + 1 = 0 8 ; = 8 6 4 <eos>

Column ``i`` (units first) is ``a_i + b_i + c = t u ;``: the two digits, the carry in ``c`` (0 for
the units), and the column's sum as two digits, ``t`` the carry out and ``u`` the written digit.
After the last column, ``=`` and the sum ``a + b`` in decimal (no leading zero). Every token after
the first column depends on the ones before it (carries flow right to left, the answer is read
back from the ``u``s), so one early wrong token derails the rest. A response is
``9 k + 2 + len(str(a + b))`` tokens with ``<eos>`` (`response_tokens`): 32-33 for ``k = 3``,
82-83 for ``k = 8``, 122-123 for ``k = 12`` (the most `AdditionTraceConfig` allows, so a response
always fits in 128 tokens).

Reward: exact (`megatron_rl.rewards.score_addition_trace`): 1.0 only when the response's symbols
are the whole trace and the answer, else 0.0; no partial credit. A record's ``answer`` is the
reference response text (without ``<eos>``).

The held-out split tests the rule, not memorised prompts: an unordered pair ``{a, b}`` is held
out by a fixed hash (`is_heldout_pair`, about one pair in ten, both orders together), training
prompts are drawn only from the other pairs, and the held-out set `addition_trace_heldout` (named
``HELDOUT_NAME``) is drawn only from held-out pairs with its own fixed seed: the same prompts for
every run and every ``seed``, none of them (nor their swap) ever a training prompt. It has
``HELDOUT_PER_DIGITS`` prompts for each digit count of the task, in order of digit count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron_rl.data.addition_trace_tokenizer import AdditionTraceTokenizer
from megatron_rl.data.records import PromptRecord

HELDOUT_NAME = "addition-trace-heldout"
"""The held-out set's name (``--eval-prompt-data builtin`` with ``--task addition-trace``)."""
HELDOUT_SEED = 20261204
"""Seed of the held-out set's draw: fixed, so the set never depends on a run's ``--seed``."""
HELDOUT_PER_DIGITS = 4
"""Held-out prompts per digit count (24 for the default digit counts 3..8)."""
HELDOUT_MODULUS = 10
"""A pair is held out when its hash is 0 modulo this (one pair in ten)."""
MAX_DIGITS = 12
"""Longest operands: ``9 * 12 + 2 + 13 = 123`` response tokens, within 128."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AdditionTraceConfig:
    """Shape of the addition-trace task.

    Attributes:
        min_digits, max_digits: each prompt's digit count ``k`` is drawn uniformly from
            ``[min_digits, max_digits]``, ``3 <= min_digits <= max_digits <= 12`` (responses of
            32 to 123 tokens).
        num_prompts: training prompts (distinct, all from training pairs).
        seed: which training prompts are drawn; the held-out set does not depend on it.
    """

    min_digits: int = 3
    max_digits: int = 8
    num_prompts: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if not 3 <= self.min_digits <= MAX_DIGITS:
            raise ValueError(
                f"min_digits={self.min_digits!r}: must be in [3, {MAX_DIGITS}] (3 digits give "
                "the shortest response of 32 tokens)"
            )
        if not self.min_digits <= self.max_digits <= MAX_DIGITS:
            raise ValueError(
                f"max_digits={self.max_digits!r}: must be in [min_digits={self.min_digits}, "
                f"{MAX_DIGITS}] (12 digits give the longest response, 123 tokens)"
            )
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts={self.num_prompts!r}: pass a positive int")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed!r}: pass a non-negative int")

    @property
    def digit_counts(self) -> range:
        return range(self.min_digits, self.max_digits + 1)

    @property
    def longest_prompt_tokens(self) -> int:
        """``<bos>``, two ``max_digits``-digit numbers, ``+`` and ``=``."""
        return 2 * self.max_digits + 3

    @property
    def longest_response_tokens(self) -> int:
        """The longest correct response, ``<eos>`` included: ``9 k + 2 + (k + 1)``."""
        return 10 * self.max_digits + 3


def is_heldout_pair(a: int, b: int) -> bool:
    """Whether the unordered pair ``{a, b}`` belongs to the held-out split.

    ``blake2b("min+max", person="addtrace-split")`` (4 bytes, big-endian) modulo
    ``HELDOUT_MODULUS`` is 0: a fixed rule, independent of any seed, about one pair in ten, and
    ``(a, b)`` and ``(b, a)`` always on the same side.
    """
    low, high = min(a, b), max(a, b)
    digest = hashlib.blake2b(f"{low}+{high}".encode(), digest_size=4, person=b"addtrace-split")
    return int.from_bytes(digest.digest(), "big") % HELDOUT_MODULUS == 0


def prompt_text(a: int, b: int) -> str:
    """``<bos> a_1 ... a_k + b_1 ... b_k =`` (most significant digit first)."""
    return f"<bos> {' '.join(str(a))} + {' '.join(str(b))} ="


def trace_text(a: int, b: int) -> str:
    """The correct response to ``a + b`` (same digit count), without ``<eos>`` (module doc)."""
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    if len(digits_a) != len(digits_b):
        raise ValueError(f"{a} + {b}: the operands must have the same number of digits")
    columns, carry = [], 0
    for da, db in zip(map(int, digits_a), map(int, digits_b), strict=True):
        total = da + db + carry
        columns.append(f"{da} + {db} + {carry} = {total // 10} {total % 10} ;")
        carry = total // 10
    return " ".join(columns) + " = " + " ".join(str(a + b))


def response_tokens(a: int, b: int) -> int:
    """Tokens of the correct response with ``<eos>``: ``9 k + 2 + len(str(a + b))``."""
    return 9 * len(str(a)) + 2 + len(str(a + b))


def addition_trace_task(
    config: AdditionTraceConfig,
) -> tuple[AdditionTraceTokenizer, list[PromptRecord]]:
    """The task's tokenizer and its ``config.num_prompts`` training records (training pairs only),
    in the order drawn from ``config.seed``; ``answer`` is the reference response text."""
    rng = np.random.default_rng(config.seed)
    pairs = _draw(rng, config.num_prompts, config, keep=lambda a, b: not is_heldout_pair(a, b))
    return AdditionTraceTokenizer(), _records(pairs)


def addition_trace_heldout(
    config: AdditionTraceConfig, per_digits: int = HELDOUT_PER_DIGITS
) -> list[PromptRecord]:
    """The held-out set ``HELDOUT_NAME``: ``per_digits`` held-out pairs per digit count of
    ``config`` (ascending), drawn with ``HELDOUT_SEED`` whatever ``config.seed`` is.

    The draw per digit count is sequential, so a larger ``per_digits`` extends every digit
    count's list: the default 24 prompts are the first 4 of each count of any larger set.
    """
    if isinstance(per_digits, bool) or not isinstance(per_digits, int) or per_digits < 1:
        raise ValueError(f"per_digits={per_digits!r}: pass an int >= 1 (prompts per digit count)")
    pairs = []
    for digits in config.digit_counts:
        rng = np.random.default_rng([HELDOUT_SEED, digits])
        only = AdditionTraceConfig(min_digits=digits, max_digits=digits)
        pairs += _draw(rng, per_digits, only, keep=is_heldout_pair)
    return _records(pairs)


def _draw(
    rng: np.random.Generator,
    count: int,
    config: AdditionTraceConfig,
    keep: Callable[[int, int], bool],
) -> list[tuple[int, int]]:
    """``count`` distinct pairs ``(a, b)`` of ``k``-digit numbers, ``k`` uniform over the digit
    counts, each accepted by ``keep``."""
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(pairs) < count:
        digits = int(rng.integers(config.min_digits, config.max_digits + 1))
        low, high = 10 ** (digits - 1), 10**digits
        a, b = int(rng.integers(low, high)), int(rng.integers(low, high))
        if (a, b) in seen or not keep(a, b):
            continue
        seen.add((a, b))
        pairs.append((a, b))
    return pairs


def _records(pairs: list[tuple[int, int]]) -> list[PromptRecord]:
    tokenizer = AdditionTraceTokenizer()
    records = []
    for index, (a, b) in enumerate(pairs):
        text = prompt_text(a, b)
        records.append(PromptRecord(index, tuple(tokenizer.encode(text)), trace_text(a, b), text))
    return records
