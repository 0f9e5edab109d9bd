"""Training checkpoints: saved atomically by every rank, committed by rank 0, checked at load.

Modules, one concept each (callers import from the module, not from this package, so that
``--help`` parses ``config`` without importing torch):

- `config`: `CheckpointConfig`, the ``--save``/``--load``/``--ckpt-format`` flags.
- `save`: `save_training_state`, `start_async_save` and its `PendingSave`; the layout of a
  save folder.
- `load`: `load_training_state`: checks a step folder, then loads it in place.
- `folders`: what a checkpoint root holds, which step a load takes, `CheckpointDamaged`.
- `commit`: rank 0's commit (rename, ``latest``) and pruning.
- `shards`: the files of a step folder, written, recorded (size, sha256) and checked.
- `ranks`: the parallel layout and this rank's coordinates; one rank's failure on all ranks.
- `torch_dist`: the reshardable ``torch_dist`` format (megatron ``dist_checkpointing``).
- `async_write`: the background writer of ``--async-save`` and its processes.
- `optimizer_state`, `rng_state`: the optimizer's and the RNGs' state as saved.
"""
