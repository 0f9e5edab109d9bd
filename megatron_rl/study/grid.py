"""The grid of a study: its arms (loss x replay x staleness x routing dtype x correction x
rollout dtype, or a recipe's arms), the model presets, and the trainer flags of each arm.

An arm's name is ``<loss>-<replay>-N<n>[-<routing dtype>][-<correction>][-<rollout dtype>]``
(a recipe's: ``<arm>-N<n>[...]``), the optional parts only when not the default. ``megatron-rl
study`` (megatron_rl/cli/study.py) runs each arm over seeds.
"""

from __future__ import annotations

import dataclasses
import itertools

from megatron_rl.recipes import get_recipe

LONG_TASK = ("--task", "addition-trace", "--max-response-length", "128", "--lr", "1e-4")
PRESETS = {
    "none": {"model": None, "rollout_dtype": "float32"},
    "mismatch": {"model": "tiny-mismatch", "rollout_dtype": "bfloat16"},
    "mismatch-fp8": {"model": "tiny-mismatch", "rollout_dtype": "float8"},
    "mismatch-noise": {
        "model": "tiny-mismatch",
        "rollout_dtype": "bfloat16",
        "flags": ("--rollout-router-noise", "0.05"),
    },
    # the long-response study (docs/study.md), from `--warm-start DIR`: bf16 serving alone, the
    # mismatch measured on the real SGLang server; and router noise 0.05 on top, the stress arm
    "long": {
        "model": "warm-start",
        "rollout_dtype": "bfloat16",
        "flags": LONG_TASK,
    },
    "long-stress": {
        "model": "warm-start",
        "rollout_dtype": "bfloat16",
        "flags": (*LONG_TASK, "--rollout-router-noise", "0.05"),
    },
}  # fmt: skip
REPLAY_FLAGS = {
    "off": ["--routing-replay", "off"],
    "r2": ["--routing-replay", "r2"],
    "r3": ["--routing-replay", "r3"],
    "r3rec": ["--routing-replay", "r3", "--routing-record-only"],
}
ROUTING_DTYPES = ("auto", "uint8", "int16", "int32", "packed")
CORRECTIONS = ("none", "tis-token", "tis-seq", "mis-token", "mis-seq", "icepop")
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float8": "fp8"}


@dataclasses.dataclass(frozen=True)
class Arm:
    loss: str
    replay: str
    staleness: int
    routing_dtype: str = "auto"
    correction: str = "none"
    rollout_dtype: str = "float32"
    default_rollout_dtype: str = "float32"
    recipe: str | None = None  # ``loss`` is then an arm of this recipe (its objective)

    @property
    def name(self) -> str:
        parts = [self.loss, f"N{self.staleness}"] if self.recipe else []
        parts = parts or [self.loss, self.replay, f"N{self.staleness}"]
        if self.routing_dtype != "auto":
            parts.append(self.routing_dtype)
        if self.correction != "none":
            parts.append(self.correction)
        if self.rollout_dtype != self.default_rollout_dtype:
            parts.append(DTYPE_SHORT[self.rollout_dtype])
        return "-".join(parts)


def build_grid(args) -> tuple[list[Arm], list[str]]:
    """The arms of the grid and a note per skipped combination."""
    default_dtype = PRESETS[args.preset]["rollout_dtype"]
    arms, skipped = [], []
    losses, replays = args.losses, args.replay
    if args.recipe:  # the recipe's arms carry their own loss and replay
        losses, replays = args.losses or list(get_recipe(args.recipe).arms), ["off"]
    for loss, replay, n, codec, correction, dtype in itertools.product(
        losses,
        replays,
        args.staleness,
        args.routing_dtype,
        args.rollout_correction,
        args.rollout_dtype or [default_dtype],
    ):
        arm = Arm(loss, replay, n, codec, correction, dtype, default_dtype, args.recipe)
        if codec != "auto" and replay == "off":
            skipped.append(f"{arm.name}: --routing-dtype only matters with routes (r2/r3/r3rec)")
        elif correction != "none" and dtype == "float32":
            skipped.append(
                f"{arm.name}: --rollout-correction with float32 rollouts (engine and trainer "
                "log-probs agree to ~1e-7, the weights are 1)"
            )
        else:
            arms.append(arm)
    return arms, skipped


def arm_flags(arm: Arm, args) -> list[str]:
    """Trainer flags of one arm (seed, run dir and extra flags excluded)."""
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if samples % arm.staleness:
        raise ValueError(
            f"--staleness {arm.staleness} does not divide --rollout-batch-size x "
            f"--n-samples-per-prompt = {samples} samples per rollout; choose N among its divisors"
        )
    global_batch = samples // arm.staleness
    micro = min(args.micro_batch_size, global_batch)
    while global_batch % micro:
        micro -= 1
    model = PRESETS[args.preset]["model"]
    if model == "warm-start":
        model = str(args.warm_start)
    preset_flags = PRESETS[args.preset].get("flags", ())
    objective = ["--loss", arm.loss, *REPLAY_FLAGS[arm.replay]]
    if arm.recipe:  # the paper's protocol and this arm's objective, at the study's scale
        objective = get_recipe(arm.recipe).flags(arm.loss)
    return [
        *(["--model", model] if model else []),
        *preset_flags,
        *objective,
        "--routing-dtype", arm.routing_dtype, "--rollout-correction", arm.correction,
        "--rollout-dtype", arm.rollout_dtype,
        "--train-iters", str(args.train_iters),
        "--rollout-batch-size", str(args.rollout_batch_size),
        "--n-samples-per-prompt", str(args.n_samples_per_prompt),
        "--global-batch-size", str(global_batch), "--micro-batch-size", str(micro),
    ]  # fmt: skip
