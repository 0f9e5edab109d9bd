"""Push trainer weights to SGLang servers: three transports, bucketed, versioned, checked.

One sync (`sync_weights`) on the trainer's global rank 0, fed by
`megatron_rl.model.conversion.iter_hf_tensors` (collective: the other ranks iterate it too and
drop the tensors):

1. ``/pause_generation`` and ``/flush_cache`` on every server;
2. the tensors, in buckets of at most ``bucket_bytes``, by one transport:
   ``distributed`` (``/init_weights_update_group`` once, then per bucket
   ``/update_weights_from_distributed`` while rank 0 broadcasts over that group; NCCL on GPU,
   gloo on CPU), ``tensor`` (``/update_weights_from_tensor``, colocated), or ``disk`` (HF
   safetensors written to a temporary folder renamed into place, then
   ``/update_weights_from_disk``);
3. ``/update_weight_version`` to ``version`` once every bucket loaded, then each server's
   ``weight_version`` (``/get_model_info``) must equal it, and optionally per-tensor checksums;
4. ``/continue_generation``, whatever happened.

A failure raises `WeightSyncError` before step 3 moves the version, so servers keep reporting
the old version. Caveat on real SGLang: buckets already loaded stay loaded, so the weights are
a mix until a retried sync succeeds; the trainer must not generate from a server whose sync
failed (the version check on samples catches it).
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import io
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from megatron_rl.rollout.hf_weights import checksums
from megatron_rl.rollout.http_pool import ServerError
from megatron_rl.rollout.weight_group import (
    broadcast_tensor,
    destroy_weight_group,
    dtype_name,
    init_weight_group,
    unique_group_name,
)

logger = logging.getLogger(__name__)

TRANSPORTS = ("distributed", "tensor", "disk")
SERIALIZERS = ("sglang", "torch_b64")


class WeightSyncError(RuntimeError):
    """A sync failed; the servers still report the previous weight version."""


@dataclasses.dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How `sync_weights` pushes weights.

    ``engine_ranks``: ranks (TP size) of each server; one group rank each for ``distributed``,
    one serialised copy each for ``tensor``. ``tensor_serializer``: "sglang" (SGLang's
    ``MultiprocessingSerializer``, CUDA IPC, colocated GPUs) or "torch_b64" (``torch.save`` +
    base64, what the CPU loopback server takes). ``master_port = 0`` picks a free port.
    ``checksum``: per-tensor checksums read back over ``/weights_checksum``, which only the
    loopback server has (SGLang answers 404; the sync then fails with a WeightSyncError).
    ``group_name``: prefix of the weight-update group's name; every group creation gets its own
    name (`unique_group_name`), so a restarted trainer never collides with a group that a crashed
    run left on the servers.
    """

    transport: str = "distributed"
    bucket_bytes: int = 512 * 1024**2
    disk_dir: str | None = None
    master_address: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "gloo"
    group_name: str = "megatron_rl_weights"
    engine_ranks: int = 1
    tensor_serializer: str = "sglang"
    checksum: bool = False
    checksum_rtol: float = 1e-6
    group_timeout_s: float = 300.0

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
        if self.tensor_serializer not in SERIALIZERS:
            raise ValueError(
                f"WeightSyncConfig.tensor_serializer={self.tensor_serializer!r}: choose one of "
                f"{SERIALIZERS}"
            )
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"WeightSyncConfig.backend={self.backend!r}: 'gloo' or 'nccl'")


@dataclasses.dataclass(kw_only=True, slots=True)
class SyncReport:
    version: int
    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    seconds: float = 0.0
    checksums_compared: int = 0

    @property
    def mb_per_s(self) -> float:
        return self.num_bytes / 1e6 / max(self.seconds, 1e-9)


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive buckets of at most ``bucket_bytes`` (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class WeightSync:
    """Trainer side of weight sync to the servers behind ``pool`` (an `HttpPool`)."""

    def __init__(self, pool, config: WeightSyncConfig, hf_config=None) -> None:
        self.pool = pool
        self.config = config
        self.hf_config = hf_config
        self.group = None
        self.group_name: str | None = None  # the live group's unique name
        self._run_id = uuid.uuid4().hex[:12]
        self._threads = ThreadPoolExecutor(max_workers=max(1, len(pool.config.urls)))

    @property
    def urls(self) -> tuple[str, ...]:
        return self.pool.config.urls

    def _on_all(self, path: str, payloads) -> list:
        """POST ``payloads[i]`` (or one payload) to every server concurrently; checked answers."""
        if isinstance(payloads, dict):
            payloads = [payloads] * len(self.urls)
        futures = [
            self._threads.submit(self.pool.call_on, url, "POST", path, payload)
            for url, payload in zip(self.urls, payloads, strict=True)
        ]
        return futures

    def _check(self, futures, what: str) -> None:
        for url, future in zip(self.urls, futures, strict=True):
            answer = future.result()
            if isinstance(answer, dict) and answer.get("success") is False:
                raise WeightSyncError(f"{what} failed on {url}: {answer.get('message')}")

    def versions(self) -> dict[str, object]:
        return {
            u: (self.pool.call_on(u, "GET", "/get_model_info", None) or {}).get("weight_version")
            for u in self.urls
        }

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncReport:
        report = SyncReport(version=version)
        start = time.perf_counter()
        sums: dict[str, float] = {}
        stream = self._account(named_tensors, report, sums if self.config.checksum else None)
        self._check(self._on_all("/pause_generation", {}), "pause_generation")
        try:
            # waits for idle and retries SGLang's 400 (`HttpPool.flush_cache`)
            self._check([self._threads.submit(self.pool.flush_cache, u) for u in self.urls], "")
            push = {"distributed": self._distributed, "tensor": self._tensor, "disk": self._disk}
            push[self.config.transport](stream, report, version)
            self._check(
                self._on_all("/update_weight_version", {"new_version": str(version)}),
                "update_weight_version",
            )
            self._verify(version, sums, report)
        except WeightSyncError:
            raise
        except Exception as err:
            raise WeightSyncError(
                f"weight sync to version {version} over {self.config.transport!r} failed: "
                f"{type(err).__name__}: {err}"
            ) from err
        finally:
            for url, future in zip(
                self.urls, self._on_all("/continue_generation", {}), strict=True
            ):
                if future.exception() is not None:
                    logger.error("continue_generation failed on %s: %s", url, future.exception())
        report.seconds = time.perf_counter() - start
        logger.info(
            "weight sync v%d: %d tensors, %.1f MB, %d buckets, %.1f MB/s",
            version,
            report.num_tensors,
            report.num_bytes / 1e6,
            report.num_buckets,
            report.mb_per_s,
        )
        return report

    def _account(self, named_tensors, report: SyncReport, sums: dict | None):
        for name, tensor in named_tensors:
            report.num_tensors += 1
            report.num_bytes += tensor.numel() * tensor.element_size()
            if sums is not None:
                sums.update(checksums([(name, tensor)]))
            yield name, tensor

    def _verify(self, version: int, sums: dict[str, float], report: SyncReport) -> None:
        versions = self.versions()
        bad = {u: v for u, v in versions.items() if str(v) != str(version)}
        if bad:
            raise WeightSyncError(f"after sync to version {version} servers report {bad}")
        if not sums:
            return
        for url in self.urls:
            try:
                got = self.pool.call_on(url, "POST", "/weights_checksum", {"names": list(sums)})
            except ServerError as err:
                if "HTTP 404" not in str(err):
                    raise
                raise WeightSyncError(
                    f"WeightSyncConfig.checksum=True, but {url} has no /weights_checksum: only the "
                    "loopback server serves it. SGLang has no checksum endpoint (its "
                    "/get_weights_by_name returns the first values of one parameter under "
                    "SGLang's own names and is not implemented for Qwen3-MoE); set checksum=False "
                    "and rely on the weight_version check"
                ) from err
            for name, want in sums.items():
                if abs(got[name] - want) > self.config.checksum_rtol * max(1.0, abs(want)):
                    raise WeightSyncError(
                        f"checksum of {name!r} on {url} is {got[name]!r}, trainer sent {want!r}"
                    )
                report.checksums_compared += 1

    # ------------------------------------------------------------------ transports
    def _distributed(self, stream, report: SyncReport, version: int) -> None:
        del version
        cfg = self.config
        if self.group is None:
            self._init_group()
        device = "cuda" if cfg.backend == "nccl" else "cpu"
        try:
            for bucket in iter_buckets(stream, cfg.bucket_bytes):
                report.num_buckets += 1
                payload = {
                    "names": [n for n, _ in bucket],
                    "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": self.group_name,
                    "flush_cache": False,
                }
                futures = self._on_all("/update_weights_from_distributed", payload)
                for _, tensor in bucket:
                    broadcast_tensor(self.group, tensor.detach().to(device).contiguous())
                self._check(futures, "update_weights_from_distributed")
        except BaseException:
            # Ranks may be mid-broadcast: the group cannot be trusted any more. The next sync
            # builds a fresh one under a new name.
            self._destroy_group()
            raise

    def _init_group(self) -> None:
        """Create a group under a fresh name: servers join as ranks ``1..``, this side is 0.

        On any failure both sides' halves are destroyed before the error propagates.
        """
        cfg = self.config
        port = cfg.master_port or _free_port(cfg.master_address)
        world = 1 + cfg.engine_ranks * len(self.urls)
        name = unique_group_name(cfg.group_name, self._run_id)
        payloads = [
            {
                "master_address": cfg.master_address,
                "master_port": port,
                "rank_offset": 1 + i * cfg.engine_ranks,
                "world_size": world,
                "group_name": name,
                "backend": cfg.backend,
            }
            for i in range(len(self.urls))
        ]
        self.group_name = name
        futures = self._on_all("/init_weights_update_group", payloads)
        try:
            self.group = init_weight_group(
                backend=cfg.backend,
                master_address=cfg.master_address,
                master_port=port,
                rank=0,
                world_size=world,
                group_name=name,
                timeout_s=cfg.group_timeout_s,
            )
            self._check(futures, "init_weights_update_group")
        except BaseException:
            # Let the servers finish joining (briefly) so the destroy finds their halves.
            concurrent.futures.wait(futures, timeout=min(30.0, cfg.group_timeout_s))
            self._destroy_group()
            raise
        logger.info("weight-update group %r: %d ranks over %s", name, world, cfg.backend)

    def _destroy_group(self) -> None:
        """Destroy the current group on every server and here; failures are only logged."""
        name, group = self.group_name, self.group
        self.group, self.group_name = None, None
        if name is None:
            return
        futures = self._on_all("/destroy_weights_update_group", {"group_name": name})
        destroy_weight_group(group)
        for url, future in zip(self.urls, futures, strict=True):
            error = future.exception()
            answer = None if error is not None else future.result()
            if error is not None or (isinstance(answer, dict) and not answer.get("success")):
                logger.warning(
                    "destroy_weights_update_group %r on %s: %s", name, url, error or answer
                )

    def _tensor(self, stream, report: SyncReport, version: int) -> None:
        """``/update_weights_from_tensor`` per bucket, the way SGLang's own producer does it.

        SGLang's ``UpdateWeightsFromTensorReqInput.serialized_named_tensors`` holds one entry per
        TP rank and each rank deserialises only its own (``tp_worker.deserialize_own_rank``):
        with the "sglang" serializer every entry is its own ``MultiprocessingSerializer`` call,
        after ``monkey_patch_torch_reductions`` (CUDA IPC handles name the GPU by UUID), as
        ``sglang/srt/weight_sync/utils.py`` does, because each serialisation carries its own
        producer-side CUDA-IPC reference count; sharing one string between ranks or servers
        breaks it. The bucket's tensors (and any copies made for sending) stay referenced until
        every server's HTTP call has returned. "torch_b64" entries are plain bytes without
        handles, so one string serves every rank.
        """
        del version
        cfg = self.config
        for bucket in iter_buckets(stream, cfg.bucket_bytes):
            report.num_buckets += 1
            named = _tensors_to_send(bucket, cfg.tensor_serializer)
            if cfg.tensor_serializer == "sglang":
                serialize = _sglang_serialize()
                entries = [[serialize(named) for _ in range(cfg.engine_ranks)] for _ in self.urls]
            else:
                blob = _torch_b64(named)
                entries = [[blob] * cfg.engine_ranks for _ in self.urls]
            payloads = [
                {"serialized_named_tensors": ranks, "load_format": None, "flush_cache": False}
                for ranks in entries
            ]
            futures = self._on_all("/update_weights_from_tensor", payloads)
            wait(futures)  # every server done reading before a failure lets `named` go
            self._check(futures, "update_weights_from_tensor")
            del named, entries, payloads

    def _disk(self, stream, report: SyncReport, version: int) -> None:
        from megatron_rl.atomic_io import atomic_write_text
        from megatron_rl.model.conversion.safetensors_io import write_checkpoint

        root = os.fspath(self.config.disk_dir)
        final = os.path.join(root, f"weights-v{version}")
        tmp = os.path.join(root, f".weights-v{version}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        files = write_checkpoint(stream, tmp, max_shard_bytes=self.config.bucket_bytes)
        report.num_buckets = sum(f.endswith(".safetensors") for f in files)
        if self.hf_config is not None:
            config = {**self.hf_config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
            atomic_write_text(os.path.join(tmp, "config.json"), json.dumps(config, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        payload = {"model_path": final, "load_format": "auto"}
        self._check(self._on_all("/update_weights_from_disk", payload), "update_weights_from_disk")

    def close(self) -> None:
        self._destroy_group()
        self._threads.shutdown(wait=False)


def _tensors_to_send(bucket: list[tuple[str, torch.Tensor]], serializer: str) -> list:
    """The (name, tensor) pairs to serialise: on the GPU for CUDA IPC, on the CPU for bytes."""
    if serializer == "sglang":
        if not torch.cuda.is_available():
            raise WeightSyncError(
                "tensor_serializer='sglang' shares CUDA IPC handles and needs a GPU; use "
                "'torch_b64' (the loopback server) or another transport"
            )
        device = torch.device("cuda", torch.cuda.current_device())
        return [(n, t.detach().to(device).contiguous()) for n, t in bucket]
    return [(n, t.detach().cpu().contiguous()) for n, t in bucket]


def _sglang_serialize():
    """SGLang's serializer, after SGLang's own patch of torch's CUDA-IPC reductions."""
    from sglang.srt.utils import MultiprocessingSerializer  # pragma: no cover - needs sglang
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # idempotent
    return lambda named: MultiprocessingSerializer.serialize(named, output_str=True)


def _torch_b64(named: list[tuple[str, torch.Tensor]]) -> str:
    buffer = io.BytesIO()
    torch.save(named, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
