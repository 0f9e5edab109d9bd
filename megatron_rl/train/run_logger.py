"""Per-step metrics to ``run_dir/metrics.jsonl``, to wandb, to TensorBoard and to a console
progress line.

Only the main rank logs (the trainer reduces metrics over ranks first). Each `RunLogger.log` call
appends one flushed JSON line ``{"step": ..., **metrics}``; values that are not finite are
written as ``null`` and logged as a warning naming the metric, so a NaN never passes silently.
Resuming at ``initial_step`` drops the lines logged after that checkpoint, so the file holds
every step once. Rows are never deleted otherwise: a fresh run (``initial_step`` 0) keeps an
older file as ``metrics.jsonl.<UTC time>.bak`` (`set_aside`), and `claim_run_dir` refuses a
fresh run into a run dir holding rows unless ``--overwrite-run-dir`` is given. With
``--tensorboard-dir`` each row is also a set of TensorBoard scalars under the same names, at the
same step (`megatron_rl.train.tensorboard_writer`).
`megatron_rl.train.learning_curve` draws chosen metrics from the file as an SVG.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch

from megatron_rl.atomic_io import atomic_write_text
from megatron_rl.flags import bad_value, derived, option
from megatron_rl.train.run_lock import RunFolderError

if TYPE_CHECKING:  # imported where --tensorboard-dir is given: a run without it loads nothing
    from megatron_rl.train.tensorboard_writer import TensorBoardWriter

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RUN_CONFIG_FILE = "run_config.json"
WANDB_ID_FILE = "wandb_run_id"
_WANDB_MODES = ("offline", "online", "disabled")
DEFAULT_RUN_DIR = os.path.join(
    "runs", f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"
)
"""This process's default ``--run-dir``: ``runs/<UTC start time>-<pid>``, a new one per run."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunLoggerConfig:
    """Where metrics go. ``wandb_project=None`` or ``wandb_mode="disabled"`` turns wandb off;
    ``tensorboard_dir=None`` (the default) writes no TensorBoard events."""

    run_dir: str = option(
        DEFAULT_RUN_DIR,
        help="metrics.jsonl, run_config.json, plots (default: runs/<UTC start time>-<pid>, a "
        "new folder per run; pass it to resume into the same folder)",
    )
    overwrite_run_dir: bool = option(
        False,
        help="let a fresh run (no checkpoint resumed) use a --run-dir whose metrics.jsonl holds "
        "rows: the old file is kept as metrics.jsonl.<UTC time>.bak, nothing is deleted",
    )
    total_steps: int = derived(0, source="schedule.train_iters")
    wandb_project: str | None = option(None, help="log to wandb under this project")
    wandb_mode: str = option("offline", choices=_WANDB_MODES, help="wandb mode")
    wandb_run_name: str | None = option(None, name="wandb-exp-name", help="wandb run name")
    tensorboard_dir: str | None = option(
        None,
        help="also write every metric as a TensorBoard scalar (same names as metrics.jsonl, x = "
        "step) into this folder, with a 'timeline' chart of the time/* phases (custom scalars)",
    )
    headline: tuple[str, ...] = ("reward/mean", "accuracy", "response_length/mean", "time/step")
    show_progress: bool = option(True, name="no-progress", help="no console progress bar")

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise ValueError("RunLoggerConfig.run_dir='': give the folder for metrics.jsonl")
        if not isinstance(self.total_steps, int) or self.total_steps < 0:
            raise ValueError(f"RunLoggerConfig.total_steps={self.total_steps!r}: must be int >= 0")
        if self.tensorboard_dir is not None and not self.tensorboard_dir:
            raise bad_value(self, "tensorboard_dir", "give a folder, or leave it out (None)")
        if self.wandb_mode not in _WANDB_MODES:
            raise ValueError(
                f"RunLoggerConfig.wandb_mode={self.wandb_mode!r}: must be one of {_WANDB_MODES}"
            )
        if isinstance(self.headline, str) or not all(isinstance(k, str) for k in self.headline):
            raise ValueError(
                f"RunLoggerConfig.headline={self.headline!r}: must be a tuple of metric names"
            )


class RunLogger:
    """Metrics sink for one run; use as a context manager (or call `close`)."""

    def __init__(
        self,
        config: RunLoggerConfig,
        *,
        run_config: dict | None = None,
        is_main: bool = True,
        initial_step: int = 0,
    ) -> None:
        self.config = config
        self.is_main = is_main
        self.path = os.path.join(config.run_dir, METRICS_FILE)
        self._file = None
        self._wandb_run = None
        self._tensorboard: TensorBoardWriter | None = None
        self._progress: _Progress | None = None
        if not is_main:
            return
        try:
            self._open(run_config, initial_step)
        except BaseException:
            self.close()  # what was opened before the failure
            raise

    def _open(self, run_config: dict | None, initial_step: int) -> None:
        config = self.config
        os.makedirs(config.run_dir, exist_ok=True)
        _drop_lines_after(self.path, initial_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if run_config is not None:
            text = json.dumps(run_config, indent=2, sort_keys=True, default=str)
            atomic_write_text(os.path.join(config.run_dir, RUN_CONFIG_FILE), text)
        if config.tensorboard_dir is not None:
            from megatron_rl.train.tensorboard_writer import TensorBoardWriter

            self._tensorboard = TensorBoardWriter(
                config.tensorboard_dir, initial_step=initial_step, run_config=run_config
            )
        self._wandb_run = _init_wandb(config, run_config, resuming=initial_step > 0)
        if config.show_progress:
            self._progress = _Progress(config, initial_step)

    def log(self, step: int, metrics: dict[str, float | int | torch.Tensor]) -> None:
        """Append ``{"step": step, **metrics}`` to the JSONL file, wandb, TensorBoard and the
        progress line.

        Values are Python numbers, numpy scalars or one-element tensors (``.item()`` is taken).
        """
        if not self.is_main:
            return
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: must be an int >= 0")
        if self._file is None:
            raise RuntimeError(f"RunLogger for {self.config.run_dir} is closed")
        numbers = {key: _to_number(key, value) for key, value in metrics.items()}
        if numbers.pop("step", step) != step:
            raise ValueError(f"metrics['step']={metrics['step']!r} differs from step={step}")
        record: dict[str, Any] = {"step": step}
        for key, number in numbers.items():
            if math.isfinite(number):
                record[key] = number
            else:
                logger.warning("metric %r is %s at step %d; written as null", key, number, step)
                record[key] = None
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(numbers, step=step)
        if self._tensorboard is not None:
            self._tensorboard.log(step, numbers)
        if self._progress is not None:
            self._progress.update(step, record)

    def close(self) -> None:
        """Flush and close the file and the TensorBoard events, finish the wandb run, stop the
        progress bar (idempotent)."""
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl file; an unparsable line (a crash mid-write) is skipped."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                logger.warning(
                    "%s:%d is not valid JSON (interrupted write?); skipped", path, number
                )
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


def _to_number(key: str, value: Any) -> float | int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r}: tensor of shape {tuple(value.shape)}; log a scalar")
        value = value.item()
    elif hasattr(value, "item") and getattr(value, "shape", None) == ():  # numpy scalar
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return value
    raise ValueError(f"metric {key!r}: {type(value).__name__} is not a number")


def claim_run_dir(config: RunLoggerConfig, *, resumed: bool, auto_resume: bool = False) -> None:
    """Start-up check of ``run_dir`` (global rank 0, under its lock): a fresh run into a run dir
    whose metrics.jsonl holds rows is a `RunFolderError` naming the fixes; so is a
    ``--tensorboard-dir`` that is a file or cannot be written (`check_tensorboard_dir`).

    ``resumed``: a checkpoint is resumed (its rows up to that step are kept, see `RunLogger`).
    The old rows are kept aside instead (`set_aside`) with ``--overwrite-run-dir``, or when
    ``auto_resume`` (``--load`` is the ``--save`` folder and holds nothing yet: a requeued job
    that died before its first save cannot be given a flag).
    """
    if config.tensorboard_dir is not None:
        from megatron_rl.train.tensorboard_writer import check_tensorboard_dir

        check_tensorboard_dir(config.tensorboard_dir)
    path = os.path.join(config.run_dir, METRICS_FILE)
    if resumed or not _holds_rows(path):
        return
    if config.overwrite_run_dir or auto_resume:
        kept = set_aside(path)
        why = "--overwrite-run-dir" if config.overwrite_run_dir else "nothing to resume yet"
        logger.warning("%s: a fresh run (%s); the old rows are kept in %s", path, why, kept)
        return
    rows = len(read_metrics(path))
    raise RunFolderError(
        f"--run-dir {config.run_dir} already holds an earlier run's metrics ({rows} rows in "
        f"{METRICS_FILE}) and this run resumes no checkpoint: pass another --run-dir, or "
        f"--overwrite-run-dir to keep the old file as {METRICS_FILE}.<UTC time>.bak and start "
        "anew, or --load that run's --save folder to continue it"
    )


def set_aside(path: str) -> str:
    """Rename ``path`` (and the run_config.json beside it) to ``<name>.<UTC time>.bak``; returns
    the new name of ``path``. Nothing is deleted."""
    folder = os.path.dirname(path) or "."
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    suffix, number = stamp, 1
    while os.path.exists(f"{path}.{suffix}.bak"):  # two fresh runs within one second
        suffix, number = f"{stamp}-{number}", number + 1
    kept = f"{path}.{suffix}.bak"
    os.replace(path, kept)
    run_config = os.path.join(folder, RUN_CONFIG_FILE)
    if os.path.exists(run_config):  # the old rows' settings go with them
        os.replace(run_config, f"{run_config}.{suffix}.bak")
    return kept


def _holds_rows(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return any(line.strip() for line in handle)
    except FileNotFoundError:
        return False


def _drop_lines_after(path: str, initial_step: int) -> None:
    """Keep the lines with 0 < ... step <= initial_step; a fresh run (0) keeps an older file
    aside (`set_aside`) and starts an empty one."""
    if not os.path.exists(path):
        return
    if initial_step <= 0:
        if _holds_rows(path):
            logger.warning("%s: a fresh run; the old rows are kept in %s", path, set_aside(path))
        return
    kept = [r for r in read_metrics(path) if r["step"] <= initial_step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))


def _init_wandb(config: RunLoggerConfig, run_config: dict | None, *, resuming: bool):
    """A wandb run in ``run_dir/wandb``; a resumed run continues the id saved in run_dir."""
    if config.wandb_project is None or config.wandb_mode == "disabled":
        return None
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(
            f"RunLoggerConfig.wandb_project={config.wandb_project!r} needs wandb: "
            "pip install 'wandb>=0.19', or set wandb_project=None"
        ) from exc
    id_path = os.path.join(config.run_dir, WANDB_ID_FILE)
    run_id = None
    if resuming and os.path.exists(id_path):
        with open(id_path, encoding="utf-8") as handle:
            run_id = handle.read().strip() or None
    run_id = run_id or uuid.uuid4().hex[:12]  # wandb ids: [a-z0-9]; no wandb-private helper
    atomic_write_text(id_path, run_id)
    return wandb.init(
        project=config.wandb_project,
        name=config.wandb_run_name,
        id=run_id,
        resume="allow",
        dir=config.run_dir,
        mode=config.wandb_mode,
        config=run_config,
    )


def _may_be_terminal() -> bool:
    """False only where rich's ``Console().is_terminal`` is False too (stdout not a TTY and no
    FORCE_COLOR / TTY_COMPATIBLE override), so that CI and log files skip importing rich."""
    if any(key in os.environ for key in ("FORCE_COLOR", "TTY_COMPATIBLE")):
        return True
    isatty = getattr(sys.stdout, "isatty", None)
    try:
        return isatty is not None and isatty()
    except ValueError:  # closed stdout
        return False


class _Progress:
    """A rich progress bar on a terminal; one log line per step when stdout is not a TTY (CI)."""

    def __init__(self, config: RunLoggerConfig, initial_step: int) -> None:
        self.config = config
        self._bar = None
        if not _may_be_terminal():
            return
        from rich.console import Console

        console = Console()
        if console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[headline]}"),
                console=console,
            )
            self._task = self._bar.add_task(
                "train", total=config.total_steps, completed=initial_step, headline=""
            )
            self._bar.start()

    def headline(self, record: dict) -> str:
        parts = []
        for key in self.config.headline:
            if key in record:
                value = record[key]
                parts.append(f"{key}={'nan' if value is None else format(value, '.4g')}")
        return "  ".join(parts)

    def update(self, step: int, record: dict) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, headline=self.headline(record))
        else:
            logger.info("step %d/%d  %s", step, self.config.total_steps, self.headline(record))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
