"""Gradient reduction over a data-parallel group of one rank, without the collective.

megatron-core's DDP reduces each bucket group's contiguous fp32 gradient buffer over its
data-parallel group (``_ParamAndGradBucketGroup.start_grad_sync``: scale by
``gradient_scaling_factor``, then an all-reduce or, for the distributed optimizer, a
reduce-scatter into this rank's shard), every optimizer step, whatever the group's size. Over one
rank both collectives are the identity, yet gloo still copies the buffer through its
coalescing manager: ~3 ms a step for the 1.25 M gradients of ``tiny-mismatch`` on this project's
CPU, about 8% of a study update. `skip_one_rank_grad_reduction` gives every bucket group whose
group has one rank `OneRankBucketGroup`'s ``start_grad_sync``: megatron's NaN/large-gradient
check when configured, its scaling, and no collective (a completed handle under
``--overlap-grad-reduce``, which `finish_grad_sync` waits on). The buffers hold bitwise what the
collective would leave there. Groups of several ranks, and several distributed-optimizer
instances (a second, inter-instance reduction), keep megatron's own method.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup


class _Done:
    """The handle of a reduction that has nothing left to do."""

    def wait(self) -> None:
        return None


class OneRankBucketGroup(_ParamAndGradBucketGroup):
    """A bucket group reduced over one rank: ``start_grad_sync`` only scales (see the module)."""

    def start_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return  # already started in this first batch (megatron's rule)
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads(
                check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                check_for_large=self.ddp_config.check_for_large_grads,
            )
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        # megatron's async path leaves a handle for finish_grad_sync to wait on; its sync path
        # leaves None
        self.grad_reduce_handle = _Done() if self.ddp_config.overlap_grad_reduce else None


def skip_one_rank_grad_reduction(ddp) -> int:
    """Make each of ``ddp``'s bucket groups reduced over one rank a `OneRankBucketGroup`
    (only the class changes); returns how many."""
    count = 0
    for group in [*ddp.bucket_groups, *ddp.expert_parallel_bucket_groups]:
        if type(group) is not _ParamAndGradBucketGroup or _reduced_elsewhere(group):
            continue
        group.__class__ = OneRankBucketGroup
        count += 1
    return count


def _reduced_elsewhere(group: _ParamAndGradBucketGroup) -> bool:
    """Whether ``group``'s reduction involves another rank."""
    if group.ddp_config.num_distributed_optimizer_instances > 1:
        return True
    if group.ddp_config.use_distributed_optimizer:
        communication = group.intra_distributed_optimizer_instance_group
    else:
        communication = group.data_parallel_group
    return dist.get_world_size(communication) != 1
