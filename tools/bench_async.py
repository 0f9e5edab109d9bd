"""Throughput where generation is the long pole: sync vs ``--async-rollout`` (K = 1, 2, 4), the
engine in its own process.

    python tools/bench_async.py --out runs/bench_async --repeats 3 --train-iters 20
    python tools/bench_async.py --out runs/bench_async --read   # re-summarise finished runs
    python tools/bench_async.py --arms sync async-k1 partial -- --lr 1e-3   # more trainer flags

Arms (``--arms``): ``sync``; ``async-k1``, ``async-k2``, ``async-k4`` (``--async-rollout
--max-staleness K``); ``partial`` (``--async-rollout --max-staleness 1 --partial-rollout
--sglang-pause-mode retract --behavior-logprobs rollout``); ``partial-carry`` (``partial`` with
``--carry-over-groups 4 --carry-over-round-tokens 8``: 4 groups more in flight, 8-token rounds);
an arm the trainer refuses is skipped with a note in summary.md. Each (arm, repeat) is one process
of ``python -m megatron_rl.train --rollout-engine sglang --sglang-url <its server>`` against a fresh
loopback SGLang stand-in (``python -m megatron_rl.testing.loopback_server``) started for that run
alone in a process of its own, so that generation and training run in two processes, as with a real
engine. Runs go one at a time and interleaved: every repeat runs every arm, starting one arm later
than the repeat before (rotation), so a slow spell of a shared machine hits every arm alike and no
arm always runs first. Within a repeat every arm gets the same ``--seed`` (base seed + repeat),
hence the same prompts and initial weights: the arms are paired.

Threads, set deliberately for every arm: the trainer ``--torch-threads T``
(``--torch-threads``, default 1) and ``OMP_NUM_THREADS=T``; the server ``--torch-threads S``
and ``OMP_NUM_THREADS=S`` (``--server-threads``, default 1). On a 2-core machine the sync run
then uses one core at a time (the trainer waits while the server generates, and the other way
round), the async runs both at once.

The setting (``SETTING``, changed with flags after ``--``): the built-in task with responses of
up to ``--max-response-length 32`` tokens, 4 prompts x 8 samples a step, trained in 4 updates of
8 one-row micro-batches. The random initial policy puts about 1/16 of its mass on ``<eos>``, so
responses start at ~13 tokens on average, some reaching the limit (variable lengths; summary.md
reports them), far beyond the built-in task's answer of one digit (the reward reads only the
first symbol). Training pushes ``<eos>`` down (most samples are wrong, so most ``<eos>`` tokens
carry a negative advantage) and lengths grow during a run, at a pace that differs between the
arms: hence tokens/s next to samples/s, and the limit of 32 rather than 64, which bounds the
drift. The loopback server decodes one request at a time, so generation is the slow side; the
one-row micro-batches keep the training side from being negligible (with 64 samples in one
64-row update per step, 64-token responses, it is ~10 % of a sync step and the bound below ~1.1;
numbers in docs/performance.md, "Asynchronous rollouts with the engine in its own process").

Measured per run (from ``metrics.jsonl``, `megatron_rl.train.run_logger.METRICS_FILE`): samples
trained per second of steps (samples per step x steps / sum of ``time/step``: the training
loop's wall clock, without process start-up and model build; the process's wall time is in
summary.md too); mean response length (``response_length/mean``); per step, generation
(``time/generation`` where logged, i.e. async; else ``time/rollout``, the sync run's rollout
phase, which is its generation) and ``time/trainer_idle`` (async: the trainer waiting for the
rollout); generation seconds per response token over the run (the engine slows down when the
trainer computes beside it); accuracy against seconds of steps (``accuracy_vs_time.png``).

Per repeat: the paired ratio ``samples/s (arm) / samples/s (sync)``, and the bound from that
repeat's sync run: with ``s`` its mean step time, ``g`` its mean rollout time (generation alone,
what the engine needs) and ``t = s - g`` (training alone: old log-probs, updates, weight sync),
overlapping the two sides can at best bring a step to ``max(g, t)``, so ``bound = s / max(g,
t)`` (steady state; at most 2). Summary: per arm, the median ratio over repeats with its min-max
and a 95 % Student-t interval of the mean, next to the median bound; the same for tokens/s.

Outputs in ``--out``: ``<arm>/repeat<r>/`` (the trainer's run directory), ``logs/`` (trainer
and server logs), ``accuracy_vs_time.png`` and ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_curves import curve, metrics_file_name, read_rows, trailing_mean

ROOT = Path(__file__).resolve().parents[1]
ASYNC = ["--async-rollout", "--max-staleness"]
ARMS = {
    "sync": [],
    "async-k1": [*ASYNC, "1"],
    "async-k2": [*ASYNC, "2"],
    "async-k4": [*ASYNC, "4"],
    "partial": [
        *ASYNC, "1", "--partial-rollout", "--sglang-pause-mode", "retract",
        "--behavior-logprobs", "rollout",
    ],
    "partial-carry": [
        *ASYNC, "1", "--partial-rollout", "--sglang-pause-mode", "retract",
        "--behavior-logprobs", "rollout", "--carry-over-groups", "4",
        "--carry-over-round-tokens", "8",
    ],
}  # fmt: skip
DEFAULT_ARMS = ("sync", "async-k1", "async-k2", "async-k4")
# long, variable-length responses; 32 samples a step, trained in 4 updates of 8 one-row
# micro-batches (a training side that is not negligible); no stop for steps without signal
SETTING = [
    "--max-response-length", "32",
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "8",
    "--global-batch-size", "8", "--micro-batch-size", "1",
    "--max-no-signal-steps", "0",
]  # fmt: skip
COLOURS = {
    "sync": "tab:grey",
    "async-k1": "tab:blue",
    "async-k2": "tab:orange",
    "async-k4": "tab:red",
    "partial": "tab:green",
    "partial-carry": "tab:purple",
}
# Student-t 0.975 quantiles for 1..30 degrees of freedom (then the normal's 1.96)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179)
T975 += (2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064)
T975 += (2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclass
class Run:
    """One (arm, repeat): its metrics file and what the tool knew when it ran it."""

    arm: str
    repeat: int
    metrics_path: Path
    samples_per_step: int
    wall_s: float | None = None
    load: list[float] = field(default_factory=list)  # 1-min load average before, after
    failed: str | None = None


def t_quantile(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (``df >= 1``)."""
    return T975[df - 1] if df <= len(T975) else 1.96


def spread(values: Sequence[float]) -> dict:
    """Median, min, max, mean and the 95 % t-interval of the mean (None for fewer than 2)."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None, "mean": None, "ci": None}
    mean = statistics.fmean(values)
    ci = None
    if len(values) >= 2:
        half = t_quantile(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
        ci = (mean - half, mean + half)
    return {
        "n": len(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "mean": mean,
        "ci": ci,
    }


def bound(step_s: float, generation_s: float) -> float | None:
    """The best speed-up of overlapping a sync step's two sides: ``s / max(g, s - g)``."""
    training_s = step_s - generation_s
    slower = max(generation_s, training_s)
    return step_s / slower if slower > 0 else None


def summarize_run(run: Run, window: int) -> dict:
    """The numbers of one run (see the module docstring)."""
    rows = [r for r in read_rows(run.metrics_path) if "time/step" in r]  # not a step-0 eval row
    n = len(rows)

    def mean_of(key: str, rows=rows) -> float | None:
        values = [float(r[key]) for r in rows if r.get(key) is not None]
        if any(math.isnan(v) for v in values):
            raise ValueError(f"{run.metrics_path}: {key} holds NaN")
        return statistics.fmean(values) if values else None

    step_s = mean_of("time/step")
    total = step_s * n if step_s is not None else 0.0
    generation = mean_of("time/generation")
    if generation is None:  # sync: the rollout phase is the generation
        generation = mean_of("time/rollout")
    _, _, accuracy = curve(rows)
    final = accuracy[-window:]
    length = mean_of("response_length/mean")
    sync = run.arm == "sync"  # training alone = step - generation only where they alternate
    # seconds generating per response token over the run (every batch is generated once)
    key = "time/generation" if any("time/generation" in r for r in rows) else "time/rollout"
    tokens = run.samples_per_step * sum(float(r.get("response_length/mean") or 0) for r in rows)
    generating = sum(float(r.get(key) or 0.0) for r in rows)
    return {
        "arm": run.arm,
        "repeat": run.repeat,
        "steps": n,
        "step_seconds": total,
        "step_s": step_s,
        "samples_per_s": run.samples_per_step * n / total if total > 0 else None,
        "tokens_per_s": (
            run.samples_per_step * n * length / total if total > 0 and length else None
        ),
        "generation_s": generation,
        "generation_ms_per_token": 1e3 * generating / tokens if tokens > 0 else None,
        "training_s": step_s - generation if sync and None not in (step_s, generation) else None,
        "trainer_idle_s": mean_of("time/trainer_idle"),
        "response_length": length,
        "response_length_max": max(
            (float(r["response_length/max"]) for r in rows if "response_length/max" in r),
            default=None,
        ),
        "truncated_frac": mean_of("rollout/truncated_frac"),
        "staleness_mean": mean_of("async/staleness_mean"),
        "overlap_fraction": mean_of("async/overlap_fraction"),
        "final_accuracy": statistics.fmean(final) if final else None,
        "wall_s": run.wall_s,
        "load": list(run.load),
    }


def paired(results: Sequence[dict], key: str = "samples_per_s") -> dict:
    """Per arm (not sync): the repeats' ratios ``key (arm) / key (sync)`` (samples/s by
    default); and the per-repeat bound of the sync run (`bound`) under ``"bound"``."""
    sync = {r["repeat"]: r for r in results if r["arm"] == "sync"}
    out: dict[str, dict[int, float]] = {"bound": {}}
    for repeat, s in sync.items():
        if s["step_s"] and s["generation_s"] is not None:
            out["bound"][repeat] = bound(s["step_s"], s["generation_s"])
    for r in results:
        base = sync.get(r["repeat"])
        if r["arm"] == "sync" or base is None or not r[key]:
            continue
        if base[key]:
            out.setdefault(r["arm"], {})[r["repeat"]] = r[key] / base[key]
    return out


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _spread_cells(s: dict) -> str:
    ci = "-" if s["ci"] is None else f"{s['ci'][0]:.2f} .. {s['ci'][1]:.2f}"
    return (
        f"{_fmt(s['median'])} | {_fmt(s['min'])} .. {_fmt(s['max'])} | {_fmt(s['mean'])} "
        f"| {ci} | {s['n']}"
    )


def write_summary(
    runs: Sequence[Run], path: Path, window: int, note: str = "", skipped: Sequence[str] = ()
) -> tuple[list[dict], dict]:
    """summary.md: per run, the paired ratios per repeat, and per arm their spread with the
    bound. Returns the per-run numbers and `paired`'s ratios."""
    results = [summarize_run(r, window) for r in runs if r.failed is None]
    ratios = paired(results)
    lines = ["# Throughput with the engine in its own process: sync vs async", ""]
    if note:
        lines += [note, ""]
    lines += [f"- {line}" for line in skipped]
    lines += [f"- {r.arm} repeat {r.repeat} failed: {r.failed}" for r in runs if r.failed]
    if skipped or any(r.failed for r in runs):
        lines.append("")
    lines += [
        "Per run: samples trained per second of steps (cumulative `time/step`); per step: "
        "generation (`time/generation`, sync: `time/rollout`), training (step - generation, "
        "sync only); gen. ms/token = all generation seconds / all response tokens of the run; "
        "trainer idle (`time/trainer_idle`, async); mean response length (`response_length/mean`"
        f"); final accuracy = mean of the last {window} steps; load = 1-min load average "
        "before / after the run.",
        "",
        "| arm | repeat | steps | s of steps | samples/s | tokens/s | step s | generation s "
        "| gen. ms/token | training s "
        "| trainer idle s | resp. len | resp. max | truncated | staleness | final acc "
        "| process s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        load = " / ".join(f"{x:.1f}" for x in r["load"]) or "-"
        lines.append(
            f"| {r['arm']} | {r['repeat']} | {r['steps']} | {_fmt(r['step_seconds'], '.1f')} "
            f"| {_fmt(r['samples_per_s'], '.1f')} | {_fmt(r['tokens_per_s'], '.0f')} "
            f"| {_fmt(r['step_s'])} "
            f"| {_fmt(r['generation_s'])} | {_fmt(r['generation_ms_per_token'])} "
            f"| {_fmt(r['training_s'])} "
            f"| {_fmt(r['trainer_idle_s'])} | {_fmt(r['response_length'], '.1f')} "
            f"| {_fmt(r['response_length_max'], '.0f')} | {_fmt(r['truncated_frac'], '.3f')} "
            f"| {_fmt(r['staleness_mean'])} | {_fmt(r['final_accuracy'])} "
            f"| {_fmt(r['wall_s'], '.0f')} | {load} |"
        )
    repeats = sorted({r["repeat"] for r in results})
    arms = [a for a in ratios if a != "bound"]
    lines += [
        "",
        "Paired ratio samples/s (arm) / samples/s (sync) per repeat; bound = s / max(g, s - g) "
        "of the repeat's sync run (s: step, g: generation).",
        "",
        "| repeat | " + " | ".join([*arms, "bound"]) + " |",
        "|---|" + "---|" * (len(arms) + 1),
    ]
    for repeat in repeats:
        cells = [_fmt(ratios[a].get(repeat)) for a in [*arms, "bound"]]
        lines.append(f"| {repeat} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Over repeats: median, min .. max, mean and its 95 % t-interval, number of repeats.",
        "",
        "| arm / sync | median | min .. max | mean | 95 % t-interval | n |",
        "|---|---|---|---|---|---|",
    ]
    for arm in [*arms, "bound"]:
        lines.append(f"| {arm} | {_spread_cells(spread(list(ratios[arm].values())))} |")
    tokens = paired(results, "tokens_per_s")
    lines += [
        "",
        "The same for response tokens trained per second (samples/s x mean response length: "
        "the arms' policies, hence their lengths, drift apart within a repeat).",
        "",
        "| arm / sync (tokens/s) | median | min .. max | mean | 95 % t-interval | n |",
        "|---|---|---|---|---|---|",
    ]
    for arm in arms:
        lines.append(f"| {arm} | {_spread_cells(spread(list(tokens[arm].values())))} |")
    per_token = {}
    for r in results:
        if r["generation_ms_per_token"] is not None:
            per_token.setdefault(r["arm"], []).append(r["generation_ms_per_token"])
    if per_token:
        cells = ", ".join(f"{a} {statistics.median(v):.2f}" for a, v in per_token.items())
        lines += [
            "",
            f"Generation per response token (ms, median over repeats): {cells} (where an async "
            "arm needs more than sync, the engine ran slower beside the trainer's computation).",
        ]
    lengths = [r["response_length"] for r in results if r["response_length"] is not None]
    if lengths:
        lines += [
            "",
            f"Response length (mean per run): {min(lengths):.1f} .. {max(lengths):.1f} tokens "
            f"(median {statistics.median(lengths):.1f}).",
        ]
    path.write_text("\n".join(lines) + "\n")
    return results, ratios


def plot(runs: Sequence[Run], path: Path, window: int, samples: dict[str, int]) -> None:
    """accuracy_vs_time.png: accuracy (trailing mean of ``window`` steps) and samples trained,
    both against seconds of steps; colour = arm, one line per repeat."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 7), layout="constrained")
    FigureCanvasAgg(figure)
    by_accuracy, by_samples = figure.subplots(2, 1, sharex=True)
    labelled = set()
    for run in runs:
        if run.failed:
            continue
        rows = [r for r in read_rows(run.metrics_path) if "time/step" in r]
        _, seconds, accuracy = curve(rows)
        smooth = trailing_mean(accuracy, window)
        colour = COLOURS.get(run.arm)
        label = None if run.arm in labelled else run.arm
        labelled.add(run.arm)
        points = [(x, m) for x, m in zip(seconds, smooth, strict=True) if m is not None]
        if points:
            by_accuracy.plot(*zip(*points, strict=True), color=colour, lw=1.5)
        clock, xs, ys = 0.0, [0.0], [0]
        for k, row in enumerate(rows, start=1):
            clock += float(row["time/step"])
            xs.append(clock)
            ys.append(k * samples[run.arm])
        by_samples.plot(xs, ys, color=colour, label=label, lw=1.5)  # always drawn: the legend
    by_accuracy.set_ylabel(f"accuracy (mean of last {window} steps)")
    by_accuracy.set_ylim(0, 1.02)
    by_samples.legend(fontsize=8, loc="lower right")
    by_accuracy.set_title("engine in its own process: sync vs async (one line per repeat)")
    by_samples.set_ylabel("samples trained")
    by_samples.set_xlabel("seconds of training steps")
    for ax in (by_accuracy, by_samples):
        ax.grid(alpha=0.3)
    figure.savefig(path, format="png", dpi=110)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    """End a process this tool started: SIGTERM, then SIGKILL after 10 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_one(run: Run, out: Path, flags: list[str], server: list[str], args) -> None:
    """The loopback server (its own process), then ``python -m megatron_rl.train`` against it;
    writes done.json when the trainer exits 0, else marks the run failed."""
    run_dir = run.metrics_path.parent
    done = run_dir / "done.json"
    name = f"{run.arm}-repeat{run.repeat}"
    if done.exists():
        recorded = json.loads(done.read_text())
        if recorded["flags"] != flags:
            raise SystemExit(f"{run_dir} was run with other flags: {recorded['flags']}")
        run.wall_s, run.load = recorded["wall_s"], recorded.get("load", [])
        print(f"{name}: done already", flush=True)
        return
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_cmd = [sys.executable, "-m", "megatron_rl.testing.loopback_server", "--port", str(port)]
    server_cmd += server
    command = [sys.executable, "-m", "megatron_rl.train", *flags, "--sglang-url", url]
    threads = {"OMP_NUM_THREADS": str(args.server_threads)}
    print(f"{name}: {shlex.join(server_cmd)} &\n  {shlex.join(command)}", flush=True)
    run.load = [os.getloadavg()[0]]
    with open(logs / f"{name}.server.log", "w") as server_log:
        engine = subprocess.Popen(
            server_cmd, stdout=server_log, stderr=subprocess.STDOUT, cwd=ROOT,
            env=dict(os.environ, **threads),
        )  # fmt: skip
        try:
            start = time.perf_counter()  # the trainer waits for the server's /health itself
            with open(logs / f"{name}.log", "w") as f:
                code = subprocess.call(
                    command, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                    env=dict(os.environ, OMP_NUM_THREADS=str(args.torch_threads)),
                )  # fmt: skip
            run.wall_s = time.perf_counter() - start
        finally:
            _stop(engine)
    run.load.append(os.getloadavg()[0])
    if code != 0:
        run.failed = f"exit {code}; see logs/{name}.log"
        print(f"{name}: FAILED ({run.failed})", flush=True)
        return
    done.write_text(json.dumps({"flags": flags, "wall_s": run.wall_s, "load": run.load}))
    print(f"{name}: {run.wall_s:.1f} s", flush=True)


def arm_order(arms: Sequence[str], repeat: int) -> list[str]:
    """Repeat ``r`` runs the arms rotated by ``r``: every arm is first in some repeat."""
    k = repeat % len(arms)
    return [*arms[k:], *arms[:k]]


def plan(args, extra: list[str]) -> tuple[list[tuple[Run, list[str], list[str]]], list[str]]:
    """The (run, trainer flags without the server's url, server flags) of every arm and repeat,
    interleaved; and a note for every arm the trainer refuses."""
    from megatron_rl.train.config import parse_args as train_args
    from megatron_rl.train.task import build_task

    name = metrics_file_name()
    planned, skipped, accepted = [], [], {}
    for repeat in range(args.repeats):
        seed = args.seed + repeat
        for arm in arm_order(args.arms, repeat):
            run_dir = args.out / arm / f"repeat{repeat}"
            flags = [
                # an unfinished run is run again; its rows are kept aside, not refused
                "--run-dir", str(run_dir), "--overwrite-run-dir", "--no-progress",
                "--seed", str(seed), "--torch-threads", str(args.torch_threads),
                "--rollout-engine", "sglang",
                "--weight-sync-transport", args.weight_sync_transport,
                "--sglang-startup-timeout", str(args.startup_timeout),
                *SETTING, *ARMS[arm], *extra,
            ]  # fmt: skip
            if args.train_iters is not None:
                flags += ["--train-iters", str(args.train_iters)]
            if accepted.get(arm) is False:
                continue
            try:  # the trainer's own validation, with a stand-in url
                config = train_args([*flags, "--sglang-url", "http://127.0.0.1:1"])
            except (SystemExit, ValueError) as err:
                if arm == "sync":
                    raise
                accepted[arm] = False
                skipped.append(f"arm {arm} skipped: the trainer refuses {ARMS[arm]} ({err})")
                continue
            accepted[arm] = True
            task = build_task(config.task)
            if task.checkpoint_dir is not None:
                raise SystemExit("the loopback server serves presets only: pass --model <preset>")
            server = [
                "--preset", config.task.model,
                "--vocab-size", str(task.hf_config.vocab_size),
                "--seed", str(seed),
                "--torch-threads", str(args.server_threads),
            ]  # fmt: skip
            per_step = config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
            planned.append((Run(arm, repeat, run_dir / name, per_step), flags, server))
    return planned, skipped


def parse_args(argv: Sequence[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_async"))
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234, help="repeat r uses seed + r")
    parser.add_argument("--torch-threads", type=int, default=1, help="the trainer's")
    parser.add_argument("--server-threads", type=int, default=1, help="the loopback server's")
    parser.add_argument("--train-iters", type=int, default=20)
    parser.add_argument("--weight-sync-transport", default="tensor")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--read", action="store_true", help="only summarise finished runs")
    parser.add_argument("extra", nargs="*", help="after --: more flags for every trainer run")
    args = parser.parse_args(argv)
    if "sync" not in args.arms:
        parser.error("--arms must include sync (the ratios are paired against it)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    # SIGTERM unwinds like an exception: the running trainer is killed, its server stopped
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    planned, skipped = plan(args, list(args.extra))
    runs = []
    for run, flags, server in planned:
        if args.read:
            done = run.metrics_path.parent / "done.json"
            if not done.exists():
                continue
            recorded = json.loads(done.read_text())
            run.wall_s, run.load = recorded["wall_s"], recorded.get("load", [])
        else:
            run_one(run, args.out, flags, server, args)
        runs.append(run)
    if not any(r.failed is None for r in runs):
        raise SystemExit(f"no finished run in {args.out}")
    note = (
        f"Every run: `python -m megatron_rl.train --rollout-engine sglang --torch-threads "
        f"{args.torch_threads} --weight-sync-transport {args.weight_sync_transport} "
        f"{shlex.join(SETTING)} --train-iters {args.train_iters}`"
        + (f" `{shlex.join(args.extra)}`" if args.extra else "")
        + " + the arm's flags, against its own `python -m megatron_rl.testing.loopback_server "
        f"--torch-threads {args.server_threads}` (OMP_NUM_THREADS set alike); seed {args.seed} "
        "+ repeat; one run at a time, arms interleaved and rotated per repeat."
    )
    write_summary(runs, args.out / "summary.md", args.window, note, skipped)
    samples = {r.arm: r.samples_per_step for r in runs}
    plot(runs, args.out / "accuracy_vs_time.png", args.window, samples)
    print((args.out / "summary.md").read_text(), flush=True)
    return 1 if any(r.failed for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
