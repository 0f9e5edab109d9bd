"""The task's configuration: the policy checkpoint, its prompts and its reward."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.data.builtin_tasks import BUILTIN_TASK_NAMES, DEFAULT_TASK
from megatron_rl.data.dataset import PROMPT_TOO_LONG
from megatron_rl.flags import bad_value, check_choice, derived, option


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskConfig:
    """Policy, prompts and reward: checked before the model is built; an error is one line naming
    the file, row and field (set MEGATRON_RL_DEBUG=1 for the traceback)."""

    model: str = option(
        "tiny", help="a preset (tiny, tiny-dense-tied, qwen3-30b-a3b, ...) or HF checkpoint"
    )
    prompt_data: str | None = option(None, help="JSONL/Parquet prompts; default: the built-in task")
    task: str = option(
        DEFAULT_TASK,
        choices=BUILTIN_TASK_NAMES,
        help="the built-in task without --prompt-data: successor (the successor of a digit; "
        "default) or addition-trace (column-wise addition written out with its carries, "
        "responses of 32-83 tokens: pass --max-response-length 83 or more) or calculator "
        "(multi-turn products with a calculator tool: pass --max-response-length 8 or more); "
        "megatron_rl/data/builtin_tasks.py",
    )
    prompt_key: str = option(
        "prompt",
        help="--prompt-data field holding the prompt (a string or chat messages); a dotted path "
        "reaches a nested field (slime's --input-key)",
    )
    answer_key: str | None = option(
        None,
        help="--prompt-data field holding the reference answer passed to the reward (dotted "
        "path; slime's --label-key); default: the first of answer, reward_model.ground_truth, "
        "solution that a row has",
    )
    tokenizer: str | None = option(None, help="HF tokenizer folder (default: the --model folder)")
    max_prompt_length: int | None = option(
        None,
        help="longest prompt in tokens (chat template included); default and upper bound: the "
        "model's max_position_embeddings - --max-response-length",
    )
    prompt_too_long: str = option(
        "error",
        choices=PROMPT_TOO_LONG,
        help="a prompt over that limit: error (default; names the row), drop the row, or "
        "truncate-left (keep its last tokens)",
    )
    reward: str = option(
        "builtin", help="builtin (the built-in --task's own reward), math, or module:function"
    )
    # a prompt gets the model's context minus the longest response
    max_response_length: int = derived(4, source="rollout.max_response_length")
    seed: int = derived(1234, source="parallel.seed")  # the prompt sampler's seed
    # the toy presets' vocabulary is padded to a multiple of it
    tensor_parallel: int = derived(1, source="parallel.tensor_parallel")

    def __post_init__(self) -> None:
        check_choice(self, "prompt_too_long", PROMPT_TOO_LONG)
        check_choice(self, "task", BUILTIN_TASK_NAMES)
        if self.prompt_data is not None and self.task != DEFAULT_TASK:
            raise bad_value(
                self, "task", "names a built-in task, which --prompt-data replaces: drop one"
            )
        for name in ("prompt_key", "answer_key"):
            key = getattr(self, name)
            if key is not None and (not key.strip() or "" in key.split(".")):
                raise bad_value(self, name, "must name a field, e.g. 'answer' or 'extra.answer'")
        if self.prompt_data is None and (self.prompt_key != "prompt" or self.answer_key):
            raise ValueError(
                "--prompt-key / --answer-key name fields of --prompt-data rows; the built-in task "
                "has none: pass --prompt-data or drop them"
            )
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise bad_value(self, "max_prompt_length", "must be >= 1")
