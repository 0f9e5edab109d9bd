"""What every part of a weight sync shares: its config, its report, its error, and how a
server call's failure is read."""

from __future__ import annotations

import dataclasses

TRANSPORTS = ("distributed", "tensor", "disk")
PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's PauseGenerationReqInput.mode


class WeightSyncError(RuntimeError):
    """A sync failed; the servers still report the previous weight version."""


@dataclasses.dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How `sync_weights` pushes weights.

    ``engine_ranks``: ranks (TP size) of each server; one group rank each for ``distributed``,
    one serialised handle each for ``tensor``. ``master_port``: where the trainer hosts each
    group's store; 0 binds it on a port the OS picks, then tells the servers that port.
    ``bucket_bytes`` also bounds the staging buffer this side holds (a larger tensor gets a
    buffer of its own size).
    ``checksum``: per-tensor checksums read back over ``/weights_checksum``, which only the
    loopback server has (SGLang answers 404; the sync then fails with a WeightSyncError).
    ``failure_timeout_s``: how long control calls (pause, version, destroy) and a failing
    group's members may take before the server is given up on (no 120 s hang on a dead member).
    ``group_name``: prefix of the weight-update group's name; every group creation gets its own
    name (`unique_group_name`), so a restarted trainer never collides with a group that a crashed
    run left on the servers.
    ``pause_mode``: the ``mode`` of ``/pause_generation`` (SGLang >= 0.5.6 has all three).
    ``abort`` (SGLang's default) ends the running requests (the client generates them again),
    then flushes the cache; ``retract`` keeps them, their KV cache freed, flushes the prefix
    cache (SGLang >= 0.5.21 allows that while requests are retracted; an older server keeps it,
    with a warning) and lets them recompute their KV with the new weights after
    ``/continue_generation``; ``in_place`` keeps them with their KV cache and skips the flush
    (SGLang refuses it while requests are parked in place). With ``retract`` and ``in_place`` a
    request that outlives the sync finishes with ``meta_info.weight_versions`` segments.
    ``fp8_blocks``: every sender sends its HF stream block-FP8 quantised
    (`megatron_rl.model.conversion.block_fp8`: linear weights as float8_e4m3fn plus a float32
    ``weight_scale_inv`` per 128x128 block), for servers started on a block-FP8 checkpoint.
    """

    transport: str = "distributed"
    bucket_bytes: int = 512 * 1024**2
    disk_dir: str | None = None
    master_address: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "gloo"
    group_name: str = "megatron_rl_weights"
    engine_ranks: int = 1
    checksum: bool = False
    checksum_rtol: float = 1e-6
    group_timeout_s: float = 300.0
    failure_timeout_s: float = 30.0
    pause_mode: str = "abort"
    fp8_blocks: bool = False

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"WeightSyncConfig.transport={self.transport!r}: choose one of {TRANSPORTS}"
            )
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(f"WeightSyncConfig.bucket_bytes={self.bucket_bytes!r}: must be >= 1")
        if self.transport == "disk" and not self.disk_dir:
            raise ValueError(
                "WeightSyncConfig.disk_dir=None: the disk transport needs a folder every server "
                "can read"
            )
        if not self.failure_timeout_s > 0:
            raise ValueError(
                f"WeightSyncConfig.failure_timeout_s={self.failure_timeout_s!r}: must be > 0"
            )
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"WeightSyncConfig.backend={self.backend!r}: 'gloo' or 'nccl'")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(
                f"WeightSyncConfig.pause_mode={self.pause_mode!r}: choose one of {PAUSE_MODES}"
            )


@dataclasses.dataclass(kw_only=True, slots=True)
class SyncReport:
    version: int
    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    seconds: float = 0.0
    checksums_compared: int = 0
    servers_up: int = 0  # pool members after the sync
    servers_out: int = 0  # servers out of the pool (dropped, not yet rejoined) after the sync
    servers_dropped: int = 0  # servers dropped by syncs so far
    servers_rejoined: int = 0  # dropped servers admitted again after a full sync so far
    stage_bytes: list[int] = dataclasses.field(default_factory=list)  # per pipeline stage

    @property
    def mb_per_s(self) -> float:
        return self.num_bytes / 1e6 / max(self.seconds, 1e-9)


def sent_stream(stream, config: WeightSyncConfig):
    """``stream`` as every sender sends it: block-FP8 quantised under ``config.fp8_blocks``
    (a NaN or Inf in a weight is a WeightSyncError naming it), else unchanged."""
    if not config.fp8_blocks:
        return stream
    from megatron_rl.model.conversion.block_fp8 import quantize_stream

    def checked():
        try:
            yield from quantize_stream(stream)
        except ValueError as error:
            raise WeightSyncError(
                f"weight sync: {error}; nothing after the previous bucket was sent"
            ) from None

    return checked()


def call_failure(future) -> str | None:
    """Why a finished control call failed (its error, or ``success: false``), else None."""
    error = future.exception()
    if error is not None:
        return f"{type(error).__name__}: {error}"
    answer = future.result()
    if isinstance(answer, dict) and answer.get("success") is False:
        return f"success=false: {answer.get('message')}"
    return None
