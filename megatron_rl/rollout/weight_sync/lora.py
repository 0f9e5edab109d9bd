"""Adapter-only weight sync (``--lora-sync adapter``): the servers keep their base weights and
receive the policy's LoRA adapters as a new SGLang adapter per weight version.

Version ``v`` is loaded as the adapter ``megatron_rl-v<v>`` (`adapter_name`) on every server of
the sync, over the sync's transport:

- ``tensor`` (servers on the trainer's host): ``/load_lora_adapter_from_tensors`` with the
  adapter's tensors by handle (SGLang's ``MultiprocessingSerializer`` format, one entry per
  server TP rank; `ipc_serializer`) and its ``config_dict``;
- ``disk`` (a folder every server reads): the adapter written as a PEFT folder
  ``lora-v<v>`` under ``disk_dir`` (renamed into place whole), then ``/load_lora_adapter``.

The sync around it (pause, flush, ``/update_weight_version``, continue, membership) is the
usual one (`sync.WeightSync`); each generation request then names the newest adapter in
``lora_path`` (`sglang_client`), so a request runs on one adapter from its first token to its
last, and its tokens carry that adapter's version. Older adapters are unloaded in the
background once two newer ones are loaded (SGLang waits for the requests still using one).
Before its first load a run unloads the ``megatron_rl-v*`` adapters a server still holds (an
earlier run's, listed by ``GET /v1/models``): their names would collide, and they take slots of
``--max-loaded-loras``. ``distributed`` has no adapter path in SGLang and is refused.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

from megatron_rl.rollout import flat_bucket
from megatron_rl.rollout.weight_sync import ipc_serializer
from megatron_rl.rollout.weight_sync.common import SyncReport, WeightSyncConfig, WeightSyncError
from megatron_rl.rollout.weight_sync.transport import SyncRound

logger = logging.getLogger(__name__)

ADAPTER_PREFIX = "megatron_rl-v"
ADAPTER_TRANSPORTS = ("tensor", "disk")
KEEP = 2  # adapters kept loaded: the newest, and the one requests may still be finishing on


def adapter_name(version: int) -> str:
    """The SGLang adapter name of weight ``version``."""
    return f"{ADAPTER_PREFIX}{version}"


class LoRATransport:
    """Loads each version's adapter on the servers of ``sync`` (a `SyncRound`)."""

    def __init__(self, sync: SyncRound):
        if sync.config.transport not in ADAPTER_TRANSPORTS:
            raise ValueError(
                f"--lora-sync adapter over --weight-sync-transport {sync.config.transport!r}: "
                f"SGLang loads adapters from tensors or a folder; choose one of "
                f"{ADAPTER_TRANSPORTS}"
            )
        self.sync = sync
        self.adapter_config: dict | None = None  # set by the sync before each push
        self._loaded: list[int] = []  # versions loaded, oldest first
        self._cleared: set[str] = set()  # servers whose earlier runs' adapters were unloaded
        self._written: list[str] = []  # adapter folders written (disk)

    @property
    def config(self) -> WeightSyncConfig:
        return self.sync.config

    def push(self, stream, report: SyncReport, version: int) -> None:
        """Load ``stream`` (PEFT-named adapter tensors) as the adapter of ``version``."""
        if self.adapter_config is None:
            raise WeightSyncError("adapter sync without the adapter's config (a trainer bug)")
        tensors = {}
        for name, tensor in stream:
            if flat_bucket.nonfinite_name([(name, tensor)]) is not None:
                raise WeightSyncError(
                    f"weight sync to version {version}: adapter tensor {name!r} holds NaN or "
                    "Inf; the version is unchanged"
                )
            tensors[name] = tensor.detach().contiguous()
        report.num_buckets = 1
        for url in [u for u in self.sync.urls if u not in self._cleared]:
            self._clear(url)
        name = adapter_name(version)
        if self.config.transport == "tensor":
            entries = [
                [ipc_serializer.serialize(tensors) for _ in range(self.config.engine_ranks)]
                for _ in self.sync.urls
            ]
            payloads = [
                {
                    "lora_name": name,
                    "config_dict": self.adapter_config,
                    "serialized_named_tensors": e,
                }
                for e in entries
            ]
            self.sync.phase(
                "/load_lora_adapter_from_tensors", payloads, "load_lora_adapter_from_tensors"
            )
            del entries, payloads  # the servers copied the tensors before answering
        else:
            folder = self._write(tensors, version)
            self.sync.phase(
                "/load_lora_adapter", {"lora_name": name, "lora_path": folder}, "load_lora_adapter"
            )
        self._loaded.append(version)
        stale, self._loaded = self._loaded[:-KEEP], self._loaded[-KEEP:]
        for old in stale:  # in the background: SGLang waits for requests still on it
            self.sync.threads.submit(self._unload, old)

    def _write(self, tensors: dict[str, torch.Tensor], version: int) -> str:
        from megatron_rl.lora.peft_export import write_adapter_folder

        root = os.fspath(self.config.disk_dir)
        final = os.path.join(root, f"lora-v{version}")
        tmp = os.path.join(root, f".lora-v{version}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write_adapter_folder(tmp, tensors, self.adapter_config)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self._written.append(final)
        for folder in self._written[:-KEEP]:
            shutil.rmtree(folder, ignore_errors=True)
        self._written = self._written[-KEEP:]
        return final

    def _clear(self, url: str) -> None:
        """Unload every ``megatron_rl-v*`` adapter ``url`` holds (an earlier run's); a server
        that cannot list or unload them leaves the sync."""
        try:
            models = self.sync.pool.call_on(
                url, "GET", "/v1/models", None, timeout_s=self.config.failure_timeout_s
            )
            for card in models.get("data", []):
                if str(card.get("id", "")).startswith(ADAPTER_PREFIX):
                    self.sync.pool.call_on(
                        url, "POST", "/unload_lora_adapter", {"lora_name": card["id"]}
                    )
                    logger.info("%s: unloaded %s, an earlier run's adapter", url, card["id"])
        except Exception as err:
            self.sync.fail(url, f"clearing earlier adapters: {err}")
            return
        self._cleared.add(url)

    def _unload(self, version: int) -> None:
        for url in self.sync.pool.members():
            try:
                self.sync.pool.call_on(
                    url, "POST", "/unload_lora_adapter", {"lora_name": adapter_name(version)}
                )
            except Exception as err:  # a server that lost it (restarted) has nothing to free
                logger.warning("unload of %s on %s failed: %s", adapter_name(version), url, err)

    def close(self) -> None:
        pass
