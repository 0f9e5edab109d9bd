"""The runs of a study: one trainer process per (arm, seed), up to ``--jobs`` at once, each
finished run marked by ``done.json`` (its flags, wall time, peak RSS and the code's revision),
so that an interrupted study resumes; reading finished runs back, and their run records
(megatron_rl/study/records.py). ``megatron-rl study`` (megatron_rl/cli/study.py) drives it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron_rl.study import records

DONE = "done.json"
METRICS = "metrics.jsonl"


@dataclasses.dataclass
class Job:
    """One (arm, seed) run: ``flags`` are what the marker records (resume compares them)."""

    arm: str
    seed: int
    run_dir: Path
    log: Path
    flags: list[str]


def is_done(job: Job) -> bool:
    """A run is finished when its marker exists; a marker with other flags is an error."""
    marker = job.run_dir / DONE
    if not marker.exists():
        return False
    recorded = json.loads(marker.read_text())["flags"]
    if recorded != job.flags:
        raise SystemExit(
            f"{job.run_dir} finished with other flags than this study would pass:\n"
            f"  recorded: {shlex.join(recorded)}\n  now:      {shlex.join(job.flags)}\n"
            "use another --out for the new study (or delete that run folder to rerun it)"
        )
    return True


def _write_marker(job: Job, wall_s: float, peak_rss_kb: int, extra: dict) -> None:
    marker = {"flags": job.flags, "wall_s": wall_s, "peak_rss_mb": peak_rss_kb / 1024.0, **extra}
    tmp = job.run_dir / (DONE + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1))
    os.replace(tmp, job.run_dir / DONE)  # atomic: a marker is complete or absent


def run_jobs(
    jobs: Sequence[Job],
    max_parallel: int,
    command: Callable[[Job], list[str]],
    env: dict[str, str] | None = None,
    echo: Callable[[str], None] = lambda line: print(line, flush=True),  # noqa: T201 (progress)
    marker_extra: Callable[[], dict] | None = None,
) -> list[Job]:
    """Run the unfinished jobs, up to ``max_parallel`` at once; return the failed ones.

    A job's stale run directory (an interrupted run) is removed before it starts. Each child is
    reaped with ``os.wait4`` for its own peak RSS. ``marker_extra()``, called as each job
    starts, goes into its marker (the code's git revision then: a study that runs for hours
    sees commits land between its jobs).
    """
    if max_parallel < 1:
        raise ValueError(f"--jobs {max_parallel}: must be >= 1")
    pending = [job for job in jobs if not is_done(job)]
    echo(f"{len(jobs) - len(pending)} of {len(jobs)} runs already finished; {len(pending)} to run")
    running: dict[int, tuple[Job, subprocess.Popen, float]] = {}
    failed: list[Job] = []
    try:
        while pending or running:
            while pending and len(running) < max_parallel:
                job = pending.pop(0)
                if job.run_dir.exists():
                    shutil.rmtree(job.run_dir)
                job.log.parent.mkdir(parents=True, exist_ok=True)
                with job.log.open("w") as log:
                    proc = subprocess.Popen(
                        command(job), stdout=log, stderr=subprocess.STDOUT, env=env
                    )
                extra = marker_extra() if marker_extra is not None else {}
                running[proc.pid] = (job, proc, time.perf_counter(), extra)
                echo(f"started {job.arm} seed {job.seed}")
            pid, status, usage = os.wait4(-1, 0)
            if pid not in running:
                continue
            job, proc, start, extra = running.pop(pid)
            proc.returncode = os.waitstatus_to_exitcode(status)
            wall = time.perf_counter() - start
            if proc.returncode == 0 and (job.run_dir / METRICS).exists():
                _write_marker(job, wall, usage.ru_maxrss, extra)
                echo(f"finished {job.arm} seed {job.seed} in {wall:.0f} s")
            else:
                failed.append(job)
                echo(f"FAILED {job.arm} seed {job.seed} (exit {proc.returncode}); see {job.log}")
    finally:
        for _, proc, _, _ in running.values():  # interrupted: stop the children, no marker
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for _, proc, _, _ in running.values():
            with contextlib.suppress(ChildProcessError):
                proc.wait()
    return failed


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS
    if not path.exists():
        return []
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_records(jobs: Sequence[Job], folder: Path) -> int:
    """A record (megatron_rl/study/records.py) of every finished job in ``folder``; how many."""
    written = 0
    for job in jobs:
        if (job.run_dir / DONE).exists():
            marker = json.loads((job.run_dir / DONE).read_text())
            record = records.make_record(job.arm, job.seed, read_rows(job.run_dir), marker)
            try:
                records.write_record(record, folder)
            except ValueError as error:
                raise SystemExit(str(error)) from None
            written += 1
    return written


def refuse_recorded_reruns(jobs: Sequence[Job], folder: Path) -> None:
    """A record is never replaced, so a run the folder records must not train again elsewhere."""
    again = [j for j in jobs if (folder / records.record_name(j.arm, j.seed)).exists()]
    again = [job for job in again if not is_done(job)]
    if again:
        raise SystemExit(
            f"--records {folder} already holds {len(again)} of these runs (e.g. {again[0].arm} "
            f"seed {again[0].seed}) that {again[0].run_dir.parent.parent} has not finished; add "
            "new seeds with --first-seed, or use another --records folder"
        )


def read_arm(arm_dir: Path, seeds: Sequence[int]) -> list[tuple[list[dict], dict]]:
    """``(rows, marker)`` of every finished seed of an arm."""
    runs = []
    for seed in seeds:
        run_dir = arm_dir / f"seed{seed}"
        if (run_dir / DONE).exists():
            runs.append((read_rows(run_dir), json.loads((run_dir / DONE).read_text())))
    return runs
