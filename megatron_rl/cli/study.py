"""Run (or read) a study: a grid of RL arms, each over K seeds, with 95% confidence intervals.

    megatron-rl study --out runs/study --preset mismatch --seeds 3 \
        --losses grpo vespo --replay r3rec r3 --staleness 4 --train-iters 20 --jobs 2
    megatron-rl study --out runs/study --read     # re-plot / re-summarise finished runs

(``python tools/compare_runs.py`` is the same command.)

Each (arm, seed) is ``python -m megatron_rl.train ... --seed <s>`` on the embedded default
(in-process engine, megatron on CPU) in its own process and run directory
``<out>/<arm>/seed<s>`` (metrics in ``metrics.jsonl``; trainer output in ``<out>/logs/``). Up to
``--jobs`` processes run at once (default: the machine's cores; each gets
``OMP_NUM_THREADS = cores // jobs`` unless set). A run that exits 0 gets a ``done.json`` marker
(its flags, wall time, the child's peak RSS from ``wait4``'s ``ru_maxrss`` and the code's git
revision); an interrupted study run again skips every marked run and reruns the others from
scratch. A marked run whose flags differ from the ones the study would pass now is an error (use
another ``--out``).

Grid axes (arm name ``<loss>-<replay>-N<n>[-<routing dtype>][-<correction>][-<rollout dtype>]``,
the optional parts only when not the default):

* ``--losses``; ``--replay`` off, r2, r3, or r3rec (R3 routes recorded and compared, nothing
  replayed: ``--routing-replay r3 --routing-record-only``, the control that *measures* the
  mismatch of an unreplayed run); ``--staleness`` N (``--global-batch-size`` = samples per
  rollout / N: N optimizer steps per rollout);
* ``--routing-dtype``: the codec routes are stored in. It changes routing bytes and memory only,
  not the training (the decoded routes are identical), and only for r2/r3/r3rec arms;
* ``--rollout-correction``: only meaningful where engine and trainer log-probs differ (bf16
  rollouts); arms with a correction and float32 rollouts are skipped (their weights are 1);
* ``--rollout-dtype``: the in-process engine's dtype (default: the preset's).

``--recipe epic-paper`` (or ``vespo-paper``; `megatron_rl/recipes.py`): the arms are the paper's
(``--losses`` picks among them, default all: e.g. ``grpo dapo gspo ctpo ripo epic
epic-raw-prob epic-cumulative-ratio grpo-r2 grpo-r3``), each with its table's objective and the
shared protocol (sampling, dynamic sampling, evaluation every few steps on the built-in held-out
set, KL, warmup) at this study's scale (the embedded model's batch, staleness and learning
rate); ``--replay`` is the recipe's. The summary then adds the final held-out ``eval/mean@k``.

``--preset mismatch``: ``--model tiny-mismatch --rollout-dtype bfloat16``. The engine computes in
bf16 while the trainer computes in fp32; tiny-mismatch (64 experts, top-8, 4 layers) has 64 close
router logits per token, and bf16's rounding of the hidden state moves them by about their
spacing, so the engine and the trainer pick different top-8 sets on a few percent of
token-layers, more in deeper layers (see megatron_rl/model/presets.py). The log-prob gap
(``mismatch/train_rollout_logprob_abs_gap``) then comes from both the bf16 arithmetic and the
flipped routes. That mismatch fades at trained weights (the router's logits spread out: 1.6%
of token-layers differ). Two stronger ones: ``--preset mismatch-fp8`` serves FP8 weights
(``--rollout-dtype float8``; 19% at initialisation, ~1% after 10 steps) and ``--preset
mismatch-noise`` adds noise to the engine's router (``--rollout-router-noise 0.05``, relative to
each token's logit spread, on top of bf16: a fifth of token-layers keep differing at trained
weights; see docs/study.md). ``--preset long``: the long-response task (``--task
addition-trace``, responses of 32-83 tokens) from the warm start ``--warm-start DIR``
(`megatron_rl.study.warm_start`) with bf16 rollouts, the mismatch measured on the real SGLang
server (``tools/measure_mismatch.py``), and lr 1e-4 (3e-3, the tiny model's default, wrecks the
warm-started policy in one step); ``--preset long-stress`` adds router noise 0.05 (the stress
arm).
``--preset none``: the plain tiny model, fp32 on both sides
(no mismatch).

The study of docs/study.md is ``--recipe study --preset mismatch-noise --staleness 8 1 --seeds 5
--train-iters 200`` (tests/tools/test_study_command.py runs it with 2 seeds and 2 steps).

Outputs in ``--out``: ``summary.md`` (per arm: mean +- 95% t-interval over seeds of each metric,
per-layer behaviour agreement, and every arm's difference from the reference arm with its Welch
interval, saying which differences are within noise) and ``curves.png`` (per-step mean over seeds
with a 95% band). The grid: megatron_rl/study/grid.py; the runs and their markers:
megatron_rl/study/jobs.py; statistics: megatron_rl/study/stats.py; the summary:
megatron_rl/study/summary.py.

``--records DIR`` also writes a small record of each finished run into DIR
(megatron_rl/study/records.py: flags, seed, revision, the per-step metrics the summary reads).
Records of several sittings add up; ``megatron-rl study-summary --records DIR --out OUT`` rebuilds
the summary and a deterministic ``curves.svg`` from them alone. A run DIR already records is not
trained again into a fresh ``--out`` (records are never replaced).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import megatron_rl
from megatron_rl.recipes import RECIPES, get_recipe
from megatron_rl.study import records, stats
from megatron_rl.study.curves_svg import BAND_MIN_SEEDS
from megatron_rl.study.grid import (
    CORRECTIONS,
    DTYPE_SHORT,
    PRESETS,
    REPLAY_FLAGS,
    ROUTING_DTYPES,
    Arm,
    arm_flags,
    build_grid,
)
from megatron_rl.study.jobs import (
    Job,
    read_arm,
    refuse_recorded_reruns,
    run_jobs,
    write_records,
)
from megatron_rl.study.run_metrics import PANELS, curve, run_scalars
from megatron_rl.study.summary import STANDARD_NOTES, summary

# the folder holding the package: the checkout (whose git revision each run records), or
# site-packages for an installed wheel (revision "unknown")
CODE_ROOT = Path(megatron_rl.__file__).resolve().parents[1]


def revision_now() -> dict:
    """The code's git revision and dirty flag now, for a run's marker and record."""
    if not (CODE_ROOT / ".git").exists():  # an installed package: no checkout to ask
        return {"revision": records.UNKNOWN_REVISION, "dirty": False}
    revision, dirty = records.git_revision(CODE_ROOT)
    return {"revision": revision, "dirty": dirty}


def plot(curves: dict[str, list[list[dict]]], path: Path) -> None:
    """Per panel, every arm's per-step mean over seeds with its 95% band; with fewer than
    `BAND_MIN_SEEDS` seeds, each seed's own curve (thin) instead of the band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows_n = -(-len(PANELS) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.4 * cols, 3.4 * rows_n), squeeze=False)
    for ax, (key, title) in zip(axes.flat, PANELS, strict=False):
        for index, (name, runs) in enumerate(curves.items()):
            steps, means, halves = stats.band([curve(rows, key) for rows in runs])
            if not steps:
                continue
            color = f"C{index % 10}"  # one colour per arm in every panel
            ax.plot(steps, means, label=name, color=color)
            if len(runs) < BAND_MIN_SEEDS:
                for rows in runs:
                    points = curve(rows, key)
                    ax.plot(list(points), list(points.values()), color=color, lw=0.6, alpha=0.45)
                continue
            lows = [m - h if math.isfinite(h) else m for m, h in zip(means, halves, strict=True)]
            highs = [m + h if math.isfinite(h) else m for m, h in zip(means, halves, strict=True)]
            ax.fill_between(steps, lows, highs, color=color, alpha=0.18, linewidth=0)
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(PANELS) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None):
    parser = argparse.ArgumentParser(
        description="Compare RL arms over seeds (losses x replay x staleness x routing dtype).",
        epilog="flags after -- go to every trainer run unchanged",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/compare"))
    parser.add_argument("--preset", choices=tuple(PRESETS), default="none")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per arm: 1..K")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--recipe", choices=tuple(RECIPES), help="a paper's arms and protocol")
    parser.add_argument(
        "--losses", nargs="+", help="losses (default grpo gspo vespo epic), or --recipe's arms"
    )
    parser.add_argument("--replay", nargs="+", default=["off"], choices=tuple(REPLAY_FLAGS))
    parser.add_argument("--staleness", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--routing-dtype", nargs="+", default=["auto"], choices=ROUTING_DTYPES)
    parser.add_argument("--rollout-correction", nargs="+", default=["none"], choices=CORRECTIONS)
    parser.add_argument("--rollout-dtype", nargs="+", choices=tuple(DTYPE_SHORT))
    parser.add_argument("--train-iters", type=int, default=40)
    parser.add_argument("--rollout-batch-size", type=int, default=16)
    parser.add_argument("--n-samples-per-prompt", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--final-window", type=int, default=5, help="steps of 'final' metrics")
    parser.add_argument("--reference", help="arm the differences are taken from (default: first)")
    parser.add_argument("--read", action="store_true", help="only read finished runs")
    parser.add_argument(
        "--warm-start",
        type=Path,
        help="the warm-started checkpoint (python -m megatron_rl.study.warm_start --out DIR) "
        "that --preset long-stress trains from",
    )
    parser.add_argument(
        "--records",
        type=Path,
        help="also keep a small record of each finished run here (megatron-rl study-summary)",
    )
    parser.add_argument(
        "--trainer-command",
        default=None,
        help="command a run starts (default: this Python with -m megatron_rl.train)",
    )
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") and e != "--"]
    if "--" not in extra and unknown:
        parser.error(f"unknown flags {unknown}; put trainer flags after --")
    args.extra = [e for e in extra if e != "--"]
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: need at least 1")
    if args.recipe:
        arms = get_recipe(args.recipe).arms
        unknown_arms = [a for a in args.losses or () if a not in arms]
        if unknown_arms:
            parser.error(f"--losses {unknown_arms}: not arms of {args.recipe} ({', '.join(arms)})")
        if args.replay != ["off"]:
            parser.error("--replay with --recipe: the recipe's arms set routing replay")
    elif args.losses is None:
        args.losses = ["grpo", "gspo", "vespo", "epic"]
    wants_warm_start = PRESETS[args.preset]["model"] == "warm-start"
    if wants_warm_start and args.warm_start is None:
        parser.error(f"--preset {args.preset} trains from a warm start: give --warm-start DIR")
    if args.warm_start is not None:
        if not wants_warm_start:
            parser.error(f"--warm-start: --preset {args.preset} does not use one")
        if not (args.warm_start / "warm_start.json").is_file():
            parser.error(
                f"--warm-start {args.warm_start}: no warm_start.json there; write one with "
                "python -m megatron_rl.study.warm_start --out DIR"
            )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    owned = ("--seed", "--run-dir", "--model", "--rollout-dtype", "--routing-replay")
    clash = [e for e in args.extra if e.split("=")[0] in owned]
    if clash:
        raise SystemExit(
            f"trainer flags {clash} after -- are set by the study itself; use --seeds / "
            "--first-seed, --out, --preset, --rollout-dtype and --replay instead"
        )
    arms: list[Arm]
    arms, skipped = build_grid(args)
    if not arms:
        raise SystemExit("the grid is empty: " + "; ".join(skipped))
    if args.reference and args.reference not in {arm.name for arm in arms}:
        raise SystemExit(
            f"--reference {args.reference}: not an arm of this grid; arms: "
            + ", ".join(arm.name for arm in arms)
        )
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    args.out.mkdir(parents=True, exist_ok=True)
    trainer = (
        shlex.split(args.trainer_command)
        if args.trainer_command
        else [sys.executable, "-m", "megatron_rl.train"]
    )
    jobs = [
        Job(
            arm.name,
            seed,
            args.out / arm.name / f"seed{seed}",
            args.out / "logs" / f"{arm.name}-seed{seed}.log",
            [*arm_flags(arm, args), "--seed", str(seed), *args.extra],
        )
        for arm in arms
        for seed in seeds
    ]
    if args.records:
        refuse_recorded_reruns(jobs, args.records)
    failed: list[Job] = []
    if not args.read:
        env = dict(os.environ)
        cores = os.cpu_count() or 1
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // min(args.jobs, len(jobs)))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CODE_ROOT), env.get("PYTHONPATH")]))
        failed = run_jobs(
            jobs,
            args.jobs,
            lambda job: [*trainer, *job.flags, "--run-dir", str(job.run_dir), "--no-progress"],
            env=env,
            marker_extra=revision_now,
        )
    if args.records:
        count = write_records(jobs, args.records)
        print(f"{count} run record(s) in {args.records}")
    per_arm, curves = {}, {}
    for arm in arms:
        runs = read_arm(args.out / arm.name, seeds)
        curves[arm.name] = [rows for rows, _ in runs]
        per_arm[arm.name] = [
            run_scalars(rows, marker, args.threshold, args.final_window) for rows, marker in runs
        ]
    command = "megatron-rl study " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    preset = PRESETS[args.preset]
    header = [
        "# Study summary",
        "",
        f"Command: `{command}`",
        "",
        f"Preset `{args.preset}` (model {preset['model'] or 'tiny'}, default rollout dtype "
        f"{preset['rollout_dtype']}); seeds {seeds[0]}..{seeds[-1]} (K = {len(seeds)}); "
        f"{args.train_iters} steps; {args.rollout_batch_size} prompts x "
        f"{args.n_samples_per_prompt} samples per rollout.",
    ]
    notes = [f"skipped {note}" for note in skipped]
    if len(args.routing_dtype) > 1:
        notes.append(
            "--routing-dtype is a memory-only axis: the codec stores the same routes in fewer or "
            "more bytes, so its arms train identically up to run-to-run noise; read only its "
            "routing bytes and peak RSS."
        )
    notes += STANDARD_NOTES
    if failed:
        notes.append("failed runs (no marker, rerun on the next invocation): " + ", ".join(
            f"{job.arm} seed {job.seed}" for job in failed
        ))  # fmt: skip
    text = summary(
        per_arm,
        threshold=args.threshold,
        window=args.final_window,
        header=header,
        notes=notes,
        reference=args.reference,
    )
    (args.out / "summary.md").write_text(text)
    plot(curves, args.out / "curves.png")
    print(text)
    if failed:
        print(f"{len(failed)} run(s) failed; logs in {args.out / 'logs'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
