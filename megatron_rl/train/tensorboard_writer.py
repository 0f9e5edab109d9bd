"""Per-step metrics as TensorBoard scalars (``--tensorboard-dir``), beside metrics.jsonl and wandb.

The layout follows Megatron-LM's ``--tensorboard-dir`` and the trackers of slime and verl: one
scalar per metric, tagged with the metric's own name (``policy/loss``, ``time/step``: the names
of the JSONL rows and of wandb), its x axis the global step (the ``step`` of the JSONL row), written
by global rank 0 only (`RunLogger` is the only caller). The event files go straight into the
folder the user named (no sub-folder per run).

A per-step timeline: every ``time/*`` metric of a step (rollout, old_logprob, update, sync, and
whichever phases a mode adds: generation, engine_idle, eval, ...) is one scalar under ``time/``,
and a custom-scalars layout (`TIMELINE_LAYOUT`, TensorBoard's "Custom Scalars" tab) draws them
all in one chart, seconds against the step, so a slow phase stands out next to ``time/step``.

Each step is flushed when it is written; `close` (reached on errors too, through `RunLogger`)
closes the file. A resumed run continues the same curves: the writer starts with TensorBoard's
purge mark at ``initial_step + 1``, so the points an earlier attempt wrote after the resumed
checkpoint are hidden (the JSONL drops those rows); a fresh run marks step 0, hiding an older
run's points in the same folder. Nothing on disk is deleted.

``tensorboard`` (``torch.utils.tensorboard``) is imported only when a writer is made: a run
without ``--tensorboard-dir`` never imports it.
"""

from __future__ import annotations

import importlib.util
import json
import os

from megatron_rl.train.run_lock import RunFolderError, probe_writable

FLAG = "--tensorboard-dir"
TIMELINE_LAYOUT = {
    "timeline": {
        "time/* per step (seconds)": ["Multiline", [r"^time/"]],
    }
}
"""TensorBoard custom-scalars layout: one "timeline" chart of every ``time/*`` tag (a regex, so
phases that only some modes report join the chart too)."""


def check_tensorboard_dir(folder: str) -> None:
    """Start-up check (global rank 0, before the model is built): ``folder`` is, or can be
    created as, a writable folder, and ``tensorboard`` is installed; `RunFolderError` naming
    ``--tensorboard-dir`` otherwise. Imports nothing from tensorboard."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise RunFolderError(
            f"{FLAG} {folder} is a file, not a folder: pass a folder for the TensorBoard event "
            "files (it is created if missing)"
        )
    probe_writable(folder, FLAG)
    if importlib.util.find_spec("tensorboard") is None:
        raise RunFolderError(
            f"{FLAG} {folder} needs the tensorboard package: pip install 'tensorboard>=2.14', "
            f"or drop {FLAG}"
        )


class TensorBoardWriter:
    """The run's TensorBoard event file in ``folder``; `log` one step at a time, then `close`.

    ``initial_step``: the step the run resumed at (0 for a fresh run); points after it that an
    earlier attempt wrote into ``folder`` are hidden (TensorBoard's ``purge_step``).
    """

    def __init__(
        self, folder: str, *, initial_step: int = 0, run_config: dict | None = None
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                f"{FLAG} {folder} needs the tensorboard package: pip install "
                f"'tensorboard>=2.14', or drop {FLAG}"
            ) from exc
        purge_step = initial_step + 1 if initial_step > 0 else 0
        self.folder = folder
        self._writer = SummaryWriter(log_dir=folder, purge_step=purge_step)
        self._writer.add_custom_scalars(TIMELINE_LAYOUT)
        if run_config is not None:
            text = json.dumps(run_config, indent=2, sort_keys=True, default=str)
            self._writer.add_text("run_config", f"```\n{text}\n```", global_step=initial_step)
        self._writer.flush()

    def log(self, step: int, numbers: dict[str, float | int]) -> None:
        """One scalar per metric, ``tag = name``, at x = ``step``; flushed before returning.

        Non-finite values are written as they are (TensorBoard shows NaN/inf points);
        metrics.jsonl holds them as ``null``.
        """
        if self._writer is None:
            raise RuntimeError(f"TensorBoardWriter for {self.folder} is closed")
        for name, value in numbers.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
