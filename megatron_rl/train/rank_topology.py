"""This rank's place in megatron's process groups, read once after `init_distributed`.

The trainer, the rollout manager and evaluation ask one object for "which data-parallel share
is mine, who generates for my model-parallel group, am I the last pipeline stage", instead of
each calling ``parallel_state`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state


@dataclass(frozen=True)
class RankTopology:
    """``dp``: data-parallel size, ``dp_rank`` this rank's replica; the generator is the source
    rank of its model-parallel group (``mp_src``); ``pp`` stages, the last computes the losses;
    ``seq_multiple``: rows are padded to a multiple of it (TP size under sequence parallelism)."""

    dp: int
    dp_rank: int
    dp_group: object
    mp_src: int
    mp_group: object
    is_generator: bool
    pp: int
    pp_group: object
    last_stage: bool
    seq_multiple: int

    @classmethod
    def current(cls, dp: int, parallel) -> RankTopology:
        """Read from megatron's ``parallel_state`` (initialised) for a run of ``dp`` replicas
        laid out by ``parallel`` (a `ParallelConfig`)."""
        mp_src = parallel_state.get_model_parallel_src_rank()
        return cls(
            dp=dp,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_group=parallel_state.get_data_parallel_group(),
            mp_src=mp_src,
            mp_group=parallel_state.get_model_parallel_group(),
            is_generator=dist.get_rank() == mp_src,
            pp=parallel_state.get_pipeline_model_parallel_world_size(),
            pp_group=parallel_state.get_pipeline_model_parallel_group(),
            last_stage=parallel_state.is_pipeline_last_stage(),
            seq_multiple=parallel.tensor_parallel if parallel.sequence_parallel else 1,
        )

    @property
    def pipeline_group(self):
        """The pipeline group when there are several stages, else None (no collective)."""
        return self.pp_group if self.pp > 1 else None

    @property
    def data_parallel_group(self):
        """The data-parallel group when there are several replicas, else None."""
        return self.dp_group if self.dp > 1 else None
