"""Everything the trainer builds from configuration before the first step: task, policy config.

`build_task` builds the task (tokenizer, prompts, reward function, the policy's HF config) before
the model, so a bad data file or reward fails in seconds with a message naming the file, row and
field; ``python -m megatron_rl.train`` builds it once and hands it to the trainer. Given the
evaluation config, it also loads the held-out sets (`add_eval_sets`: ``--eval-prompt-data``, read
like ``--prompt-data`` with the evaluation's response length, or the built-in task's held-out
prompts) and the evaluation reward. Without ``--prompt-data`` the prompts, held-out split and
reward are those of the built-in ``--task`` (`megatron_rl.data.builtin_tasks`).

Prompt length: a prompt plus ``--max-response-length`` generated tokens must fit the model's
context (``max_position_embeddings``), so the prompt limit is ``max_position_embeddings -
max_response_length``, or ``--max-prompt-length`` when that is smaller. What happens to a longer
prompt is ``--prompt-too-long``: ``error`` (default), ``drop`` or ``truncate-left``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from megatron_rl.data import PromptSampler, load_prompt_dataset, load_tokenizer
from megatron_rl.data.builtin_tasks import builtin_task_spec, reward_name
from megatron_rl.data.dataset import PROMPT_TOO_LONG
from megatron_rl.model import preset_config
from megatron_rl.model.presets import PRESET_NAMES, load_hf_config
from megatron_rl.rewards import get_reward_fn
from megatron_rl.train.eval_config import EvalConfig, builtin_size
from megatron_rl.train.task_config import TaskConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    """A built task (`build_task`): what the trainer needs of the prompts, reward and policy."""

    tokenizer: object
    records: list  # the prompt records (`megatron_rl.data.PromptRecord`, immutable)
    reward_fn: Callable[[str, str], float]
    hf_config: object  # the policy's HF config (`load_policy_config`)
    checkpoint_dir: str | None  # the policy's weights; None: a preset, randomly initialised
    seed: int
    # held-out sets by name (`add_eval_sets`; empty without evaluation) and their reward
    eval_sets: dict[str, list] = field(default_factory=dict)
    # the teacher-forced sets (`--eval-exact-p-data`, megatron_rl/train/exact_p.py) by name
    exact_sets: dict[str, list] = field(default_factory=dict)
    eval_reward_fn: Callable[[str, str], float] | None = None
    # the built-in task's own rollout function (`BuiltinTaskSpec.rollout_function`), or None
    rollout_function: str | None = None

    def new_sampler(self) -> PromptSampler:
        """A prompt sampler at the start of epoch 0 over ``records``."""
        return PromptSampler(len(self.records), seed=self.seed)


def build_task(config: TaskConfig, evaluation: EvalConfig | None = None) -> Task:
    """Load the tokenizer, prompts and reward function, or raise ValueError saying what to fix;
    with ``evaluation`` (and evaluation on), the held-out sets too (`add_eval_sets`)."""
    if config.prompt_too_long not in PROMPT_TOO_LONG:
        raise ValueError(
            f"--prompt-too-long {config.prompt_too_long!r}: choose one of "
            f"{', '.join(PROMPT_TOO_LONG)}"
        )
    reward = reward_name(config.task, config.reward)
    reward_fn = get_reward_fn(reward)  # cheap, so first
    _check_reward_dependencies(reward)
    builtin = config.prompt_data is None
    if builtin:
        _check_response_room(config.task, config.max_response_length, "--max-response-length")
        tokenizer, records = builtin_task_spec(config.task).build(config.seed)
    else:
        tokenizer, records = _prompt_data_tokenizer(config), []
    hf_config, checkpoint_dir = load_policy_config(config, tokenizer)
    limit, source = prompt_length_limit(config, hf_config)
    if builtin:
        longest = max(len(r.prompt_ids) for r in records)
        if longest > limit:
            raise ValueError(
                f"the built-in task {config.task}'s prompts have {longest} tokens > {limit} "
                f"({source}); "
                "lower --max-response-length or raise --max-prompt-length"
            )
    else:
        records = load_prompt_dataset(
            config.prompt_data,
            tokenizer,
            prompt_key=config.prompt_key,
            answer_key=config.answer_key,
            max_prompt_length=limit,
            prompt_too_long=config.prompt_too_long,
            limit_source=source,
        )
    task = Task(
        tokenizer=tokenizer,
        records=records,
        reward_fn=reward_fn,
        hf_config=hf_config,
        checkpoint_dir=checkpoint_dir,
        seed=config.seed,
        rollout_function=builtin_task_spec(config.task).rollout_function if builtin else None,
    )
    if evaluation is not None and evaluation.enabled:
        task = add_eval_sets(task, config, evaluation)
    return task


def add_eval_sets(task: Task, config: TaskConfig, evaluation: EvalConfig) -> Task:
    """``task`` with the held-out sets of ``evaluation`` and its reward function.

    A file set is read like ``--prompt-data`` (same tokenizer, ``--prompt-key`` /
    ``--answer-key``, chat template, ``--prompt-too-long``), its prompts limited to the model's
    context minus ``--eval-max-response-length``; ``builtin`` (``builtin:K``: of another size) is
    the built-in task's held-out split of ``--task`` (`megatron_rl.data.builtin_tasks`). The
    sampled sets (``--eval-prompt-data``) go to ``eval_sets``, the teacher-forced ones
    (``--eval-exact-p-data``) to ``exact_sets``. An error names the flag and set.
    """
    reward = reward_name(config.task, evaluation.reward)
    try:
        reward_fn = get_reward_fn(reward)
        _check_reward_dependencies(reward)
    except ValueError as err:
        flag = "--eval-reward" if evaluation.eval_reward is not None else "--reward"
        raise ValueError(f"{flag} {reward} (evaluation): {err}") from None
    eval_task = replace(config, max_response_length=evaluation.max_response_length)
    flag = "--eval-max-response-length"
    if evaluation.eval_max_response_length is None:
        flag = "--max-response-length (evaluation)"
    limit, source = prompt_length_limit(eval_task, task.hf_config, flag)

    def load(flag_name: str, name: str, path: str) -> list:
        where = f"{flag_name} {name}={path}"
        size = builtin_size(path)
        if size == -1:
            try:
                return load_prompt_dataset(
                    path,
                    task.tokenizer,
                    prompt_key=config.prompt_key,
                    answer_key=config.answer_key,
                    max_prompt_length=limit,
                    prompt_too_long=config.prompt_too_long,
                    limit_source=source,
                )
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
        _check_response_room(config.task, evaluation.max_response_length, flag)
        try:
            records = builtin_task_spec(config.task).heldout_records(config.seed, size)
        except ValueError as err:
            raise ValueError(f"{where} (--task {config.task}): {err}") from None
        longest = max(len(r.prompt_ids) for r in records)
        if longest > limit:
            raise ValueError(
                f"{where}: the built-in held-out prompts have {longest} tokens > {limit} "
                f"({source}); lower --eval-max-response-length or raise --max-prompt-length"
            )
        return records

    sets = {name: load("--eval-prompt-data", name, path) for name, path in evaluation.sets}
    exact = {name: load("--eval-exact-p-data", name, path) for name, path in evaluation.exact_sets}
    return replace(task, eval_sets=sets, exact_sets=exact, eval_reward_fn=reward_fn)


def _check_response_room(task: str, max_response_length: int, flag: str) -> None:
    """ValueError unless ``max_response_length`` holds every correct response of ``task``."""
    needed = builtin_task_spec(task).min_response_tokens
    if max_response_length < needed:
        raise ValueError(
            f"{flag} {max_response_length}: the built-in task {task}'s correct responses take up "
            f"to {needed} tokens (<eos> included), so longer ones could never be right; pass "
            f"{flag.split()[0]} {needed} or more"
        )


def _prompt_data_tokenizer(config: TaskConfig):
    """The tokenizer of ``--prompt-data``: ``--tokenizer`` or the ``--model`` folder."""
    tokenizer_dir = config.tokenizer or config.model
    if not os.path.isdir(tokenizer_dir):
        raise ValueError(
            f"--prompt-data needs a tokenizer: pass --tokenizer (a HF tokenizer folder) or a "
            f"checkpoint folder as --model; got {tokenizer_dir!r}"
        )
    return load_tokenizer(tokenizer_dir)


def prompt_length_limit(
    config: TaskConfig, hf_config, response_flag: str = "--max-response-length"
) -> tuple[int, str]:
    """``(longest allowed prompt in tokens, where that number comes from)``.

    ``max_position_embeddings - max_response_length``, or ``--max-prompt-length`` when smaller;
    ``response_flag`` names the flag the response length comes from, for messages.
    """
    context = int(hf_config.max_position_embeddings)
    fits = context - config.max_response_length
    if fits < 1:
        raise ValueError(
            f"{response_flag} {config.max_response_length} leaves no room for a prompt in "
            f"--model {config.model}'s context of {context} tokens (max_position_embeddings); "
            f"use a {response_flag} below {context}"
        )
    source = f"--model context {context} - {response_flag} {config.max_response_length}"
    if config.max_prompt_length is None:
        return fits, source
    if config.max_prompt_length > fits:
        logger.warning(
            "--max-prompt-length %d does not fit %s = %d tokens: prompts are limited to %d",
            config.max_prompt_length,
            source,
            fits,
            fits,
        )
        return fits, source
    return config.max_prompt_length, "--max-prompt-length"


def _check_reward_dependencies(reward: str) -> None:
    if reward == "math":
        try:
            import math_verify  # noqa: F401 (imported by the reward at its first call)
        except ImportError as err:
            raise ValueError(
                "--reward math needs the math-verify package: `pip install math-verify`"
            ) from err


def load_policy_config(config: TaskConfig, tokenizer):
    """``(hf_config, checkpoint folder or None)`` for ``--model`` (a preset or a folder)."""
    if config.model in PRESET_NAMES:
        overrides = {}
        if config.model.startswith("tiny"):
            # size the toy model's vocabulary to the tokenizer, divisible by tensor parallelism
            multiple = 8 * config.tensor_parallel
            overrides["vocab_size"] = -(-tokenizer.vocab_size // multiple) * multiple
        hf_config, folder = preset_config(config.model, **overrides), None
    elif os.path.isdir(config.model):
        hf_config, folder = load_hf_config(config.model), config.model
    else:
        raise ValueError(
            f"--model {config.model!r} is neither a preset ({', '.join(PRESET_NAMES)}) nor a "
            "checkpoint folder"
        )
    hf_config._attn_implementation = "eager"
    if tokenizer.vocab_size > hf_config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but --model {config.model} only "
            f"{hf_config.vocab_size} embeddings; use a model that matches the tokenizer"
        )
    return hf_config, folder
