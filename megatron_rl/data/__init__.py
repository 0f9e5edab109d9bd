"""Prompt data for RL: tokenizers, dataset loading, the prompt sampler and the built-in task."""

from megatron_rl.data.builtin_task import BuiltinTaskConfig, builtin_task, uniform_policy_accuracy
from megatron_rl.data.builtin_tokenizer import BuiltinTokenizer
from megatron_rl.data.dataset import ANSWER_KEYS, load_prompt_dataset
from megatron_rl.data.records import PromptRecord
from megatron_rl.data.sampler import PromptSampler
from megatron_rl.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ANSWER_KEYS",
    "BuiltinTaskConfig",
    "BuiltinTokenizer",
    "HFTokenizer",
    "PromptRecord",
    "PromptSampler",
    "Tokenizer",
    "builtin_task",
    "load_prompt_dataset",
    "load_tokenizer",
    "uniform_policy_accuracy",
]
