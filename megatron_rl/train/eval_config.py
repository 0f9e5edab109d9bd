"""Evaluation during training: which held-out prompts, how often, and how they are sampled.

``--eval-interval N`` evaluates after every N-th step (``--eval-before-train`` also before the
first step of a fresh run); each set of ``--eval-prompt-data`` is generated with the current
weights, ``--n-samples-per-eval-prompt`` samples per prompt, and scored with ``--eval-reward``
(default: the training ``--reward``). Sampling options left at None take the training rollout's
value. What runs and what is logged: `megatron_rl.train.evaluation`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, fields

from megatron_rl.flags import bad_value, derived, option

BUILTIN_EVAL_SET = "builtin"
"""``--eval-prompt-data builtin``: the held-out prompts of the built-in ``--task``
(`megatron_rl.data.builtin_tasks`: ``successor``'s `builtin_heldout`, ``addition-trace``'s fixed
set ``addition-trace-heldout``). ``builtin:K`` sizes it where the task allows (``addition-trace``:
K prompts per digit count, the default 4; the set named ``builtin-K`` unless NAME= is given)."""
_BUILTIN_SIZED = re.compile(r"builtin:([1-9][0-9]*)")

_NAME = re.compile(r"[A-Za-z0-9_.+-]+")  # a set name: one metric-key component, no '/' or '='


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Evaluation on held-out prompts every --eval-interval steps (off by default)."""

    eval_interval: int = option(
        0, help="evaluate the held-out sets after every this many steps (0: never; default)"
    )
    eval_prompt_data: tuple[str, ...] = option(
        (),
        help="a held-out set: NAME=PATH or PATH (named after the file stem; JSONL/Parquet, read "
        "like --prompt-data) or builtin (the built-in task's held-out prompts); repeat for "
        "several sets; default with the built-in task: builtin",
    )
    eval_exact_p_data: tuple[str, ...] = option(
        (),
        help="a held-out set scored by teacher forcing, not sampling: eval/<set>/exact_p, the "
        "mean probability that the policy writes each prompt's answer (the one correct "
        "response) and <eos> (megatron_rl/train/exact_p.py); NAME=PATH, PATH or builtin[:K]; "
        "repeat for several sets. For tasks with one correct response per prompt (--task "
        "addition-trace). Given alone, no set is sampled unless --eval-prompt-data is given too",
    )
    eval_sampled_interval: int | None = option(
        None,
        help="sample the --eval-prompt-data sets only after every this many steps (a multiple "
        "of --eval-interval; --eval-before-train samples at step 0 too); the teacher-forced "
        "sets are scored at every evaluation; default: sample at every evaluation",
    )
    eval_before_train: bool = option(
        False, help="also evaluate the initial weights before the first step (fresh runs only)"
    )
    n_samples_per_eval_prompt: int = option(8, help="samples per held-out prompt (n of mean@n)")
    eval_temperature: float | None = option(
        None, help="sampling temperature of evaluation (0: greedy); default: --temperature"
    )
    eval_top_p: float | None = option(None, help="nucleus mass of evaluation; default: --top-p")
    eval_top_k: int | None = option(None, help="top-k of evaluation (-1: none); default: --top-k")
    eval_max_response_length: int | None = option(
        None, help="longest evaluation response in tokens; default: --max-response-length"
    )
    eval_pass_k: int | None = option(
        None, help="k of pass@k, 1 <= k <= --n-samples-per-eval-prompt (default: that n)"
    )
    eval_reward: str | None = option(
        None, help="reward of evaluation (builtin, math, module:function); default: --reward"
    )
    # the training side, filled by TrainConfig (the defaults of the options left at None)
    train_temperature: float = derived(1.0, source="rollout.temperature")
    train_top_p: float = derived(1.0, source="rollout.top_p")
    train_top_k: int = derived(-1, source="rollout.top_k")
    train_max_response_length: int = derived(4, source="rollout.max_response_length")
    train_reward: str = derived("builtin", source="task.reward")
    builtin_task: bool = derived(True, source="task.prompt_data is None")
    seed: int = derived(1234, source="parallel.seed")  # evaluation seeds derive from it

    def __post_init__(self) -> None:
        for name in ("eval_prompt_data", "eval_exact_p_data"):
            if isinstance(getattr(self, name), str):  # from_flags(eval_prompt_data="x.jsonl")
                object.__setattr__(self, name, (getattr(self, name),))
        if isinstance(self.eval_interval, bool) or not (
            isinstance(self.eval_interval, int) and self.eval_interval >= 0
        ):
            raise bad_value(self, "eval_interval", "must be an integer >= 0 (0: no evaluation)")
        if not self.enabled:
            changed = [
                f.name
                for f in fields(self)
                if f.name in _SETTINGS and getattr(self, f.name) != f.default
            ]
            if changed:
                raise bad_value(
                    self,
                    changed[0],
                    "has no effect without evaluation: pass --eval-interval N (evaluate every N "
                    "steps) or --eval-before-train, or drop it",
                )
            return
        self._check_sampling()
        self._check_sets()
        interval = self.eval_sampled_interval
        if interval is not None and (
            isinstance(interval, bool)
            or not isinstance(interval, int)
            or interval < 1
            or (self.eval_interval and interval % self.eval_interval)
        ):
            raise bad_value(
                self,
                "eval_sampled_interval",
                f"must be a positive multiple of --eval-interval ({self.eval_interval}): the "
                "sampled sets are generated at some of the evaluations",
            )

    def _check_sampling(self) -> None:
        n = self.n_samples_per_eval_prompt
        if isinstance(n, bool) or not (isinstance(n, int) and n >= 1):
            raise bad_value(self, "n_samples_per_eval_prompt", "must be an integer >= 1")
        k = self.eval_pass_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n):
            raise bad_value(
                self,
                "eval_pass_k",
                f"must be an integer in [1, --n-samples-per-eval-prompt = {n}] (pass@k is "
                "estimated from the n samples of each prompt)",
            )
        t = self.eval_temperature
        if t is not None and not (isinstance(t, int | float) and math.isfinite(t) and t >= 0):
            raise bad_value(self, "eval_temperature", "must be >= 0 (0: greedy decoding)")
        p = self.eval_top_p
        if p is not None and not (isinstance(p, int | float) and 0 < p <= 1):
            raise bad_value(self, "eval_top_p", "must be in (0, 1] (1 keeps every token)")
        top_k = self.eval_top_k
        if top_k is not None and (
            isinstance(top_k, bool) or not isinstance(top_k, int) or top_k == 0 or top_k < -1
        ):
            raise bad_value(self, "eval_top_k", "must be -1 (no limit) or an integer >= 1")
        length = self.eval_max_response_length
        if length is not None and (
            isinstance(length, bool) or not isinstance(length, int) or length < 1
        ):
            raise bad_value(self, "eval_max_response_length", "must be an integer >= 1")
        if self.eval_reward is not None and not self.eval_reward.strip():
            raise bad_value(self, "eval_reward", "name a reward: builtin, math or module:function")

    def _check_sets(self) -> None:
        names: dict[str, str] = {}
        for field_name, spec in [
            *(("eval_prompt_data", s) for s in self.eval_prompt_data),
            *(("eval_exact_p_data", s) for s in self.eval_exact_p_data),
        ]:
            name, path = parse_eval_set(spec)
            if not _NAME.fullmatch(name):
                raise bad_value(
                    self,
                    field_name,
                    f"set name {name!r} (of {spec!r}): use letters, digits and _ . + - only (it "
                    "becomes part of the metric names eval/<name>/...); write NAME=PATH",
                )
            if name in names:
                raise bad_value(
                    self,
                    field_name,
                    f"two sets are named {name!r} ({names[name]!r} and {spec!r}); name them "
                    "apart with NAME=PATH",
                )
            names[name] = spec
            if not path:
                raise bad_value(self, field_name, f"{spec!r} names no file: NAME=PATH")
            if builtin_size(path) != -1 and not self.builtin_task:
                raise bad_value(
                    self,
                    field_name,
                    f"{spec!r}: the built-in held-out set needs the built-in task (its tokenizer "
                    "and answers); with --prompt-data give a held-out file of that data instead",
                )
        if not self.eval_prompt_data and not self.eval_exact_p_data and not self.builtin_task:
            raise ValueError(
                "--eval-interval / --eval-before-train with --prompt-data need held-out prompts: "
                "pass --eval-prompt-data NAME=PATH (a JSONL/Parquet file laid out like "
                "--prompt-data; repeat it for several sets)"
            )

    # ------------------------------------------------------------------ resolved values
    @property
    def enabled(self) -> bool:
        """Whether the run evaluates at all."""
        return self.eval_interval > 0 or self.eval_before_train

    @property
    def sets(self) -> tuple[tuple[str, str], ...]:
        """``((name, path or "builtin"), ...)`` in the order given; the built-in task's held-out
        set when none is given."""
        if not self.eval_prompt_data:
            if self.eval_exact_p_data or not self.builtin_task:
                return ()
            return ((BUILTIN_EVAL_SET, BUILTIN_EVAL_SET),)
        return tuple(parse_eval_set(spec) for spec in self.eval_prompt_data)

    @property
    def exact_sets(self) -> tuple[tuple[str, str], ...]:
        """``((name, path or "builtin[:K]"), ...)`` of ``--eval-exact-p-data``."""
        return tuple(parse_eval_set(spec) for spec in self.eval_exact_p_data)

    @property
    def temperature(self) -> float:
        return self.train_temperature if self.eval_temperature is None else self.eval_temperature

    @property
    def top_p(self) -> float:
        return self.train_top_p if self.eval_top_p is None else self.eval_top_p

    @property
    def top_k(self) -> int:
        return self.train_top_k if self.eval_top_k is None else self.eval_top_k

    @property
    def max_response_length(self) -> int:
        length = self.eval_max_response_length
        return self.train_max_response_length if length is None else length

    @property
    def pass_k(self) -> int:
        return self.n_samples_per_eval_prompt if self.eval_pass_k is None else self.eval_pass_k

    @property
    def reward(self) -> str:
        return self.train_reward if self.eval_reward is None else self.eval_reward

    def due(self, step: int) -> bool:
        """Whether the run evaluates after step ``step`` (a multiple of the interval)."""
        return self.eval_interval > 0 and step > 0 and step % self.eval_interval == 0

    def samples_at(self, step: int) -> bool:
        """Whether the evaluation at ``step`` generates the sampled sets (step 0 always)."""
        interval = self.eval_sampled_interval
        return step == 0 or interval is None or step % interval == 0


# the options that only matter when the run evaluates
_SETTINGS = (
    "eval_prompt_data",
    "eval_exact_p_data",
    "eval_sampled_interval",
    "n_samples_per_eval_prompt",
    "eval_temperature",
    "eval_top_p",
    "eval_top_k",
    "eval_max_response_length",
    "eval_pass_k",
    "eval_reward",
)


def parse_eval_set(spec: str) -> tuple[str, str]:
    """``(name, path)`` of one ``--eval-prompt-data`` value: ``NAME=PATH``, ``builtin``,
    ``builtin:K`` (named ``builtin-K``), or a path named after its file stem
    (``data/aime24.jsonl`` -> ``aime24``)."""
    name, sep, path = spec.partition("=")
    if sep and name and os.sep not in name and "/" not in name:
        return name, path
    if spec == BUILTIN_EVAL_SET:
        return BUILTIN_EVAL_SET, BUILTIN_EVAL_SET
    if sized := _BUILTIN_SIZED.fullmatch(spec):
        return f"{BUILTIN_EVAL_SET}-{sized.group(1)}", spec
    stem = os.path.basename(os.path.normpath(spec))
    for suffix in (".jsonl", ".json", ".parquet", ".pq"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    return stem, spec


def builtin_size(path: str) -> int | None:
    """What a set's path says of the built-in held-out set: -1 for a file, None for ``builtin``
    (the task's default size), ``K`` for ``builtin:K``."""
    if path == BUILTIN_EVAL_SET:
        return None
    sized = _BUILTIN_SIZED.fullmatch(path)
    return int(sized.group(1)) if sized else -1
