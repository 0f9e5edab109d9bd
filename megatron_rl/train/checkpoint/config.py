"""Where a run saves and what it resumes from (megatron names: ``--save``, ``--load``, ...)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.flags import bad_value, check_choice, option

CKPT_FORMATS = ("torch", "torch_dist")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpoints: save folder, interval, format; the checkpoint to resume from."""

    save: str | None = option(None, help="checkpoint folder (step_<n>/ folders and 'latest')")
    load: str | None = option(
        None, help="a checkpoint root to resume from (may be the --save folder)"
    )
    save_interval: int = option(0, help="save every this many steps (0: only at the end)")
    load_fallback: bool = option(
        False,
        help="when --load's checkpoint is damaged (a file missing, truncated or failing its "
        "checksum; checkpoint.json lost or broken), load the newest older one that verifies",
    )
    load_ignore_existing: bool = option(
        False,
        help="start fresh although --load holds checkpoints (e.g. all of them damaged); they are "
        "deleted only once this run has saved a newer step",
    )
    ckpt_format: str = option(
        "torch",
        choices=CKPT_FORMATS,
        help="format of --save: torch (per-rank files, resume at the same layout) or torch_dist "
        "(megatron dist_checkpointing: resume at another TP/EP/PP/DP layout); --load reads "
        "either",
    )
    async_save: bool = option(
        False,
        help="torch_dist: write checkpoints in the background; a step folder is committed "
        "(checksums, 'latest') only once its write has finished",
    )

    def __post_init__(self) -> None:
        check_choice(self, "ckpt_format", CKPT_FORMATS)
        if self.save_interval < 0:
            raise bad_value(self, "save_interval", "must be >= 0")
        if self.async_save and self.ckpt_format != "torch_dist":
            raise ValueError(
                "--async-save needs --ckpt-format torch_dist (megatron dist_checkpointing's "
                "asynchronous writer); add it or drop --async-save"
            )
        if self.load_ignore_existing and self.load_fallback:
            raise ValueError(
                "--load-ignore-existing and --load-fallback contradict each other (start fresh, "
                "or load an older checkpoint); keep one"
            )
        if self.load_ignore_existing and not self.load:
            raise bad_value(
                self, "load_ignore_existing", "needs --load (there is nothing to ignore)"
            )
        if self.save_interval and not self.save:
            raise ValueError(
                f"--save-interval {self.save_interval} without --save: nothing would be saved; "
                "give --save DIR or drop --save-interval"
            )
