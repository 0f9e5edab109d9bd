"""How long the other ranks may wait while global rank 0 pushes the weights to SGLang.

With SGLang servers one rank (global rank 0) streams the whole model to them; every other rank
finishes its part of the stream (its own stage's gathers) and then waits for rank 0's result.
A 235B push (~470 GB in bf16) takes minutes: waiting in a collective of the default process
group would hit its timeout (torch's NCCL default is 10 minutes) and kill a healthy run. The
wait happens in a group of its own whose timeout is derived from the model's size and a stated
bandwidth floor (``--weight-sync-min-gbps``): a push slower than that floor is a fault.

    timeout = slack + factor * model_bytes / (min_gbps * 1e9)
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_rl import stop_signal
from megatron_rl.collectives import broadcast_object

SLACK_S = 300.0  # control calls, pause/flush/version checks, a stage's own gathers
SAFETY_FACTOR = 2.0


def hf_model_bytes(hf_config, dtype: torch.dtype) -> int:
    """Bytes of every HF tensor of ``hf_config``'s model in ``dtype`` (what a sync pushes),
    counted on the meta device (no memory is allocated, whatever the model's size)."""
    from megatron_rl.model.presets import hf_causal_lm_class

    with torch.device("meta"):
        model = hf_causal_lm_class(hf_config)(hf_config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.state_dict().values()) * itemsize


def weight_sync_timeout_s(model_bytes: int, min_gbps: float) -> float:
    """Seconds a rank may wait for a push of ``model_bytes`` at no less than ``min_gbps``."""
    if not min_gbps > 0:
        raise ValueError(f"--weight-sync-min-gbps={min_gbps!r}: must be > 0 (GB/s)")
    return SLACK_S + SAFETY_FACTOR * model_bytes / (min_gbps * 1e9)


class SyncWait:
    """A process group of every rank, with the weight-sync timeout, for the post-push wait.

    Collective to build (every rank, same arguments). `share` broadcasts rank 0's result of the
    push (e.g. its membership metrics) to every rank: the one wait that spans the whole push.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self.group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(timeout=datetime.timedelta(seconds=self.timeout_s))

    def share(self, obj):
        """Rank 0's ``obj`` on every rank, waiting at most ``timeout_s`` for it; a stop signal
        ends the wait (and the process) within a second (`stop_signal.hard_wait`)."""
        with stop_signal.hard_wait("waiting for rank 0's weight push"):
            return broadcast_object(obj, src=0, group=self.group)


def remote_sync_timeout_s(config, hf_config) -> float | None:
    """The longest any rank waits for a sync to reach it when rank 0 pushes the whole model to
    remote servers (its bytes in the pushed dtype at ``--weight-sync-min-gbps``); None for the
    in-process engine. ``config``: the `TrainConfig`."""
    if not config.engine.remote:
        return None
    push_dtype = torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32
    return weight_sync_timeout_s(
        hf_model_bytes(hf_config, push_dtype), config.engine.weight_sync_min_gbps
    )
