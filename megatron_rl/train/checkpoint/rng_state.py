"""RNG states of a rank for training checkpoints: torch CPU/CUDA, python, numpy and megatron's
tensor-parallel RNG tracker (so that dropout and sampling resume exactly)."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from megatron_rl.parallel import initialized_parallel_state

logger = logging.getLogger(__name__)


def _rng_tracker():
    if initialized_parallel_state() is None:
        return None
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    return tracker if tracker.is_initialized() else None


def capture_rng_state() -> dict[str, Any]:
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state(),
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _rng_tracker()
    if tracker is not None:
        tracker_states = tracker.get_states()
        skipped = [k for k, v in tracker_states.items() if not torch.is_tensor(v)]
        if skipped:
            logger.warning("RNG tracker states %s are not tensors and are not saved", skipped)
        state["tracker"] = {k: v.clone() for k, v in tracker_states.items() if torch.is_tensor(v)}
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    numpy = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = _rng_tracker()
    if tracker is not None and "tracker" in state:
        current = tracker.get_states()
        current.update({k: v.clone() for k, v in state["tracker"].items()})
        tracker.set_states(current)
