"""The built-in verifiable task: modular addition over digit tokens (`builtin_tokenizer`).

A prompt is ``<bos> a + b =`` (``num_operands`` digits ``< modulus``, joined by ``+``); the
reference answer is ``(a + b + offset) mod modulus`` as one digit. The default is the easiest
useful instance, "the successor of digit d" (one operand, offset 1, modulus 10: ``<bos> 3 =`` ->
``4``, 10 prompts); the answer is never a token of the prompt, so copying does not pay. The
policy should answer with the digit token, then ``<eos>``. The "builtin" reward
(`megatron_rl.rewards.score_builtin_response`) gives 1.0 when the first symbol of the decoded
response is the answer digit, else 0.0; what follows it is ignored, so a rollout of
``max_response_length`` 2 to 4 suffices. The default task uses all ten possible prompts;
`builtin_heldout` gives questions it never shows (``<bos> 0 + d =``, the same answers) for
evaluation.

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
    operands = _training_operands(config)
    return tokenizer, _records(tokenizer, operands, config)


HELDOUT_FORMS = ("zero-first", "zero-last")
"""Where `builtin_heldout` writes the extra zero operand: ``<bos> 0 + d =`` or ``<bos> d + 0 =``."""


def builtin_heldout(config: BuiltinTaskConfig, form: str = "zero-first") -> list[PromptRecord]:
    """Held-out prompts of the task ``config``: each training prompt with one more operand, 0.

    The sum, hence the answer, is unchanged (``<bos> 3 =`` and ``<bos> 3 + 0 =`` both answer
    ``4`` in the default task), but the prompt is one the training set never shows: two more
    tokens, the ``+`` the default task's prompts lack, and the digit at another position
    (``form="zero-first"``: ``<bos> 0 + 3 =``) or followed by ``+ 0`` (``"zero-last"``). So the
    set measures whether the policy learned "answer the successor of the digit it reads" beyond
    the exact training prompts, not memorised answers. Records are indexed ``0..`` in the order of
    the training prompts; the training set itself is unchanged.

    ``"zero-first"`` is the evaluation set (``--eval-prompt-data builtin``): after 80 steps of the
    main job it scored mean@8 0.33-0.42 over steps 40-80 for three seeds (training accuracy
    0.78-0.95), ``"zero-last"`` 0.18-0.36 (docs/trainer.md, "Evaluation").
    """
    if form not in HELDOUT_FORMS:
        raise ValueError(f"form={form!r}: choose one of {HELDOUT_FORMS}")
    if config.num_operands >= _MAX_OPERANDS:
        raise ValueError(
            f"num_operands={config.num_operands}: the held-out prompts add an operand, so the "
            f"task may have at most {_MAX_OPERANDS - 1}"
        )
    operands = [
        (0, *digits) if form == "zero-first" else (*digits, 0)
        for digits in _training_operands(config)
    ]
    return _records(BuiltinTokenizer(), operands, config)


def _training_operands(config: BuiltinTaskConfig) -> list[tuple[int, ...]]:
    """The operand tuples of the training prompts, in lexicographic order."""
    operands = list(itertools.product(range(config.modulus), repeat=config.num_operands))
    if config.num_prompts < len(operands):
        rng = np.random.default_rng(config.seed)
        keep = np.sort(rng.choice(len(operands), size=config.num_prompts, replace=False))
        operands = [operands[i] for i in keep]
    return operands


def _records(tokenizer, operands, config: BuiltinTaskConfig) -> list[PromptRecord]:
    """One record per operand tuple: ``<bos> d_1 + ... + d_k =`` -> ``(sum + offset) % modulus``."""
    records = []
    for index, digits in enumerate(operands):
        text = "<bos> " + " + ".join(map(str, digits)) + " ="
        answer = str((sum(digits) + config.offset) % config.modulus)
        records.append(PromptRecord(index, tuple(tokenizer.encode(text)), answer, text))
    return records
