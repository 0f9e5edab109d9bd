"""The training run: steps, logging, checkpoints, preemption, the learning-curve picture.

Stop signals are handled from the first line (before the model is built): a SIGTERM during
start-up ends the run with status 0 before the first step; later ones are served within one
update (see `Trainer.step`). Every stop saves the last consistent state when ``--save`` is set,
and says so when it is not. A step is saved at most once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from typing import TYPE_CHECKING

import torch.distributed as dist

from megatron_rl import stop_signal
from megatron_rl.lazy_exports import lazy_getattr
from megatron_rl.train.checkpoint.folders import choose_step, step_folders
from megatron_rl.train.checkpoint.load import load_training_state
from megatron_rl.train.checkpoint.save import save_training_state, start_async_save
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.evaluation import Evaluator
from megatron_rl.train.learning_curve import plot_learning_curve
from megatron_rl.train.preemption import PreemptionHandler
from megatron_rl.train.run_lock import hold_run_folders, launch_rank
from megatron_rl.train.run_logger import RunLogger, claim_run_dir
from megatron_rl.train.task import Task, add_eval_sets, build_task

if TYPE_CHECKING:
    from megatron_rl.train.trainer import Trainer

# `Trainer` (megatron-core and the model) is imported when `run` builds one, after ``--load``
# and the run folders are checked: their errors answer without megatron. It stays an attribute
# of this module (tests stand in for it there).
__getattr__ = lazy_getattr(__name__, {"Trainer": "megatron_rl.train.trainer"}, globals())

logger = logging.getLogger(__name__)

_STEP_FOLDER = re.compile(r"step_(\d{8})")
_RESOLVE = object()  # `run`'s ``load`` when the caller did not resolve ``--load``


class TrainingStopped(RuntimeError):
    """The run cannot go on: too many consecutive non-finite updates (`NonFiniteGuard`), or
    steps without a learning signal or with a failing reward (`LearningGuard`); the last state
    was saved (with ``--save``)."""


def resolve_load(config: TrainConfig) -> tuple[str, int | None] | None:
    """``(checkpoint root, step or None for the latest)`` of ``--load``, or None to start fresh.

    A missing path or one without a checkpoint is an error, unless it is the ``--save`` folder
    (auto-resume: the first run starts fresh). A step folder (``root/step_00000100``) is loaded as
    that step of its root. A checkpoint to load whose folder is damaged (`choose_step`: records,
    sizes; the sha256s are checked at load) stops the run here, before anything is built, with
    the list of step folders found and why each cannot be loaded; ``--load-fallback`` and
    ``--load-ignore-existing`` go on (the latter starts fresh and leaves the folders to pruning,
    which removes none before this run has saved a newer step).
    """
    ckpt = config.checkpoint
    if not ckpt.load:
        return None
    path = os.path.normpath(ckpt.load)
    same_as_save = ckpt.save is not None and path == os.path.normpath(ckpt.save)
    match = _STEP_FOLDER.fullmatch(os.path.basename(path))
    if match and os.path.isdir(path):
        root, step = os.path.dirname(path) or ".", int(match[1])
        logger.info("--load names a step folder: loading step %d of %s", step, root)
    elif os.path.isdir(path):
        root, step = path, None
    elif same_as_save:
        logger.info("no checkpoint in %s yet: starting fresh", path)
        return None
    else:
        raise ValueError(
            f"--load {ckpt.load} does not exist: pass a checkpoint root (the --save folder of an "
            "earlier run, holding step_XXXXXXXX folders) or one of its step folders, or drop --load"
        )
    if ckpt.load_ignore_existing:
        found = step_folders(root)
        logger.warning(
            "--load-ignore-existing: starting fresh; the step folders in %s (%s) are kept until "
            "this run has saved a newer step",
            root, ", ".join(map(str, found)) or "none",
        )  # fmt: skip
        return None
    if choose_step(root, step, fallback=ckpt.load_fallback) is not None:
        return root, step
    if same_as_save:
        logger.info("no checkpoint in %s yet: starting fresh", path)
        return None
    raise ValueError(
        f"--load {ckpt.load} holds no complete checkpoint: pass a checkpoint root (the --save "
        "folder of an earlier run, holding step_XXXXXXXX folders) or one of its step folders, or "
        "drop --load"
    )


def run(
    config: TrainConfig,
    *,
    task: Task | None = None,
    load: object = _RESOLVE,  # `resolve_load`'s answer: (root, step or None) or None
    **dist_kwargs,
) -> dict:
    """Train for ``config.schedule.train_iters`` steps; returns the last step's metrics.

    ``task``: the built task (`build_task`), else the trainer builds it. ``load``: what
    `resolve_load` answered, when the caller resolved ``--load`` already (``python -m
    megatron_rl.train`` does, before megatron starts); else it is resolved here.

    Global rank 0 first probes ``--save`` for writing and locks it and ``--run-dir`` for the
    run's life (`hold_run_folders`), and refuses a fresh run into a run dir holding metrics
    (`claim_run_dir`): `RunFolderError`, before megatron builds anything.
    """
    if load is _RESOLVE:
        load = resolve_load(config)  # a bad --load fails before anything is built
    with contextlib.ExitStack() as stack:
        preemption = stack.enter_context(PreemptionHandler())
        if launch_rank(dist_kwargs.get("rank")) == 0:  # released after the last save commits
            stack.enter_context(
                hold_run_folders(save=config.checkpoint.save, run_dir=config.logging.run_dir)
            )
            claim_run_dir(
                config.logging, resumed=load is not None, auto_resume=bool(config.checkpoint.load)
            )
        if config.eval.enabled:  # the held-out sets, built with the task (before the model)
            if task is None:
                task = build_task(config.task, config.eval)
            elif not task.eval_sets:
                task = add_eval_sets(task, config.task, config.eval)
        try:
            trainer = _trainer_class()(config, task=task, **dist_kwargs)
        except stop_signal.StopRequested as stop:  # e.g. while the servers were still loading
            logger.warning("%s", stop)
            return {}
        stack.callback(trainer.close)
        saver = stack.enter_context(_Saver(trainer, config))  # commits before trainer.close
        if load is not None:
            root, step = load
            state = load_training_state(
                root,
                model=trainer.model,
                optimizer=trainer.optimizer,
                step=step,
                fallback=config.checkpoint.load_fallback,
            )
            trainer.load_state_dict(state)
            saver.saved_step = trainer.step_index  # that step is on disk already
            logger.info("resumed from %s at step %d", root, trainer.step_index)
        if preemption.agreed():
            logger.warning("stop signal during start-up: exiting before the first step")
            return {}
        evaluator = Evaluator.for_trainer(trainer, task) if config.eval.enabled else None
        return _train(trainer, config, preemption, saver, evaluator)


def _write_peft_adapter(trainer: Trainer, folder: str) -> None:
    """Collective: the policy's adapters in PEFT's format at ``folder`` (rank 0 writes)."""
    from megatron_rl.lora.peft_export import save_peft_adapter

    base = trainer.lora_base["path"] or ""  # a base drawn from --seed has no folder
    save_peft_adapter(trainer.model.module, trainer.hf_config, folder, base_model=base)
    logger.info("LoRA adapters in PEFT's format: %s (base %s)", folder, base or "seeded")


def _trainer_class() -> type[Trainer]:
    """This module's `Trainer`: imported on first use, or the stand-in set here."""
    return globals().get("Trainer") or __getattr__("Trainer")


def _train(
    trainer: Trainer,
    config: TrainConfig,
    preemption,
    saver: _Saver,
    evaluator: Evaluator | None = None,
) -> dict:
    """The step loop. ``evaluator`` (`megatron_rl.train.evaluation`): evaluate after every
    ``--eval-interval``-th step (its metrics join that step's row) and, with
    ``--eval-before-train`` on a fresh start, before the first step (a row at step 0); skipped
    when a stop signal is pending (the stop is served first)."""
    last: dict = {}
    is_main = dist.get_rank() == 0
    run_config = dataclasses.asdict(config)
    logging_config, plotted = config.logging, ("accuracy", "reward/mean")
    if evaluator is not None:
        logging_config = dataclasses.replace(
            logging_config, headline=logging_config.headline + evaluator.headline
        )
        plotted += evaluator.headline
    with RunLogger(
        logging_config,
        run_config=run_config,
        is_main=is_main,
        initial_step=trainer.step_index,
    ) as run_logger:
        if evaluator is not None and config.eval.eval_before_train and trainer.step_index == 0:
            run_logger.log(0, evaluator.evaluate(0))
        while trainer.step_index < config.schedule.train_iters:
            metrics = trainer.step(should_stop=preemption.agreed)
            if metrics is None:  # stopped after the rollout: the last step is the state
                saver.save_and_stop("stop signal")
                return last
            last = metrics
            if evaluator is not None and config.eval.due(trainer.step_index):
                if preemption.agreed():
                    logger.warning("stop signal: step %d is not evaluated", trainer.step_index)
                else:
                    last = {**metrics, **evaluator.evaluate(trainer.step_index)}
            saver.poll()
            run_logger.log(trainer.step_index, last)
            if trainer.nonfinite.exhausted:
                saver.save_and_stop("non-finite updates")
                raise TrainingStopped(trainer.nonfinite.stop_message(trainer.step_index))
            if trainer.learning.exhausted:  # see megatron_rl/train/learning_guard.py
                saver.save_and_stop("the run cannot learn")
                raise TrainingStopped(trainer.learning.stop_message(trainer.step_index))
            interval = config.checkpoint.save_interval
            if interval and trainer.step_index % interval == 0:
                saver.save()
            if preemption.agreed():
                saver.save_and_stop("stop signal")
                return last
        saver.save()
        saver.wait()
        if config.lora.enabled:  # the trained adapters as PEFT loads them (lora/peft_export.py)
            _write_peft_adapter(trainer, os.path.join(config.logging.run_dir, "peft_adapter"))
    if is_main:
        metrics_path = os.path.join(config.logging.run_dir, "metrics.jsonl")
        if os.path.exists(metrics_path):
            plot_learning_curve(
                metrics_path, os.path.join(config.logging.run_dir, "learning_curve.svg"), plotted
            )
    return last


class _Saver:
    """Saves the trainer's state at most once per step (never a second copy of a step).

    With ``--async-save`` the files are written in the background: `poll` commits a finished
    write after each step, a new save or `wait` commits the one in flight first, and leaving the
    context commits it (or, on an exception, waits for this rank's writer and commits nothing:
    the other ranks may not be able to join a collective).
    """

    def __init__(self, trainer: Trainer, config: TrainConfig) -> None:
        self.trainer = trainer
        self.config = config
        self.saved_step: int | None = None
        self.pending = None  # the background save in flight (checkpoint.save.PendingSave)

    def __enter__(self) -> _Saver:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self.pending is None:
            return
        if exc_type is None:
            self.wait()
        else:
            self.pending.abandon()
            self.pending = None

    def save(self) -> None:
        if not self.config.checkpoint.save or self.saved_step == self.trainer.step_index:
            return
        self.wait()
        kwargs = dict(
            model=self.trainer.model,
            optimizer=self.trainer.optimizer,
            rl_state=self.trainer.state_dict(),  # snapshotted now, with the tensors
        )
        if self.config.checkpoint.async_save:
            self.pending = start_async_save(
                self.config.checkpoint.save, self.trainer.step_index, **kwargs
            )
        else:
            save_training_state(
                self.config.checkpoint.save,
                self.trainer.step_index,
                fmt=self.config.checkpoint.ckpt_format,
                **kwargs,
            )
        self.saved_step = self.trainer.step_index

    def poll(self) -> None:
        """Collective: commit the background save if every rank's write has finished."""
        if self.pending is not None and self.pending.try_finalize() is not None:
            self.pending = None

    def wait(self) -> None:
        """Collective: wait for the background save in flight, if any, and commit it."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.finalize()

    def save_and_stop(self, why: str) -> None:
        step = self.trainer.step_index
        if self.config.checkpoint.save:
            logger.warning(
                "%s: saving step %d to %s and exiting", why, step, self.config.checkpoint.save
            )
        else:
            logger.warning("%s: exiting at step %d (no --save: nothing is saved)", why, step)
        self.save()
        self.wait()
