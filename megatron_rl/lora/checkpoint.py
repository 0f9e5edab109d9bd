"""What a LoRA run's checkpoint holds: the adapters (and the buffers training moves, e.g. a
router's aux-loss-free ``expert_bias``), never the frozen base; and the base's identity, so a
resume over another base is refused by name.

The base's identity is its folder and a content hash: SHA-256 over ``config.json`` and, per
safetensors file (sorted), its name, size, header (every tensor's name, dtype, shape and offsets)
and the first and last MiB of its data. Sampled, not every byte: a 60 GB base hashes in well under
a second, and any re-export, other shard layout, dtype, shape or edited head/tail changes it; an
edit confined to the middle of a file's data would not. A base drawn from ``--seed`` (no folder)
is identified by its config and seed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

import torch

SAMPLE_BYTES = 1 << 20


def has_adapters(model: torch.nn.Module) -> bool:
    from megatron_rl.lora.apply import ADAPTERS

    return any(isinstance(m, ADAPTERS) for m in model.modules())


def frozen_names(model: torch.nn.Module) -> set[str]:
    """The state-dict names of ``model``'s frozen parameters when it has adapters (else none)."""
    if not has_adapters(model):
        return set()
    state = model.state_dict(keep_vars=True)  # a wrapper's names, as its state dict has them
    return {
        n for n, v in state.items() if isinstance(v, torch.nn.Parameter) and not v.requires_grad
    }


def trained_state_dict(model: torch.nn.Module) -> dict:
    """``model.state_dict()`` without the frozen base (the whole state dict without adapters)."""
    frozen = frozen_names(model)
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def load_trained_state(model: torch.nn.Module, saved: dict) -> None:
    """Load `trained_state_dict`'s entries; anything else missing or extra is a ValueError."""
    current = set(model.state_dict())
    missing = sorted(current - set(saved) - frozen_names(model))
    unexpected = set(saved) - current
    if missing or unexpected:
        raise ValueError(
            f"checkpoint and model tensors differ: missing {missing[:5]}, unexpected "
            f"{sorted(unexpected)[:5]} (a LoRA checkpoint resumes with the same --lora-* flags)"
        )
    model.load_state_dict(saved, strict=not has_adapters(model))


def base_identity(checkpoint_dir: str | None, hf_config, seed: int) -> dict:
    """``{"path", "hash"}`` of the base the adapters sit on (module docstring)."""
    digest = hashlib.sha256()
    if checkpoint_dir is None:
        digest.update(json.dumps(hf_config.to_dict(), sort_keys=True, default=str).encode())
        digest.update(f"seed {seed}".encode())
        return {"path": None, "hash": digest.hexdigest()}
    config = os.path.join(checkpoint_dir, "config.json")
    if os.path.exists(config):
        with open(config, "rb") as handle:
            digest.update(handle.read())
    for path in sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors"))):
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)} {size}".encode())
        with open(path, "rb") as handle:
            header = int.from_bytes(handle.read(8), "little")
            digest.update(handle.read(header))
            start = 8 + header
            digest.update(handle.read(SAMPLE_BYTES))
            handle.seek(max(start, size - SAMPLE_BYTES))
            digest.update(handle.read(SAMPLE_BYTES))
    return {"path": os.path.abspath(checkpoint_dir), "hash": digest.hexdigest()}


def check_same_base(saved: dict | None, current: dict) -> None:
    """ValueError naming both bases unless the checkpoint's adapters sit on ``current``."""
    if saved is None:
        raise ValueError(
            "this checkpoint holds no LoRA base identity (saved without --lora-rank); resume it "
            "without --lora-rank"
        )
    if saved.get("hash") != current["hash"]:
        raise ValueError(
            f"the checkpoint's LoRA adapters were trained on the base {saved.get('path')} "
            f"(hash {str(saved.get('hash'))[:12]}), this run's base is {current['path']} (hash "
            f"{current['hash'][:12]}): adapters only fit their own base; pass its --model"
        )
