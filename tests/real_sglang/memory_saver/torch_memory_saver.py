"""A CPU stand-in for ``torch_memory_saver`` (CUDA only), for the colocated launcher's rehearsal.

SGLang 0.5.23 imports ``torch_memory_saver`` when a server starts with ``--enable-memory-saver``
(``sglang/srt/utils/torch_memory_saver_adapter.py``) and fails when it is missing; the colocated
launcher always passes that flag (``serve --memory-saver``). The real package reserves CUDA
virtual memory per tag and unmaps it on ``pause``; nothing of that exists on CPU. This stand-in
keeps the interface the adapter calls (``region``, ``cuda_graph``, ``disable``, ``pause``,
``resume``, ``enabled``, module-level ``configure_subprocess``), frees nothing, and logs every
pause and resume to stderr (the server's log), so a rehearsal sees the trainer's release and
resume calls reach the scheduler. Only ``tools/rehearse_launchers.py`` puts this folder on a
server's ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import sys


class _StandIn:
    enabled = True

    def __init__(self) -> None:
        self.paused: set[str] = set()

    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool = False):
        yield

    @contextlib.contextmanager
    def cuda_graph(self, **kwargs):
        yield

    @contextlib.contextmanager
    def disable(self):
        yield

    def pause(self, tag: str | None = None) -> None:
        self.paused.add(str(tag))
        print(f"torch_memory_saver stand-in: pause {tag}", file=sys.stderr, flush=True)

    def resume(self, tag: str | None = None) -> None:
        self.paused.discard(str(tag))
        print(f"torch_memory_saver stand-in: resume {tag}", file=sys.stderr, flush=True)


torch_memory_saver = _StandIn()


@contextlib.contextmanager
def configure_subprocess():
    yield
