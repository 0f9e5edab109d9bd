"""Everything the trainer builds from configuration before the first step: task, policy config.

`check_task` builds the task (tokenizer, prompts, reward function) before the model, so a bad data
file or reward fails in seconds with a message naming the file, row and field; `build_task` keeps
the last task it built, so the trainer's own `build_task` call does not load the dataset again.

Prompt length: a prompt plus ``--max-response-length`` generated tokens must fit the model's
context (``max_position_embeddings``), so the prompt limit is ``max_position_embeddings -
max_response_length``, or ``--max-prompt-length`` when that is smaller. What happens to a longer
prompt is ``--prompt-too-long``: ``error`` (default), ``drop`` or ``truncate-left``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from megatron_rl.data import (
    BuiltinTaskConfig,
    PromptSampler,
    builtin_task,
    load_prompt_dataset,
    load_tokenizer,
)
from megatron_rl.data.dataset import PROMPT_TOO_LONG
from megatron_rl.model import preset_config
from megatron_rl.model.presets import PRESET_NAMES, load_hf_config
from megatron_rl.rewards import get_reward_fn

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskConfig:
    """The policy checkpoint, prompts and reward (built by `TrainConfig.task_config`)."""

    model: str = "tiny"  # a preset name or a HF Qwen3-MoE checkpoint folder
    prompt_data: str | None = None  # None: the built-in task
    tokenizer: str | None = None  # default: the --model folder
    max_prompt_length: int | None = None
    max_response_length: int = 4  # a prompt gets the model's context minus this
    prompt_too_long: str = "error"  # or "drop", "truncate-left"
    reward: str = "builtin"
    seed: int = 1234
    tensor_parallel: int = 1  # the toy presets' vocabulary is padded to a multiple of it


_task_cache: dict = {}  # the last (config, file stamp) -> (tokenizer, records, reward_fn)


def check_task(config: TaskConfig) -> None:
    """Build the task (tokenizer, prompts, reward function) or raise ValueError saying what to fix.

    Called before the model is built; the result is kept for the trainer's `build_task`.
    """
    build_task(config)


def build_task(config: TaskConfig):
    """``(tokenizer, prompt records, reward function, prompt sampler)``.

    The dataset is loaded once per process for a given config and unchanged file (the last one
    is kept); each call gets a fresh sampler and its own list of the (immutable) records.
    """
    key = (config, _file_stamp(config.prompt_data))
    if key not in _task_cache:
        _task_cache.clear()
        _task_cache[key] = _load_task(config)
    tokenizer, records, reward_fn = _task_cache[key]
    return tokenizer, list(records), reward_fn, PromptSampler(len(records), seed=config.seed)


def _file_stamp(path: str | None) -> tuple[int, int] | None:
    try:
        stat = os.stat(path) if path is not None else None
    except OSError:
        return None
    return None if stat is None else (stat.st_mtime_ns, stat.st_size)


def _load_task(config: TaskConfig):
    if config.prompt_too_long not in PROMPT_TOO_LONG:
        raise ValueError(
            f"--prompt-too-long {config.prompt_too_long!r}: choose one of "
            f"{', '.join(PROMPT_TOO_LONG)}"
        )
    reward_fn = get_reward_fn(config.reward)  # cheap, so first
    _check_reward_dependencies(config.reward)
    if config.prompt_data is None:
        tokenizer, records = builtin_task(BuiltinTaskConfig(seed=config.seed))
        hf_config, _ = load_policy_config(config, tokenizer)
        limit, source = prompt_length_limit(config, hf_config)
        longest = max(len(r.prompt_ids) for r in records)
        if longest > limit:
            raise ValueError(
                f"the built-in task's prompts have {longest} tokens > {limit} ({source}); "
                "lower --max-response-length or raise --max-prompt-length"
            )
        return tokenizer, records, reward_fn
    tokenizer_dir = config.tokenizer or config.model
    if not os.path.isdir(tokenizer_dir):
        raise ValueError(
            f"--prompt-data needs a tokenizer: pass --tokenizer (a HF tokenizer folder) or a "
            f"checkpoint folder as --model; got {tokenizer_dir!r}"
        )
    tokenizer = load_tokenizer(tokenizer_dir)
    hf_config, _ = load_policy_config(config, tokenizer)
    limit, source = prompt_length_limit(config, hf_config)
    records = load_prompt_dataset(
        config.prompt_data,
        tokenizer,
        max_prompt_length=limit,
        prompt_too_long=config.prompt_too_long,
        limit_source=source,
    )
    return tokenizer, records, reward_fn


def prompt_length_limit(config: TaskConfig, hf_config) -> tuple[int, str]:
    """``(longest allowed prompt in tokens, where that number comes from)``.

    ``max_position_embeddings - max_response_length``, or ``--max-prompt-length`` when smaller.
    """
    context = int(hf_config.max_position_embeddings)
    fits = context - config.max_response_length
    if fits < 1:
        raise ValueError(
            f"--max-response-length {config.max_response_length} leaves no room for a prompt in "
            f"--model {config.model}'s context of {context} tokens (max_position_embeddings); "
            f"use a --max-response-length below {context}"
        )
    source = f"--model context {context} - --max-response-length {config.max_response_length}"
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
