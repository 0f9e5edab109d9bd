"""The papers' protocols as named recipes: trainer flags per arm, with the table they come from.

A recipe is what a paper's comparison table fixes, split in three so that the same arms can run
at the paper's scale (the cluster launchers) and on the embedded model (`megatron-rl study`):

* ``arms``: per arm, the objective (loss, its clipping parameters, routing replay);
* ``protocol``: what every arm shares and what the embedded study keeps (sampling, evaluation,
  over-sampling, KL, warmup, gradient clipping);
* ``scale``: batch sizes, lengths, steps and learning rate of the paper's model (the launchers
  only; the tiny model keeps its own).

The evaluation sets themselves are files (``--eval-prompt-data NAME=PATH``), passed by the
launcher (``EVAL_DATA``). ``python -m megatron_rl.recipes RECIPE ARM`` prints an arm's flags, one
per line (``--scale`` adds the paper's scale, ``--staleness N`` its batch geometry at another
N); ``python -m megatron_rl.recipes --list`` lists them. Every value below cites its table;
where a paper is silent, the choice is said.

Outside a recipe, the launchers' KL coefficient defaults per loss (`default_kl_coef`;
``python -m megatron_rl.recipes --kl-default LOSS`` prints it for the launchers).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


@dataclasses.dataclass(frozen=True)
class Recipe:
    source: str
    arms: dict[str, tuple[str, ...]]
    protocol: tuple[str, ...]
    scale: tuple[str, ...]  # the paper's lengths, steps, learning rate (not the batch sizes)
    minibatch_samples: int  # samples per optimizer step at the paper's scale
    staleness: int  # the paper's N: optimizer steps per rollout
    samples_per_prompt: int = 8
    notes: str = ""

    def flags(self, arm: str, *, scale: bool = False, staleness: int | None = None) -> list[str]:
        """The trainer flags of ``arm``: protocol, then the arm, then (``scale``) the paper's
        scale with ``staleness`` N (default the paper's): N mini-batches of
        ``minibatch_samples`` per rollout."""
        if arm not in self.arms:
            raise ValueError(f"unknown arm {arm!r}; this recipe's arms: {', '.join(self.arms)}")
        flags = [*self.protocol, *self.arms[arm]]
        if scale:
            n = self.staleness if staleness is None else staleness
            prompts, rest = divmod(n * self.minibatch_samples, self.samples_per_prompt)
            if n < 1 or rest:
                raise ValueError(
                    f"staleness {n}: N x {self.minibatch_samples} samples must be a positive "
                    f"multiple of {self.samples_per_prompt} samples per prompt"
                )
            flags += [
                *self.scale,
                "--rollout-batch-size", str(prompts),
                "--global-batch-size", str(self.minibatch_samples),
            ]  # fmt: skip
        return flags


def _flags(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# EPIC (Li et al. 2026, arXiv 2610.29999), Table 2 ("Configurations of the main Qwen3-30B-A3B-Base
# experiments") and Sec. 9.2-9.3: the five baselines and EPIC with each method's clipping
# parameters, EPIC's calibration ablation (App. 10.4), and GRPO Clip-Higher with R2 / R3 routing
# replay (Sec. 9.5).
EPIC_PAPER = Recipe(
    source="EPIC, arXiv 2610.29999, Table 2 and Sec. 9.2-9.5",
    arms={
        "grpo": _flags("--loss grpo --clip-low 0.2 --clip-high 0.2"),
        "dapo": _flags("--loss dapo --clip-low 0.2 --clip-high 0.28"),
        "gspo": _flags("--loss gspo --clip-low 3e-4 --clip-high 4e-4"),
        "ctpo": _flags("--loss ctpo --clip-low 0.025 --clip-high 0.05"),
        "ripo": _flags("--loss ripo --delta-low 0.05 --delta-high 0.05"),
        "epic": _flags("--loss epic --delta-low 5e-4 --delta-high 2e-3"),
        # the calibration ablation (App. 10.4, Table 3)
        "epic-raw-prob": _flags(
            "--loss epic --delta-low 5e-4 --delta-high 2e-3 --variant raw-prob"
        ),
        "epic-cumulative-ratio": _flags(
            "--loss epic --delta-low 5e-4 --delta-high 2e-3 --variant cumulative-ratio"
        ),
        # GRPO Clip-Higher (DAPO's decoupled upper bound) with vanilla / rollout routing replay
        "grpo-r2": _flags("--loss grpo --clip-low 0.2 --clip-high 0.28 --routing-replay r2"),
        "grpo-r3": _flags("--loss grpo --clip-low 0.2 --clip-high 0.28 --routing-replay r3"),
    },
    protocol=_flags(
        "--temperature 1.0 --top-p 1.0 --n-samples-per-prompt 8 "
        "--dynamic-sampling --over-sampling-ratio 0.1 "
        "--eval-interval 5 --n-samples-per-eval-prompt 8 --eval-temperature 1.0 --eval-top-p 0.7 "
        "--kl-coef 1e-3 --lr-warmup-iters 10 --clip-grad 1.0"
    ),
    scale=_flags(
        "--max-prompt-length 2048 --max-response-length 16384 --lr 1e-6 --train-iters 300 "
        "--reward math"
    ),
    # 64 prompts x 8 per rollout, mini-batches of 8 prompts: 8 updates of 64 samples
    minibatch_samples=64,
    staleness=8,
    notes=(
        "Evaluation: AIME 2024, AIME 2025, AMC 2023 (deduplicated), HMMT Feb 2025, mean@8 and "
        "their equal-weight average (pass EVAL_DATA). The paper lists the over-sampling ratio "
        "without naming its filter: here it over-draws for DAPO-style dynamic sampling (groups "
        "of equal rewards dropped and refilled). Aggregation is each loss's default (the table "
        "is silent)."
    ),
)

# VESPO (arXiv 2602.10693), Sec. 4.1 and App. D: (c1, c2) = (2, 3) for A > 0 and (3, 2) for
# A < 0; baselines with their official hyperparameters; mini-batch 256 samples, staleness
# N = rollout / mini-batch = 8 (the launcher's STALENESS varies it, 4..64).
VESPO_PAPER = Recipe(
    source="VESPO, arXiv 2602.10693, Sec. 4.1 and App. D",
    arms={
        "vespo": _flags("--loss vespo --c1-pos 2.0 --c2-pos 3.0 --c1-neg 3.0 --c2-neg 2.0"),
        "grpo": _flags("--loss grpo --clip-low 0.2 --clip-high 0.28"),
        "gspo": _flags("--loss gspo --clip-low 3e-4 --clip-high 4e-4"),
        "sapo": _flags("--loss sapo --tau-pos 1.0 --tau-neg 1.05"),
        "topr": _flags("--loss topr"),
        "cispo": _flags("--loss cispo"),
    },
    protocol=_flags(
        "--temperature 1.0 --top-p 1.0 --n-samples-per-prompt 8 --kl-coef 0 "
        "--eval-interval 20 --n-samples-per-eval-prompt 16 --eval-temperature 1.0 --eval-top-p 1.0"
    ),
    scale=_flags("--max-response-length 16384 --lr 1e-6 --train-iters 1500 --reward math"),
    # N = 8: 256 prompts x 8 = 2048 samples per rollout, 8 updates of 256 samples
    minibatch_samples=256,
    staleness=8,
    notes=(
        "The paper reports avg@32 (AIME), avg@16 (AMC) and avg@4 (MATH-500); one sample count "
        "serves every set here (16). Its evaluation interval and learning rate are not given: "
        "20 steps and 1e-6 are this recipe's choices. 1,500 steps as the paper's run length."
    ),
)

# The study of docs/study.md: which of routing replay, VESPO and EPIC holds up under staleness and
# mismatch. EPIC's arms (Table 2, its calibration ablation, GRPO Clip-Higher with R2 / R3), VESPO
# with its paper's (c1, c2), and the control that records R3 routes without replaying them (it
# measures the mismatch of an unreplayed run), all under EPIC's shared protocol, evaluated every
# 10 steps.
STUDY = dataclasses.replace(
    EPIC_PAPER,
    source="docs/study.md: EPIC Table 2 / Sec. 9.5 arms, VESPO Sec. 4.1, R3 record-only control",
    arms={
        **EPIC_PAPER.arms,
        "vespo": VESPO_PAPER.arms["vespo"],
        "grpo-r3rec": _flags(
            "--loss grpo --clip-low 0.2 --clip-high 0.28 --routing-replay r3 --routing-record-only"
        ),
        # EPIC as its paper defines the prefix ratio: against the behaviour policy, i.e. the
        # engine's log-probs mu (the arm above takes the trainer's recompute, so it never sees
        # the train/inference mismatch)
        "epic-mu": _flags(
            "--loss epic --delta-low 5e-4 --delta-high 2e-3 --behavior-logprobs rollout"
        ),
        # the production peers' off-policy corrections on GRPO Clip-Higher: decoupled PPO and
        # M2PO as AReaL runs them (clip against the trainer's recompute, weight by pi_old / mu;
        # its M2PO example's tau 0.04), OPSM as slime's default delta against the engine's mu
        "grpo-decoupled": _flags(
            "--loss grpo --clip-low 0.2 --clip-high 0.28 --rollout-correction decoupled"
        ),
        "grpo-m2po": _flags(
            "--loss grpo --clip-low 0.2 --clip-high 0.28 --rollout-correction m2po --m2po-tau 0.04"
        ),
        "grpo-opsm": _flags(
            "--loss grpo --clip-low 0.2 --clip-high 0.28 --opsm-delta 1e-4 "
            "--behavior-logprobs rollout"
        ),
        # on-policy distillation on top of GRPO Clip-Higher, slime's --use-opd default weights
        # (lambda 1, the task's advantage kept); the teacher is the run's: --loss-teacher DIR or
        # sglang:URL after the recipe's flags (refused without one)
        "grpo-opd": _flags(
            "--loss grpo --clip-low 0.2 --clip-high 0.28 --teacher-kl-coef 1.0 "
            "--teacher-task-weight 1.0"
        ),
        # pure distillation: the teacher's signal alone
        "opd": _flags("--loss grpo --clip-low 0.2 --clip-high 0.28 --teacher-task-weight 0"),
    },
    protocol=_flags(
        "--temperature 1.0 --top-p 1.0 --n-samples-per-prompt 8 "
        "--dynamic-sampling --over-sampling-ratio 0.1 "
        "--eval-interval 10 --n-samples-per-eval-prompt 8 --eval-temperature 1.0 --eval-top-p 0.7 "
        "--kl-coef 1e-3 --lr-warmup-iters 10 --clip-grad 1.0"
    ),
    notes=(
        "EPIC's protocol for every arm, VESPO included (its paper trains without KL; here the "
        "shared 1e-3 applies), with held-out evaluation every 10 steps. " + EPIC_PAPER.notes
    ),
)

RECIPES = {"epic-paper": EPIC_PAPER, "vespo-paper": VESPO_PAPER, "study": STUDY}

# The launchers' KL coefficient to the frozen initial policy when neither a recipe nor KL_COEF
# sets one: the EPIC paper's protocol uses 1e-3 for every method it compares (Sec. 9.2), so epic
# and its baselines (grpo, dapo, gspo, and gspo's token-level form) keep it; VESPO's objective
# has no KL term (slime's Qwen3-30B-A3B recipe uses 0), nor does any other loss here.
KL_COEF_BY_LOSS = {"epic": 1e-3, "grpo": 1e-3, "dapo": 1e-3, "gspo": 1e-3, "gspo_token": 1e-3}


def default_kl_coef(loss: str) -> float:
    """The launchers' KL coefficient for ``loss`` (`KL_COEF_BY_LOSS`; 0 for every other loss)."""
    return KL_COEF_BY_LOSS.get(loss, 0.0)


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; recipes: {', '.join(RECIPES)}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", nargs="?", choices=tuple(RECIPES))
    parser.add_argument("arm", nargs="?")
    parser.add_argument("--scale", action="store_true", help="add the paper's scale flags")
    parser.add_argument("--staleness", type=int, help="with --scale: N (default: the paper's)")
    parser.add_argument("--list", action="store_true", help="list the recipes and their arms")
    parser.add_argument(
        "--kl-default",
        metavar="LOSS",
        help="print the launchers' default --kl-coef for LOSS (0.001 or 0) and exit",
    )
    args = parser.parse_args(argv)
    if args.kl_default is not None:
        sys.stdout.write(f"{default_kl_coef(args.kl_default):g}\n")
        return 0
    if args.list or args.recipe is None:
        for name, recipe in RECIPES.items():
            sys.stdout.write(f"{name}: {', '.join(recipe.arms)}  ({recipe.source})\n")
        return 0
    if args.arm is None:
        parser.error(f"name an arm of {args.recipe}: {', '.join(get_recipe(args.recipe).arms)}")
    try:
        recipe = get_recipe(args.recipe)
        flags = recipe.flags(args.arm, scale=args.scale, staleness=args.staleness)
    except ValueError as error:
        parser.error(str(error))
    sys.stdout.write("\n".join(flags) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
