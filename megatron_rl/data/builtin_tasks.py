"""The built-in tasks by name (``--task``): an explicit allowlist.

=================  ===========================================  ==================  =============
name               what                                         reward ("builtin")  response
=================  ===========================================  ==================  =============
``successor``      the successor of a digit (`builtin_task`)    ``builtin``         1 digit
``addition-trace`` column-wise addition with written carries    ``addition-trace``  32-83 tokens
                   (`addition_trace`), digits 3..8
``calculator``     products of two digits with a calculator     its rollout's       8+ tokens
                   tool, multi-turn (`calculator_task`)
=================  ===========================================  ==================  =============

``calculator`` names its own rollout function (`BuiltinTaskSpec.rollout_function`, used while
``--rollout-function`` keeps its default): the multi-turn tool rollout, which also gives each
episode its reward; it has no held-out split.

Each has a fixed held-out split (``--eval-prompt-data builtin``): ``successor``'s is
`builtin_heldout` (``<bos> 0 + d =``), ``addition-trace``'s is ``addition-trace-heldout``
(`addition_trace_heldout`, pairs excluded from training by a fixed rule). ``--reward builtin``
means "the built-in task's own reward" (`reward_name`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl.data.addition_trace import (
    AdditionTraceConfig,
    addition_trace_heldout,
    addition_trace_task,
)
from megatron_rl.data.builtin_task import BuiltinTaskConfig, builtin_heldout, builtin_task
from megatron_rl.data.calculator_task import (
    MIN_RESPONSE_TOKENS,
    CalculatorConfig,
    calculator_heldout,
    calculator_task,
)
from megatron_rl.data.records import PromptRecord

DEFAULT_TASK = "successor"


@dataclass(frozen=True, slots=True)
class BuiltinTaskSpec:
    """One built-in task: its training records, held-out records and reward.

    Attributes:
        build: ``seed -> (tokenizer, training records)``.
        heldout: ``seed -> held-out records`` (the same tokenizer).
        reward: the reward name (`megatron_rl.rewards.get_reward_fn`) that scores it.
        min_response_tokens: the shortest ``--max-response-length`` whose responses can all be
            correct (``<eos>`` included); 1 where the reward reads only the first symbol.
        rollout_function: the task's own ``module:function`` rollout
            (`megatron_rl.train.rollout_function`), or None for ``--rollout-function``'s.
        sized_heldout: ``(seed, K) -> held-out records`` of another size (``builtin:K``), or
            None when the task's held-out set has one size.
    """

    build: Callable[[int], tuple[object, list[PromptRecord]]]
    heldout: Callable[[int], list[PromptRecord]]
    reward: str
    min_response_tokens: int
    rollout_function: str | None = None
    sized_heldout: Callable[[int, int], list[PromptRecord]] | None = None

    def heldout_records(self, seed: int, size: int | None) -> list[PromptRecord]:
        """The held-out records, of the default size (``size`` None) or ``builtin:size``."""
        if size is None:
            return self.heldout(seed)
        if self.sized_heldout is None:
            raise ValueError(f"builtin:{size}: this task's held-out set has one size; use builtin")
        return self.sized_heldout(seed, size)


_TASKS: dict[str, BuiltinTaskSpec] = {
    "successor": BuiltinTaskSpec(
        build=lambda seed: builtin_task(BuiltinTaskConfig(seed=seed)),
        heldout=lambda seed: builtin_heldout(BuiltinTaskConfig(seed=seed)),
        reward="builtin",
        min_response_tokens=1,
    ),
    "addition-trace": BuiltinTaskSpec(
        build=lambda seed: addition_trace_task(AdditionTraceConfig(seed=seed)),
        heldout=lambda seed: addition_trace_heldout(AdditionTraceConfig(seed=seed)),
        reward="addition-trace",
        min_response_tokens=AdditionTraceConfig().longest_response_tokens,
        sized_heldout=lambda seed, k: addition_trace_heldout(AdditionTraceConfig(seed=seed), k),
    ),
    "calculator": BuiltinTaskSpec(
        build=lambda seed: calculator_task(CalculatorConfig(seed=seed)),
        heldout=lambda seed: calculator_heldout(CalculatorConfig(seed=seed)),
        reward="builtin",  # unused: the rollout function rewards each episode
        min_response_tokens=MIN_RESPONSE_TOKENS,
        rollout_function="megatron_rl.train.tool_rollout:calculator_rollout",
    ),
}

BUILTIN_TASK_NAMES = tuple(_TASKS)


def builtin_task_spec(name: str) -> BuiltinTaskSpec:
    """The spec of built-in task ``name``; ValueError naming the known ones otherwise."""
    if name not in _TASKS:
        raise ValueError(f"unknown built-in task {name!r}; known: {', '.join(_TASKS)}")
    return _TASKS[name]


def reward_name(task: str, reward: str) -> str:
    """The reward that scores built-in task ``task`` when ``--reward`` is ``reward``:
    ``"builtin"`` is the task's own reward, any other name is itself."""
    return builtin_task_spec(task).reward if reward == "builtin" else reward
