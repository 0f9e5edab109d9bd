"""One prompt of an RL dataset: token ids, the reference answer, and where it came from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """A tokenised prompt with its reference answer.

    Attributes:
        index: position of the record in the list ``load_prompt_dataset`` (or ``builtin_task``)
            returned, so ``records[r.index] is r``; ``PromptSampler`` hands out these indices.
        prompt_ids: the prompt's token ids, chat template (if any) and special tokens included;
            length ``P >= 1``.
        answer: the reference answer (ground truth) the reward function compares against.
        prompt_text: the text that was tokenised (after the chat template), for logging.
    """

    index: int
    prompt_ids: tuple[int, ...]
    answer: str
    prompt_text: str | None = None
