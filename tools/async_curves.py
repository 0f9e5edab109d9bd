"""Accuracy against time of the main job, sync vs ``--async-rollout --max-staleness 1``.

    python tools/async_curves.py --out runs/async_curves --torch-threads 1 --seeds 1234
    python tools/async_curves.py --out runs/async_curves --read   # re-plot / re-summarise

Arms: {grpo, vespo} x {sync, async}. Each (arm, seed) is one process of
``python -m megatron_rl.train --loss <loss> --seed <s> --torch-threads <T> [--async-rollout
--max-staleness 1]`` on the embedded default (every other flag at its default, or the extra flags
after ``--``), run one at a time and interleaved (per seed: grpo-sync, grpo-async, vespo-sync,
vespo-async), so a slow spell of a shared machine hits every arm alike. Every arm gets the same
``--torch-threads`` (default 1, what the trainer picks itself on a 2-core machine for one rank,
synchronous or not): the sync run's rollout and training then use one core in turn, while the
async run's generation thread works alongside its training thread.

Time axis: the seconds of training steps, i.e. the cumulative ``time/step`` of
``metrics.jsonl`` (`megatron_rl.train.run_logger.METRICS_FILE`): the wall clock of the training
loop (rollout, old log-probs, updates, weight sync), without the process start-up and the model
build, which are the same for every arm (the process wall time is in ``done.json`` and
summary.md too).

Outputs in ``--out``: ``<arm>/seed<s>/`` (the run directory), ``logs/``,
``accuracy_vs_time.png`` (accuracy against seconds of steps, one line per arm and seed, with the
trailing-window mean; a second panel against the step) and ``summary.md``: per arm and seed, the
step and the time at which the trailing mean of accuracy over ``--window`` steps first reaches
``--target`` (0.9), the final accuracy (mean of the last ``--window`` steps), samples trained per
second of steps, and the async metrics (staleness, overlap, dropped batches).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": [], "async": ["--async-rollout", "--max-staleness", "1"]}
COLOURS = {"grpo": "tab:blue", "vespo": "tab:red"}


@dataclass
class Run:
    """One finished (arm, seed): its metrics file and what the tool knew when it ran it."""

    loss: str
    mode: str
    seed: int
    metrics_path: Path
    samples_per_step: int
    wall_s: float | None = None

    @property
    def arm(self) -> str:
        return f"{self.loss}-{self.mode}"


def metrics_file_name() -> str:
    try:
        from megatron_rl.train.run_logger import METRICS_FILE
    except ImportError:  # the tool is read without the package installed
        return "metrics.jsonl"
    return METRICS_FILE


def read_rows(path: Path) -> list[dict]:
    """The records of a metrics.jsonl file, in step order; a torn last line is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(rows, key=lambda r: r["step"])


def trailing_mean(values: list[float], window: int) -> list[float | None]:
    """Mean of the last ``window`` values at each position (None before ``window`` values)."""
    out: list[float | None] = []
    for i in range(len(values)):
        out.append(sum(values[i + 1 - window : i + 1]) / window if i + 1 >= window else None)
    return out


def curve(rows: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """Steps, cumulative seconds of steps, and accuracy of the rows that have an accuracy."""
    steps, seconds, accuracy, clock = [], [], [], 0.0
    for row in rows:
        clock += float(row.get("time/step") or 0.0)
        if row.get("accuracy") is None:
            continue
        steps.append(int(row["step"]))
        seconds.append(clock)
        accuracy.append(float(row["accuracy"]))
    return steps, seconds, accuracy


def summarize_run(run: Run, window: int, target: float) -> dict:
    """The numbers of one run (see the module docstring)."""
    rows = [r for r in read_rows(run.metrics_path) if "time/step" in r]  # not a step-0 eval row
    steps, seconds, accuracy = curve(rows)
    smooth = trailing_mean(accuracy, window)
    first = next((i for i, m in enumerate(smooth) if m is not None and m >= target), None)
    total = sum(float(r.get("time/step") or 0.0) for r in rows)
    final = accuracy[-window:]

    def mean_of(key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {
        "arm": run.arm,
        "loss": run.loss,
        "mode": run.mode,
        "seed": run.seed,
        "steps": len(rows),
        "reach_step": steps[first] if first is not None else None,
        "reach_s": seconds[first] if first is not None else None,
        "final_accuracy": sum(final) / len(final) if final else None,
        "last_accuracy": accuracy[-1] if accuracy else None,
        "step_seconds": total,
        "samples_per_s": run.samples_per_step * len(rows) / total if total > 0 else None,
        "wall_s": run.wall_s,
        "staleness_mean": mean_of("async/staleness_mean"),
        "overlap_fraction": mean_of("async/overlap_fraction"),
        "dropped_batches": sum(r.get("async/dropped_batches") or 0.0 for r in rows),
    }


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def write_summary(runs: Sequence[Run], path: Path, window: int, target: float, note: str = ""):
    """summary.md: one row per (arm, seed), then per arm the ratio of async to sync."""
    results = [summarize_run(r, window, target) for r in runs]
    lines = [
        "# Main job: sync vs --async-rollout --max-staleness 1",
        "",
        f"Reaching {target}: the first step at which the mean accuracy of the last {window} steps "
        f"is >= {target}; time = seconds of training steps up to that step (cumulative "
        f"`time/step`). Final accuracy: mean of the last {window} steps. Samples/s: samples "
        "trained per second of steps.",
        "",
    ]
    if note:
        lines += [note, ""]
    lines += [
        "| arm | seed | steps | step at 0.9 | s at 0.9 | final acc | last acc | s of steps "
        "| samples/s | process s | staleness | overlap | dropped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['arm']} | {r['seed']} | {r['steps']} | {_fmt(r['reach_step'], 'd')} "
            f"| {_fmt(r['reach_s'], '.1f')} | {_fmt(r['final_accuracy'])} "
            f"| {_fmt(r['last_accuracy'])} | {_fmt(r['step_seconds'], '.1f')} "
            f"| {_fmt(r['samples_per_s'], '.0f')} | {_fmt(r['wall_s'], '.1f')} "
            f"| {_fmt(r['staleness_mean'])} | {_fmt(r['overlap_fraction'])} "
            f"| {_fmt(r['dropped_batches'], '.0f')} |"
        )
    lines += ["", "Async / sync (same loss and seed): samples/s ratio, time-to-0.9 ratio.", ""]
    lines += ["| loss | seed | samples/s ratio | time-to-0.9 ratio |", "|---|---|---|---|"]
    by_key = {(r["loss"], r["mode"], r["seed"]): r for r in results}
    for (loss, mode, seed), sync in sorted(by_key.items()):
        if mode != "sync" or (loss, "async", seed) not in by_key:
            continue
        other = by_key[(loss, "async", seed)]
        speed = (
            other["samples_per_s"] / sync["samples_per_s"]
            if other["samples_per_s"] and sync["samples_per_s"]
            else None
        )
        reach = other["reach_s"] / sync["reach_s"] if other["reach_s"] and sync["reach_s"] else None
        lines.append(f"| {loss} | {seed} | {_fmt(speed)} | {_fmt(reach)} |")
    path.write_text("\n".join(lines) + "\n")
    return results


def plot(runs: Sequence[Run], path: Path, window: int, target: float) -> None:
    """accuracy_vs_time.png: accuracy against seconds of steps (top) and against step (bottom);
    colour = loss, solid = sync, dashed = async; faint raw accuracy, bold trailing mean."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 7), layout="constrained")
    FigureCanvasAgg(figure)
    by_time, by_step = figure.subplots(2, 1)
    for run in runs:
        steps, seconds, accuracy = curve(read_rows(run.metrics_path))
        smooth = trailing_mean(accuracy, window)
        colour = COLOURS.get(run.loss)
        style = "-" if run.mode == "sync" else "--"
        label = f"{run.arm} seed {run.seed}"
        for ax, x in ((by_time, seconds), (by_step, steps)):
            ax.plot(x, accuracy, style, color=colour, alpha=0.25, linewidth=0.8)
            points = [(a, m) for a, m in zip(x, smooth, strict=True) if m is not None]
            if points:
                ax.plot(*zip(*points, strict=True), style, color=colour, linewidth=1.8, label=label)
    for ax, xlabel in ((by_time, "seconds of training steps"), (by_step, "step")):
        ax.axhline(target, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=8, loc="lower right")
    by_time.set_title(f"main job: sync vs async (bold: mean of the last {window} steps)")
    figure.savefig(path, format="png", dpi=110)


def run_one(run: Run, out: Path, flags: list[str], env: dict) -> None:
    """``python -m megatron_rl.train`` for one (arm, seed); writes done.json when it exits 0."""
    run_dir = run.metrics_path.parent
    done = run_dir / "done.json"
    if done.exists():
        recorded = json.loads(done.read_text())
        if recorded["flags"] != flags:
            raise SystemExit(f"{run_dir} was run with other flags: {recorded['flags']}")
        run.wall_s = recorded["wall_s"]
        print(f"{run.arm} seed {run.seed}: done already", flush=True)
        return
    command = [sys.executable, "-m", "megatron_rl.train", *flags]
    (out / "logs").mkdir(parents=True, exist_ok=True)
    log = out / "logs" / f"{run.arm}-seed{run.seed}.log"
    print(f"{run.arm} seed {run.seed}: {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.call(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    run.wall_s = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{run.arm} seed {run.seed} exited {code}; see {log}")
    done.write_text(json.dumps({"flags": flags, "wall_s": run.wall_s}))
    print(f"{run.arm} seed {run.seed}: {run.wall_s:.1f} s", flush=True)


def plan(args, extra: list[str]) -> list[tuple[Run, list[str]]]:
    """The (run, flags) of every arm and seed, interleaved."""
    from megatron_rl.train.config import parse_args as train_args

    name = metrics_file_name()
    runs = []
    for seed in args.seeds:
        for loss in args.losses:
            for mode, mode_flags in MODES.items():
                run_dir = args.out / f"{loss}-{mode}" / f"seed{seed}"
                flags = [
                    # an unfinished run is run again; its rows are kept aside, not refused
                    "--run-dir", str(run_dir), "--overwrite-run-dir", "--no-progress",
                    "--loss", loss,
                    "--seed", str(seed), "--torch-threads", str(args.torch_threads),
                    *mode_flags, *extra,
                ]  # fmt: skip
                if args.train_iters is not None:
                    flags += ["--train-iters", str(args.train_iters)]
                config = train_args(flags)
                per_step = config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
                runs.append((Run(loss, mode, seed, run_dir / name, per_step), flags))
    return runs


def parse_args(argv: Sequence[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/async_curves"))
    parser.add_argument("--losses", nargs="+", default=["grpo", "vespo"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1234])
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--train-iters", type=int, default=None, help="default: the main job's")
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--read", action="store_true", help="only summarise finished runs")
    parser.add_argument("extra", nargs="*", help="after --: more flags for every run")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.torch_threads))
    runs = []
    for run, flags in plan(args, list(args.extra)):
        if args.read:
            done = run.metrics_path.parent / "done.json"
            if not done.exists():
                continue
            run.wall_s = json.loads(done.read_text())["wall_s"]
        else:
            run_one(run, args.out, flags, env)
        runs.append(run)
    if not runs:
        raise SystemExit(f"no finished run in {args.out}")
    note = (
        f"Every run: `python -m megatron_rl.train --loss <loss> --seed <seed> --torch-threads "
        f"{args.torch_threads}` (+ `--async-rollout --max-staleness 1` for async)"
        + (f", `--train-iters {args.train_iters}`" if args.train_iters is not None else "")
        + (f", `{shlex.join(args.extra)}`" if args.extra else "")
        + "; one process at a time, arms interleaved."
    )
    write_summary(runs, args.out / "summary.md", args.window, args.target, note)
    plot(runs, args.out / "accuracy_vs_time.png", args.window, args.target)
    print((args.out / "summary.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
