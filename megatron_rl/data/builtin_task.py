"""The built-in verifiable task: modular addition over digit tokens (`builtin_tokenizer`).

A prompt is ``<bos> a + b =`` (``num_operands`` digits ``< modulus``, joined by ``+``); the
reference answer is ``(a + b + offset) mod modulus`` as one digit. The default is the easiest
useful instance, "the successor of digit d" (one operand, offset 1, modulus 10: ``<bos> 3 =`` ->
``4``, 10 prompts); the answer is never a token of the prompt, so copying does not pay. The
policy should answer with the digit token, then ``<eos>``. The "builtin" reward
(`megatron_rl.rewards.score_builtin_response`) gives 1.0 when the first symbol of the decoded
response is the answer digit, else 0.0; what follows it is ignored, so a rollout of
``max_response_length`` 2 to 4 suffices.

``vocab_size`` is 16 (divisible by any tensor-parallel size up to 16). Build the policy with this
vocabulary (``preset_config("tiny", vocab_size=tokenizer.vocab_size)``): a randomly initialised
model then puts about 1/16 of its mass on each token, so a group of 8 samples holds a correct
answer with probability ~0.4 and GRPO has a signal from the first step. With the preset's 512
entries the chance per sample is ~1/512 and most groups carry no signal at all (the learning
curves of both: docs/performance.md, "The built-in task's vocabulary").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from megatron_rl.data.builtin_tokenizer import BuiltinTokenizer
from megatron_rl.data.records import PromptRecord

_MAX_OPERANDS = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class BuiltinTaskConfig:
    """Shape of the modular-addition task.

    Attributes:
        num_prompts: distinct prompts in the dataset, at most ``modulus ** num_operands``.
        modulus: answers are sums modulo this, in ``[2, 10]`` (one digit token each).
        num_operands: digits per prompt, in ``[1, 4]``.
        offset: added to the sum before the modulo, in ``[0, modulus)``; not shown in the
            prompt, so ``num_operands=1, offset=1`` is "the successor of d".
        seed: which ``num_prompts`` of the possible prompts are drawn (all when equal).
    """

    num_prompts: int = 10
    modulus: int = 10
    num_operands: int = 1
    offset: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.modulus <= 10:
            raise ValueError(
                f"modulus={self.modulus!r}: must be in [2, 10] so each answer is one digit token"
            )
        if not 1 <= self.num_operands <= _MAX_OPERANDS:
            raise ValueError(f"num_operands={self.num_operands!r}: must be in [1, {_MAX_OPERANDS}]")
        if not 1 <= self.num_prompts <= self.num_possible_prompts:
            raise ValueError(
                f"num_prompts={self.num_prompts!r}: must be in [1, {self.num_possible_prompts}] "
                f"(modulus ** num_operands = {self.modulus}**{self.num_operands}); lower it or "
                "raise modulus / num_operands"
            )
        if not 0 <= self.offset < self.modulus:
            raise ValueError(f"offset={self.offset!r}: must be in [0, modulus={self.modulus})")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed!r}: pass a non-negative int")

    @property
    def num_possible_prompts(self) -> int:
        return self.modulus**self.num_operands

    @property
    def chance_accuracy(self) -> float:
        """Accuracy of guessing the answer digit uniformly among the ``modulus`` possible ones."""
        return 1.0 / self.modulus


def uniform_policy_accuracy(vocab_size: int = BuiltinTokenizer.vocab_size) -> float:
    """Accuracy of a policy whose first response token is uniform over ``vocab_size`` tokens
    (about what a randomly initialised model does): exactly one token is right, so
    ``1 / vocab_size``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r}: pass a positive int")
    return 1.0 / vocab_size


def builtin_task(config: BuiltinTaskConfig) -> tuple[BuiltinTokenizer, list[PromptRecord]]:
    """The task's tokenizer and its ``config.num_prompts`` records.

    Each record's ``prompt_ids`` is ``(BOS, d_1, +, d_2, ..., =)`` with
    ``P = 2 * num_operands + 1`` tokens, ``answer`` the digit ``sum(d) % modulus`` as a string.
    Records are in lexicographic order of their operands; which ones are present depends on
    ``seed`` when ``num_prompts < modulus ** num_operands``.
    """
    tokenizer = BuiltinTokenizer()
    operands = list(itertools.product(range(config.modulus), repeat=config.num_operands))
    if config.num_prompts < len(operands):
        rng = np.random.default_rng(config.seed)
        keep = np.sort(rng.choice(len(operands), size=config.num_prompts, replace=False))
        operands = [operands[i] for i in keep]
    records = []
    for index, digits in enumerate(operands):
        text = "<bos> " + " + ".join(map(str, digits)) + " ="
        answer = str((sum(digits) + config.offset) % config.modulus)
        records.append(PromptRecord(index, tuple(tokenizer.encode(text)), answer, text))
    return tokenizer, records
