"""Multi-rank tests' rank processes, forked from one pre-imported process per test worker.

``torch.multiprocessing.spawn`` starts every rank as a new interpreter that imports torch,
megatron-core and this package again: 3-4 CPU-seconds a rank before its first line of test code,
about 190 ranks in the suite (measured on a 2-core Xeon: ~11 CPU-minutes of the suite's ~40).
`start_ranks` starts them with multiprocessing's ``forkserver`` instead: the server is started
once per pytest worker with those modules imported (`rank_preload`, megatron's fusions eager as
in the CLI) and each rank is a fork of it. The server never runs a torch kernel, so a rank's
OpenMP and thread pools start fresh as in a spawned one; what a rank imports, unpickles and runs
is what it would under ``spawn`` (the same preparation: ``sys.path``, working directory).

One difference a test could see is handled: a forked rank would inherit the server's environment
(from the server's start), so each rank takes the environment of the test at the moment it is
started, as a spawned one does.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from unittest import mock

import torch.multiprocessing

PRELOAD = ["rank_preload"]
TESTS = os.path.dirname(os.path.abspath(__file__))
PRELOAD_PATH = [TESTS, os.path.join(TESTS, "model")]  # rank_preload and the helpers it imports


def forkserver_context() -> multiprocessing.context.BaseContext:
    """multiprocessing's ``forkserver`` context, its server running and preloaded with
    `rank_preload`. A process started from it inherits the server's environment, not the test's:
    `start_ranks` carries the test's over, for tests that set variables."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    _start_preloaded_server()
    return context


def _start_preloaded_server() -> None:
    """Start this process's forkserver (once) where it can import `rank_preload`.

    Python 3.11's forkserver ignores the ``sys_path`` it is handed and imports its preload list
    with the interpreter's default path, swallowing the ``ImportError``: from tests/ the preload
    was never found and every rank imported transformers, the test helpers and their imports
    itself. The server is started with tests/ and tests/model on ``PYTHONPATH``, and refuses to
    run without its preload (a rank's ``sys.path`` and working directory are the test's, set by
    multiprocessing when it starts the rank)."""
    path = os.pathsep.join([*PRELOAD_PATH, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with mock.patch.dict(os.environ, PYTHONPATH=path):  # the server's only; restored after
        multiprocessing.forkserver.ensure_running()  # a no-op while it runs


def start_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with ranks forked from the preloaded
    server: ``fn(rank, *args)`` on ``nprocs`` processes, joined; a rank's exception is raised."""
    forkserver_context()
    torch.multiprocessing.start_processes(
        _with_environ,
        args=(fn, dict(os.environ), args),
        nprocs=nprocs,
        join=True,
        start_method="forkserver",
    )


def _with_environ(rank: int, fn: Callable, environ: dict, args: tuple) -> None:
    if not all(name in sys.modules for name in PRELOAD):
        raise RuntimeError(f"this rank's forkserver did not import {PRELOAD} (see forked_ranks)")
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)
