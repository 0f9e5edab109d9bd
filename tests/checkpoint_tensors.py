"""Every tensor of a torch_dist checkpoint, whole, under megatron's global keys (for tests that
compare two runs' weights and Adam moments at any layout)."""

from __future__ import annotations

from pathlib import Path

import torch


def checkpoint_tensors(folder: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """``folder``: a ``step_<n>`` folder of ``--ckpt-format torch_dist``; ``scratch``: a folder for
    the one-file copy torch's converter writes. Nested dicts are flattened to dotted keys."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    scratch.mkdir(parents=True, exist_ok=True)
    target = scratch / "whole.pt"
    dcp_to_torch_save(folder, target)
    flat: dict[str, torch.Tensor] = {}

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif torch.is_tensor(value):
                flat[prefix + key] = value

    walk(torch.load(target, weights_only=False), "")
    return flat
