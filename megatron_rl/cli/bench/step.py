"""The embedded RL step's cost, paired against a baseline in the same session.

    megatron-rl bench step [--setting study-n8 study-n1 main] [--repeats 3] [--steps 6]
                           [--old-tree DIR] [--sequential] [--aten-grouped-mm]
                           [--unfused-attention]

Each run is the real CLI (``python -m megatron_rl.train``) in its own process with one torch
thread. Every repeat starts one baseline run and one run of this tree *at the same time*, so the
two share the machine's two cores and its load (the study runs two arms at once in the same
way): a run's wall seconds per step is then its machine-seconds per step. Baselines:

- ``--old-tree DIR``: a checkout of an older commit (its own package, by PYTHONPATH);
- ``--sequential``: this tree with ``--no-moe-grouped-gemm`` (megatron's per-expert loop);
- ``--aten-grouped-mm``: this tree with ``torch._grouped_mm`` instead of the CPU grouped GEMM
  kernel (``MEGATRON_RL_CPU_GROUPED_GEMM=aten``);
- ``--unfused-attention``: this tree with megatron's unfused attention.

Per run it reads the run's ``metrics.jsonl``: ``time/step`` and its parts (rollout, old-logprob
pass, updates, weight sync) for steps 2.. (step 1 warms caches), and the start-up (the process's
wall time less its steps). Ratios are baseline / this tree, paired per repeat: median [min-max].

Settings (the study's arm of docs/study.md and the README's main job):
- ``study-n8``: tiny-mismatch, router noise 0.05, bf16 rollouts, GRPO, 16 prompts x 8 samples,
  staleness N = 8 (8 updates of 16 samples); ``study-n1``: the same with one update of 128;
- ``main``: ``make main``'s defaults (the tiny preset);
- ``study-long``: the long-response study's setting (docs/study.md: ``--task addition-trace``,
  responses of up to 128 tokens, bf16 serving) from the warm start ``--warm-start DIR``
  (`megatron_rl.study.warm_start`), GRPO at N = 8, without dynamic sampling (so that every step
  generates one batch of 16 x 8); generation is most of its step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import megatron_rl

# this tree: the folder holding the package (the checkout; site-packages for an installed wheel)
HERE = Path(megatron_rl.__file__).resolve().parents[1]
STUDY = [
    "--model", "tiny-mismatch", "--rollout-dtype", "bfloat16",
    "--rollout-router-noise", "0.05", "--loss", "grpo",
    "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
]  # fmt: skip
WARM_START = "<--warm-start>"  # replaced by the checkpoint folder `--warm-start` names
SETTINGS = {
    "study-n8": [*STUDY, "--global-batch-size", "16", "--micro-batch-size", "16"],
    "study-n1": [*STUDY, "--global-batch-size", "128", "--micro-batch-size", "32"],
    "main": [],
    "study-long": [
        "--model", WARM_START, "--task", "addition-trace", "--max-response-length", "128",
        "--lr", "1e-4", "--rollout-dtype", "bfloat16", "--loss", "grpo",
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
        "--global-batch-size", "16", "--micro-batch-size", "16",
    ],
}  # fmt: skip
PARTS = ("time/step", "time/rollout", "time/old_logprob", "time/update", "time/sync")


def start_run(
    tree: Path, flags: list[str], run_dir: Path, steps: int, env_extra: dict | None = None
) -> dict:
    """One CLI run of ``tree`` with one torch thread, started now; a thread notes its exit."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree), WANDB_MODE="disabled")
    env.update(env_extra or {})
    command = [
        sys.executable, "-m", "megatron_rl.train", *flags,
        "--train-iters", str(steps), "--seed", "1", "--run-dir", str(run_dir), "--no-progress",
    ]  # fmt: skip
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 (closed with the process)
    run = {"started": time.perf_counter(), "log": log, "run_dir": run_dir}
    run["process"] = subprocess.Popen(
        command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT
    )

    def wait() -> None:  # the exit time of this run, not of the later of the pair
        run["code"] = run["process"].wait()
        run["wall"] = time.perf_counter() - run["started"]

    run["waiter"] = threading.Thread(target=wait, daemon=True)
    run["waiter"].start()
    return run


def finish_run(run: dict) -> dict[str, float]:
    """Median seconds of each part over steps 2.., and the start-up seconds, of a finished run
    (its process wall time less its steps: imports, building, the end-of-run plot)."""
    run["waiter"].join()
    run["log"].close()
    run_dir = run["run_dir"]
    if run["code"] != 0:
        tail = run_dir.with_suffix(".log").read_text()[-3000:]
        raise RuntimeError(f"run {run_dir} failed with exit code {run['code']}:\n{tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "time/step" in row]
    out = {part: statistics.median(row[part] for row in rows[1:]) for part in PARTS}
    out["start-up"] = run["wall"] - sum(row["time/step"] for row in rows)
    return out


def measure(
    setting: str, baselines: dict, repeats: int, steps: int, scratch: Path, warm_start=None
) -> list:
    """Per repeat and baseline: (baseline's parts, this tree's parts), run at the same time."""
    results = []
    for repeat in range(repeats):
        for name, (tree, extra, env_extra) in baselines.items():
            flags = [str(warm_start) if f == WARM_START else f for f in SETTINGS[setting]]
            dirs = [scratch / f"{setting}-{repeat}-{name}-{arm}" for arm in ("base", "now")]
            runs = [
                start_run(tree, [*flags, *extra], dirs[0], steps, env_extra),
                start_run(HERE, flags, dirs[1], steps),
            ]
            base, now = (finish_run(run) for run in runs)
            results.append((name, base, now))
            print(f"{setting} repeat {repeat} vs {name}: base {base['time/step']:.3f} s/step, "
                  f"now {now['time/step']:.3f} s/step", flush=True)  # fmt: skip
    return results


def summary(setting: str, results: list) -> str:
    """A markdown table per baseline: medians of each part and paired ratios with spread."""
    lines = []
    for name in dict.fromkeys(r[0] for r in results):
        pairs = [(base, now) for n, base, now in results if n == name]
        lines += [
            f"\n{setting}, baseline {name} ({len(pairs)} paired runs, two at once, 1 thread):",
            "| part | baseline s | now s | baseline / now, median [min-max] |",
            "|---|---|---|---|",
        ]
        for part in (*PARTS, "start-up"):
            ratios = sorted(base[part] / max(now[part], 1e-9) for base, now in pairs)
            lines.append(
                f"| {part} | {statistics.median(b[part] for b, _ in pairs):.3f} "
                f"| {statistics.median(n[part] for _, n in pairs):.3f} "
                f"| {statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}] |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", nargs="+", default=["study-n8"], choices=tuple(SETTINGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    parser.add_argument("--old-tree", type=Path, help="checkout of an older commit")
    parser.add_argument("--sequential", action="store_true", help="baseline: --no-moe-grouped-gemm")
    parser.add_argument(
        "--aten-grouped-mm",
        action="store_true",
        help="baseline: this tree with torch._grouped_mm instead of the CPU grouped GEMM kernel",
    )
    parser.add_argument(
        "--unfused-attention",
        action="store_true",
        help="baseline: this tree with megatron's unfused attention (--local-attention unfused)",
    )
    parser.add_argument("--out", type=Path, help="also write the tables to this markdown file")
    parser.add_argument("--warm-start", type=Path, help="the study's warm start (study-long)")
    args = parser.parse_args(argv)
    if "study-long" in args.setting and args.warm_start is None:
        parser.error("--setting study-long needs --warm-start DIR (python -m "
                     "megatron_rl.study.warm_start --out DIR)")  # fmt: skip
    warm_start = args.warm_start.resolve() if args.warm_start else None
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warm-up)")
    baselines = {}
    if args.old_tree:
        baselines["old-tree"] = (args.old_tree.resolve(), [], {})
    if args.sequential:
        baselines["sequential"] = (HERE, ["--no-moe-grouped-gemm"], {})
    if args.aten_grouped_mm:
        baselines["aten-grouped-mm"] = (HERE, [], {"MEGATRON_RL_CPU_GROUPED_GEMM": "aten"})
    if args.unfused_attention:
        baselines["unfused-attention"] = (HERE, ["--local-attention", "unfused"], {})
    if not baselines:
        parser.error(
            "choose a baseline: --old-tree DIR, --sequential, --aten-grouped-mm and/or "
            "--unfused-attention"
        )
    tables = []
    with tempfile.TemporaryDirectory() as scratch:
        for setting in args.setting:
            results = measure(
                setting, baselines, args.repeats, args.steps, Path(scratch), warm_start
            )
            tables.append(summary(setting, results))
            print(tables[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(tables) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
