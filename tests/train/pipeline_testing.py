"""Helpers for the pipeline-parallel tests: the 4-layer tiny checkpoint every layout starts from."""

from __future__ import annotations

from pathlib import Path


def write_four_layer_checkpoint(folder: Path, init_method: str, layers: int = 4) -> Path:
    """A ``layers``-layer tiny Qwen3-MoE (vocabulary sized to the task's tokenizer) as an HF
    checkpoint in ``folder / "hf"``; runs in a spawned rank (it initialises and tears down
    torch.distributed) and returns the checkpoint folder."""
    from trainer_testing import small_config

    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.model import ModelOptions, build_model, preset_config
    from megatron_rl.model.conversion import save_checkpoint
    from megatron_rl.train.trainer import Trainer

    sizing = small_config(folder / "sizing")
    trainer = Trainer(sizing, rank=0, world_size=1, init_method=init_method)
    vocab = trainer.hf_config.vocab_size  # the tiny preset sized to the task's tokenizer
    trainer.close()
    config = preset_config("tiny", num_hidden_layers=layers, vocab_size=vocab)
    init_distributed(ParallelConfig(), init_method=f"{init_method}_build", device="cpu")
    save_checkpoint(build_model(config, ModelOptions(spec="local")), config, folder / "hf")
    destroy_distributed()
    return folder / "hf"
