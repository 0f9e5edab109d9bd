"""Everything the trainer builds from configuration before the first step: task, policy config."""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_rl.data import (
    BuiltinTaskConfig,
    PromptSampler,
    builtin_task,
    load_prompt_dataset,
    load_tokenizer,
)
from megatron_rl.model import preset_config
from megatron_rl.model.presets import PRESET_NAMES, load_hf_config
from megatron_rl.rewards import get_reward_fn


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskConfig:
    """The policy checkpoint, prompts and reward (built by `TrainConfig.task_config`)."""

    model: str = "tiny"  # a preset name or a HF Qwen3-MoE checkpoint folder
    prompt_data: str | None = None  # None: the built-in task
    tokenizer: str | None = None  # default: the --model folder
    max_prompt_length: int | None = None
    reward: str = "builtin"
    seed: int = 1234
    tensor_parallel: int = 1  # the toy presets' vocabulary is padded to a multiple of it


def build_task(config: TaskConfig):
    """``(tokenizer, prompt records, reward function, prompt sampler)``."""
    if config.prompt_data is None:
        tokenizer, records = builtin_task(BuiltinTaskConfig(seed=config.seed))
    else:
        tokenizer_dir = config.tokenizer or config.model
        if not os.path.isdir(tokenizer_dir):
            raise ValueError(
                f"--prompt-data needs a tokenizer: pass --tokenizer (a HF tokenizer folder) or a "
                f"checkpoint folder as --model; got {tokenizer_dir!r}"
            )
        tokenizer = load_tokenizer(tokenizer_dir)
        records = load_prompt_dataset(
            config.prompt_data, tokenizer, max_prompt_length=config.max_prompt_length
        )
    sampler = PromptSampler(len(records), seed=config.seed)
    return tokenizer, records, get_reward_fn(config.reward), sampler


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
