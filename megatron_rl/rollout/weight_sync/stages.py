"""One weight sender per pipeline stage (the ``distributed`` transport under pipeline parallelism).

SGLang 0.5.23 keeps a dict of named weight-update groups in each TP worker
(``srt/managers/scheduler_components/weight_updater.py``: ``init_weights_update_group`` adds one
per ``group_name``), and ``/update_weights_from_distributed`` names the group a bucket comes
over, broadcast from that group's rank 0. So every pipeline stage gets a group of its own whose
rank 0 is the stage's first trainer rank (tp = ep = dp = 0, the ranks of global rank 0's
pipeline group): each tensor crosses the network once, from the stage that holds it, instead of
first travelling to global rank 0 over the pipeline group and then out through its one NIC.

Global rank 0 keeps every HTTP call (pause, sessions, each bucket's load request, membership
and group rebuilds: `DistributedTransport`); a stage's first rank packs, checks and broadcasts
its own buckets (`StageSender`). Rank 0 drives the stage through `RemoteStage`, point to point
over `StageLink` (a gloo group of the stage senders). Stages take turns, stage 0 first: an
SGLang server loads one update request at a time (its tokenizer manager holds the pause
condition, or the model-update lock, around each), so concurrent stages would only queue there.

Messages, rank 0 -> sender (its answer):
``("next",)`` (the next bucket's header, or None at the stage's end), ``("endpoint",)``
(``(address, port)`` of the store the sender now hosts for the next group, bound on a port the
OS picked: `weight_group.host_store`), ``("join", name, address, port, world)`` (None, or why
joining failed), ``("broadcast",)`` (None, or why the broadcast broke), ``("destroy",)``
(None), ``("end",)`` (no answer: the sync is over; the sender iterates the rest of its stream,
whose TP/EP gathers are collectives of its stage).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from megatron_rl.collectives import all_gather_objects
from megatron_rl.rollout.flat_bucket import flat_buckets
from megatron_rl.rollout.hf_weights import checksums
from megatron_rl.rollout.weight_group import (
    broadcast_tensor,
    destroy_weight_group,
    dtype_name,
    host_store,
    init_weight_group,
)
from megatron_rl.rollout.weight_sync.common import WeightSyncConfig, WeightSyncError, sent_stream
from megatron_rl.rollout.weight_sync.staging import Staging, current_cuda


class StageLink:
    """A gloo group over the stage senders (``ranks[s]`` is stage s's first rank; ``ranks[0]``
    is global rank 0) and point-to-point messages on it (picklable objects)."""

    def __init__(self, ranks: list[int], timeout_s: float | None = None):
        """``timeout_s``: the longest a rank waits for a message (the sync's own timeout); None
        keeps torch's default group timeout (30 minutes)."""
        self.ranks = list(ranks)
        self.timeout_s = timeout_s
        timeout = None if timeout_s is None else datetime.timedelta(seconds=float(timeout_s))
        # every rank of the world must take part in creating a group
        self.group = dist.new_group(self.ranks, backend="gloo", timeout=timeout)

    @classmethod
    def of_pipeline(
        cls, pipeline_group: dist.ProcessGroup, timeout_s: float | None = None
    ) -> StageLink:
        """The link over global rank 0's pipeline group (collective over the world)."""
        groups = all_gather_objects(dist.get_process_group_ranks(pipeline_group))
        return cls(next(g for g in groups if 0 in g), timeout_s)

    def stage_of(self, rank: int) -> int | None:
        """The stage ``rank`` sends for, or None when it sends nothing."""
        return self.ranks.index(rank) if rank in self.ranks else None

    def send(self, obj, rank: int) -> None:
        dist.send_object_list([obj], dst=rank, group=self.group)

    def recv(self, rank: int):
        """The next object from ``rank``; WeightSyncError when none comes within the timeout."""
        box = [None]
        try:
            dist.recv_object_list(box, src=rank, group=self.group)
        except RuntimeError as err:
            if self.timeout_s is None or "timed out" not in str(err).lower():
                raise
            raise WeightSyncError(
                f"rank {dist.get_rank()} waited more than {self.timeout_s:.0f} s for rank "
                f"{rank}'s next weight-sync message (the sync's timeout: the model's bytes at "
                "--weight-sync-min-gbps); the other rank is stuck or gone"
            ) from err
        return box[0]


def host_address(master_address: str) -> str:
    """The address this host is reached at by whoever reaches ``master_address`` (the address
    of the interface that routes there; no packet is sent); ``127.0.0.1`` on one host."""
    try:
        if ipaddress.ip_address(master_address).is_loopback:
            return "127.0.0.1"
    except ValueError:  # a host name
        if master_address == "localhost":
            return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_address, 1))
        return probe.getsockname()[0]


class StageSender:
    """Stage ``stage``'s first rank: answers global rank 0's messages for one sync at a time
    (`serve`) and keeps its half of the stage's weight group between syncs."""

    def __init__(self, link: StageLink, stage: int, config: WeightSyncConfig):
        if stage < 1:
            raise ValueError(f"stage={stage}: stage 0's sender is global rank 0 itself")
        self.link, self.stage, self.config = link, stage, config
        self.leader = link.ranks[0]
        self.staging = Staging(config, num_buffers=1)
        self.group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None  # the next group's, from "endpoint" to "join"

    def serve(self, stream, version: int) -> None:
        """Send this stage's (name, tensor) ``stream`` as rank 0 asks, until it says ``end``."""
        cfg = self.config
        device = current_cuda() if cfg.backend == "nccl" else torch.device("cpu")
        buckets = iter(flat_buckets(sent_stream(stream, cfg), cfg.bucket_bytes))
        flat = None
        try:
            while True:
                op, *args = self.link.recv(self.leader)
                if op == "end":
                    return
                if op == "next":
                    flat, answer = self._next(buckets, device, version)
                elif op == "endpoint":
                    address = host_address(cfg.master_address)
                    self._store = host_store(address, 0, cfg.group_timeout_s)
                    answer = (address, self._store.port)
                elif op == "join":
                    answer = self._join(*args)
                elif op == "broadcast":
                    answer = _failure(broadcast_tensor, self.group, flat)
                elif op == "destroy":
                    destroy_weight_group(self.group)
                    self.group, answer = None, None
                else:  # pragma: no cover - a message this version does not know
                    raise WeightSyncError(f"stage {self.stage} sender: unknown message {op!r}")
                self.link.send(answer, self.leader)
        finally:
            for _ in buckets:  # the stage's TP/EP gathers are collectives: take part to the end
                pass

    def _next(self, buckets, device, version):
        """(flat bucket, its header) or (None, None) at the stage's end; a bucket holding
        NaN/Inf answers ``{"error": ...}``."""
        bucket = next(buckets, None)
        if bucket is None:
            return None, None
        try:
            flat, slots = self.staging.stage(bucket, device, version)
        except WeightSyncError as err:
            return None, {"error": f"stage {self.stage}: {err}"}
        header = {
            "names": [s.name for s in slots],
            "dtypes": [dtype_name(s.dtype) for s in slots],
            "shapes": [list(s.shape) for s in slots],
            "bytes": sum(t.numel() * t.element_size() for _, t in bucket),
            "sums": checksums(bucket) if self.config.checksum else {},
        }
        return flat, header

    def _join(self, name: str, address: str, port: int, world: int) -> str | None:
        destroy_weight_group(self.group)
        self.group = None
        store, self._store = self._store, None  # the endpoint's (None: one bound on ``port``)

        def join():
            self.group = init_weight_group(
                backend=self.config.backend,
                master_address=address,
                master_port=port,
                rank=0,
                world_size=world,
                group_name=name,
                timeout_s=self.config.group_timeout_s,
                store=store,
            )

        return _failure(join)

    def close(self) -> None:
        destroy_weight_group(self.group)
        self.group, self._store = None, None
        self.staging.clear()


class RemoteStage:
    """Global rank 0's handle on stage ``stage``'s sender (global rank ``link.ranks[stage]``):
    what `DistributedTransport` calls for a stage whose tensors it does not hold."""

    def __init__(self, link: StageLink, stage: int):
        self.link, self.stage = link, stage
        self.rank = link.ranks[stage]
        self._answers = ThreadPoolExecutor(max_workers=1)  # a broadcast's answer, awaited
        self._pending = None  # the answer of a broadcast not collected yet

    def ask(self, *message):
        self.link.send(message, self.rank)
        return self.link.recv(self.rank)

    def next_bucket(self) -> dict | None:
        header = self.ask("next")
        if header is not None and "error" in header:
            raise WeightSyncError(header["error"])
        return header

    def endpoint(self) -> tuple[str, int]:
        return tuple(self.ask("endpoint"))

    def join(self, name: str, address: str, port: int, world: int) -> None:
        why = self.ask("join", name, address, port, world)
        if why is not None:
            raise WeightSyncError(f"stage {self.stage}'s sender could not join {name!r}: {why}")

    def start_broadcast(self):
        """Tell the sender to broadcast its staged bucket; a future of its answer."""
        self.link.send(("broadcast",), self.rank)
        self._pending = self._answers.submit(self.link.recv, self.rank)
        return self._pending

    def destroy(self, timeout_s: float) -> None:
        """The sender's half of the group, after the answer of a broadcast in flight (ended by
        the servers' halves being destroyed first)."""
        if self._pending is not None:
            self._pending.result(timeout=timeout_s)
            self._pending = None
        self.ask("destroy")

    def end(self) -> None:
        """The sync is over for this stage (whatever happened; said once per sync, also when
        the sync stopped before this stage's turn)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        self.link.send(("end",), self.rank)

    def close(self) -> None:
        self._answers.shutdown(wait=False)


def _failure(fn, *args) -> str | None:
    """None when ``fn(*args)`` returns, else why it raised (for the answer to rank 0)."""
    try:
        fn(*args)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None
