"""The contract between a sync and its transport, in both directions.

`SyncRound` is what a transport sees of the sync under way (`sync.WeightSync` is the one
implementation): the servers still in it, how one leaves it, and the shared thread pool. A
`Transport` is what the sync asks of one (``distributed``, ``tensor``, ``disk``): push a stream
of named tensors as a weight version, and close.

The transports import this module, never `sync`; `sync` alone imports every transport and picks
one (`sync.TRANSPORT_CLASSES`). So the package's imports form no circle
(``tests/rollout/test_weight_sync_imports.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from megatron_rl.rollout.weight_sync.common import SyncReport, WeightSyncConfig

if TYPE_CHECKING:
    import torch

    from megatron_rl.rollout.http_pool import HttpPool


class SyncRound(Protocol):
    """The sync under way, as its transport uses it."""

    config: WeightSyncConfig
    hf_config: Any  # the model's HF config (``to_dict()``), or None
    pool: HttpPool  # the servers' pool: ``call_on``, ``alive_all``, ``config.urls``
    threads: ThreadPoolExecutor  # for calls to every server at once

    @property
    def urls(self) -> tuple[str, ...]:
        """The servers still taking part in the sync, in pool order."""
        ...

    @property
    def failures(self) -> dict[str, str]:
        """Why each server left the sync."""
        ...

    def fail(self, url: str, why: str) -> None:
        """``url`` leaves the sync under way, for ``why``."""
        ...

    def require(self) -> None:
        """WeightSyncError when fewer servers than the sync needs are left in it."""
        ...

    def phase(self, path: str, payloads, what: str, *, timeout_s: float | None = None) -> None:
        """POST ``payloads`` (one per live server, or one for all) to every live server at once;
        a server that fails leaves the sync."""
        ...


class Transport(Protocol):
    """One way of moving the tensors to the servers; built as ``Transport(sync: SyncRound)``."""

    def push(
        self,
        stream: Iterable[tuple[str, torch.Tensor]],
        report: SyncReport,
        version: int,
        **options,
    ) -> None:
        """Load ``stream`` on every server of the sync as weight ``version``, counting into
        ``report``. ``options``: the transport's own (``stages``/``sums``: ``distributed``;
        ``peers``: ``tensor``)."""
        ...

    def close(self) -> None:
        """Release what the transport holds (groups, buffers, background work)."""
        ...
