"""Rollout scheduling: from the prompt set to the batch a training step takes.

One `RolloutManager` per rank (``manager.py``) is built from the config and owns prompt drawing
and its per-rank split, when a batch is generated (``schedule.py``: ``--rollout-schedule``
sync, async, partial, carry-over), the producer thread of asynchronous rollouts
(``async_rollout.py``, ``producer.py``), dynamic sampling's refill (``dynamic_sampling.py``),
carried-over groups (``carry_over.py``), generation and scoring (``phase.py``, calling the rollout
function of `megatron_rl.train.rollout_function`) and rollout dumps (``dump.py``). Its flags are
`RolloutConfig` (``config.py``). The trainer sees only finished batches (``source.py``:
`RolloutBatch`).
"""
