"""The ``disk`` transport: HF safetensors written to a temporary folder renamed into place,
then ``/update_weights_from_disk`` on every server (a folder they can all read)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil

from megatron_rl.rollout import flat_bucket
from megatron_rl.rollout.weight_sync.common import SyncReport, WeightSyncConfig, WeightSyncError
from megatron_rl.rollout.weight_sync.staging import FLOAT8
from megatron_rl.rollout.weight_sync.transport import SyncRound


class DiskTransport:
    """The weight folders written for the servers of ``sync`` (a `SyncRound`): at most the
    newest two versions are kept."""

    def __init__(self, sync: SyncRound):
        self.sync = sync
        self._written: list[str] = []  # weight folders written so far, oldest first
        self._pruning: concurrent.futures.Future | None = None

    @property
    def config(self) -> WeightSyncConfig:
        return self.sync.config

    def push(self, stream, report: SyncReport, version: int) -> None:
        """Safetensors shards in ``weights-v{version}`` (written under a temporary name, then
        renamed). Folders this sync wrote before are removed except the newest, which the
        servers run on and SGLang reloads if this update fails: at most two versions on disk.
        """
        from megatron_rl.atomic_io import atomic_write_text
        from megatron_rl.model.conversion.block_fp8 import quantization_config
        from megatron_rl.model.conversion.safetensors_io import write_checkpoint
        from megatron_rl.model.presets import hf_architecture

        root = os.fspath(self.config.disk_dir)
        final = os.path.join(root, f"weights-v{version}")
        if self._pruning is not None:
            self._pruning.result()
        # freeing hundreds of MB takes a while: done beside this sync
        stale, self._written = self._written[:-1], [w for w in self._written[-1:] if w != final]
        self._pruning = self.sync.threads.submit(_remove_folders, stale)
        tmp = os.path.join(root, f".weights-v{version}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            files = write_checkpoint(
                _finite(stream, version), tmp, max_shard_bytes=self.config.bucket_bytes
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        report.num_buckets = sum(f.endswith(".safetensors") for f in files)
        if self.sync.hf_config is not None:
            architecture = hf_architecture(self.sync.hf_config)
            config = {**self.sync.hf_config.to_dict(), "architectures": [architecture]}
            if self.config.fp8_blocks:
                config["quantization_config"] = quantization_config()
            atomic_write_text(os.path.join(tmp, "config.json"), json.dumps(config, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self._written.append(final)
        payload = {"model_path": final, "load_format": "auto"}
        if self.config.pause_mode != "abort":  # the flush after loading fails with requests kept
            payload["flush_cache"] = False
        self.sync.phase("/update_weights_from_disk", payload, "update_weights_from_disk")

    def close(self) -> None:
        if self._pruning is not None:
            self._pruning.result()


def _finite(stream, version: int):
    """``stream``, failing on the first tensor holding NaN or Inf (one aminmax each; float8
    weights were checked before rounding, `block_fp8`)."""
    for name, tensor in stream:
        if tensor.dtype in FLOAT8:
            pass
        elif flat_bucket.nonfinite_name([(name, tensor)]) is not None:
            raise WeightSyncError(
                f"weight sync to version {version}: tensor {name!r} holds NaN or Inf; "
                "the version is unchanged"
            )
        yield name, tensor


def _remove_folders(folders: list[str]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
