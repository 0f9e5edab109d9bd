"""The background writer of a ``torch_dist`` save (``--async-save``): megatron's asynchronous
write of the files, in forked processes that die with the trainer.

`torch_dist.save_sharded` with ``background=True`` calls megatron's
``dist_checkpointing.save(..., async_sharded_save=True)`` does everything collective at once (the
sharding validation, the optimizer gather, the save plan, ``common.pt``) and returns an
``AsyncRequest`` holding only the file writes; `BackgroundWrite` schedules it on an
``AsyncCallsQueue`` and later runs megatron's finalization (``.metadata``, ``metadata.json``) once
every rank's writer has finished. What the source of megatron-core 0.16.1 shows about the data
being written while training goes on:

* The queue is used non-persistent: ``TemporalAsyncCaller`` forks the training process for each
  save, so the writer reads a copy-on-write snapshot taken at the fork, inside `save_sharded`;
  the next optimizer step's in-place updates are not seen (memory grows by the pages it rewrites
  while the write runs). The persistent caller is not used: it is a spawned worker fed through a
  torch multiprocessing queue, which moves CPU tensors into shared memory, so the worker would
  read the live parameters.
* On GPU the request's ``preload_fn`` copies every tensor to host memory (and synchronizes)
  before the fork. On CPU that copy is a no-op; ``FileSystemWriterAsync`` clones only CPU tensors
  that are views of a larger storage, at planning time. Both happen before `save_sharded`
  returns, so either way the snapshot describes the step being saved.

Processes: megatron's writer starts some that a SIGKILLed trainer would leave behind (measured
on the tiny CPU run: a kill after the first async save left a ~295 MB Manager and
multiprocessing's resource tracker, 4 of 4 kills; a kill during a write left those, the writer
and its 2 workers). Each of them now dies with its parent (`megatron_rl.parent_death`, Linux
``PR_SET_PDEATHSIG``; `tests/train/test_async_save_orphans.py`):

* the write-results queue (``filesystem_async._results_queue``) lives in a ``spawn``-ed
  multiprocessing Manager that megatron creates on the first save and never stops before exit;
  `results_queue_dies_with_us` creates it first, the same way, with a Manager that has
  `die_with_parent` as its initializer;
* the writer (forked per save by ``TemporalAsyncCaller``) and its workers (forked by the writer,
  or by the trainer itself in a synchronous save) are forked inside `forks_die_with_parent`;
* the resource tracker (started by the Manager's spawn) exits by itself once every process
  holding its pipe has exited.

A normal exit stops the Manager (multiprocessing's exit handler) after the last save committed.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.managers import SyncManager

from megatron_rl.parent_death import die_with_parent

_MANAGERS: list[SyncManager] = []  # the write-results Manager, alive until this process exits


def results_queue_dies_with_us() -> None:
    """Create megatron-core 0.16.1's write-results queue before megatron does (its
    ``_get_write_results_queue``: a queue in a ``spawn`` Manager), in a Manager process that is
    killed when this process (the thread calling this: the trainer's main thread) exits."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is not None:
        return  # created already, or another megatron version (then its own)
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    _MANAGERS.append(manager)
    filesystem_async._results_queue = manager.Queue()


class BackgroundWrite:
    """megatron's asynchronous write of one `save_sharded` call, in a forked process per rank."""

    def __init__(self, request) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        # non-persistent: a fork per save, whose memory is the snapshot (see the module docstring)
        self._queue = AsyncCallsQueue(persistent=False)
        self._queue.schedule_async_request(request)

    def finished(self, wait: bool) -> bool:
        """Collective: whether every rank's writer has finished (``wait``: block until then).

        When they have, megatron's finalization runs (``.metadata`` and ``metadata.json`` are
        written); a write that failed on any rank raises on every rank.
        """
        if self._queue.get_num_unfinalized_calls():
            self._queue.maybe_finalize_async_calls(blocking=wait)
        return self._queue.get_num_unfinalized_calls() == 0

    def abandon(self) -> None:
        """Local (no collective): wait for this rank's writer process; finalize nothing.

        The writer left its results in megatron's process-wide results queue, which the next
        save of this process (synchronous ones too) reads as its own: they are drained, or that
        save's metadata would describe the abandoned write's files (a corrupted checkpoint).
        """
        while self._queue.async_calls:
            self._queue.async_calls.popleft().async_caller.close()
        _drain_write_results()


def _drain_write_results() -> None:
    """Empty megatron-core 0.16.1's module-level write-results queue (``filesystem_async``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    while queue is not None and not queue.empty():
        queue.get_nowait()
