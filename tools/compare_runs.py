"""Run (or read) a grid of arms and compare them: losses x routing replay x staleness N.

    python tools/compare_runs.py --out runs/compare --losses grpo gspo vespo epic \
        --replay off r2 r3 --staleness 1 4 --train-iters 40 [-- extra trainer flags]
    python tools/compare_runs.py --out runs/compare --read        # re-plot existing arms

Each arm is ``python -m megatron_rl.train`` on the embedded default (tiny Qwen3-MoE, built-in
task, in-process engine, megatron on CPU) in its own process and run directory
``<out>/<loss>-<replay>-N<n>``. Staleness N is set through ``--global-batch-size`` = samples per
rollout / N. The script writes ``curves.png`` (accuracy, reward, clip fraction, entropy and
routing agreement against step) and ``summary.md`` (final accuracy, first step reaching
``--threshold``, routing bytes per rank, wall time) into ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PANELS = (
    ("accuracy", "accuracy"),
    ("reward/mean", "reward"),
    ("clip_frac", "clip fraction (any side)"),
    ("entropy", "entropy"),
    ("routing/agreement/behaviour", "routing agreement, engine vs trainer (R3)"),
    ("routing/agreement/update", "routing agreement after updates"),
)


def arm_name(loss: str, replay: str, staleness: int) -> str:
    return f"{loss}-{replay}-N{staleness}"


def run_arm(out: Path, loss: str, replay: str, staleness: int, args, extra: list[str]) -> float:
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if samples % staleness:
        raise ValueError(f"N={staleness} does not divide {samples} samples per rollout")
    global_batch = samples // staleness
    micro = min(args.micro_batch_size, global_batch)
    command = [
        sys.executable, "-m", "megatron_rl.train",
        "--loss", loss, "--routing-replay", replay,
        "--train-iters", str(args.train_iters),
        "--rollout-batch-size", str(args.rollout_batch_size),
        "--n-samples-per-prompt", str(args.n_samples_per_prompt),
        "--global-batch-size", str(global_batch), "--micro-batch-size", str(micro),
        "--run-dir", str(out / arm_name(loss, replay, staleness)), "--no-progress",
        *extra,
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def read_arm(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def clip_fraction(row: dict) -> float | None:
    values = [
        v for k, v in row.items() if k.endswith("clip_frac_high") or k.endswith("clip_frac_low")
    ]
    values = [v for v in values if v is not None]
    return sum(values) if values else None


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in rows:
        value = clip_fraction(row) if key == "clip_frac" else row.get(key)
        if value is not None:
            steps.append(row["step"])
            values.append(value)
    return steps, values


def plot(arms: dict[str, list[dict]], path: Path) -> None:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6))
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        for index, (name, rows) in enumerate(arms.items()):
            steps, values = series(rows, key)
            if steps:  # one colour per arm in every panel, whichever panels it has data for
                ax.plot(steps, values, label=name, color=f"C{index % 10}")
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(arms: dict[str, list[dict]], walls: dict[str, float], threshold: float) -> str:
    lines = [
        f"| arm | final accuracy | first step >= {threshold} | routing bytes / rank | wall s |",
        "|---|---|---|---|---|",
    ]
    for name, rows in arms.items():
        if not rows:
            lines.append(f"| {name} | (no metrics) | | | |")
            continue
        last = rows[-1]
        reached = next((r["step"] for r in rows if (r.get("accuracy") or 0) >= threshold), None)
        wall = walls.get(name, sum(r.get("time/step") or 0 for r in rows))
        lines.append(
            f"| {name} | {last.get('accuracy', float('nan')):.3f} | "
            f"{reached if reached is not None else 'not reached'} | "
            f"{int(last.get('routing/bytes_per_rank', 0))} | {wall:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description="Compare RL arms (losses x replay x staleness).")
    parser.add_argument("--out", type=Path, default=Path("runs/compare"))
    parser.add_argument("--losses", nargs="+", default=["grpo", "gspo", "vespo", "epic"])
    parser.add_argument("--replay", nargs="+", default=["off"], choices=["off", "r2", "r3"])
    parser.add_argument("--staleness", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--train-iters", type=int, default=40)
    parser.add_argument("--rollout-batch-size", type=int, default=16)
    parser.add_argument("--n-samples-per-prompt", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--read", action="store_true", help="only read existing arm directories")
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    arms, walls = {}, {}
    for loss, replay, staleness in itertools.product(args.losses, args.replay, args.staleness):
        name = arm_name(loss, replay, staleness)
        if not args.read:
            walls[name] = run_arm(args.out, loss, replay, staleness, args, extra)
        arms[name] = read_arm(args.out / name)
    plot(arms, args.out / "curves.png")
    table = summary(arms, walls, args.threshold)
    (args.out / "summary.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
