"""``megatron-rl plan -- TRAINER_COMMAND``: the plan's flags read from a trainer's command line.

A launcher's own trainer command (its flags, or ``torchrun ... -m megatron_rl.train FLAGS`` as
the launcher prints it) is parsed by the trainer's parser (`megatron_rl.train.config`); what it
decides replaces the planner's flags of the same meaning (`FROM_TRAINER`), so a launcher and its
plan cannot disagree. (megatron_rl/cli/plan.py)
"""

from __future__ import annotations

import argparse
from pathlib import Path

# this tool's flags that the trainer's command line decides (with `--`)
FROM_TRAINER = (
    "tp", "pp", "ep", "etp", "cp", "sp", "pipeline_layers", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "micro_batches", "dtype", "distributed_optimizer",
    "optimizer_offload_fraction", "recompute", "micro_batch_tokens", "micro_batch_sequences",
    "routing_replay", "routing_codec", "routing_tokens", "routing_responses",
    "routing_response_tokens", "reference", "spec", "colocated", "server_tp",
    "sync_staging_buffers", "sync_senders", "lora_rank", "lora_targets", "lora_experts",
)  # fmt: skip


def apply_trainer_command(
    args: argparse.Namespace, given: set[str], command: list[str]
) -> argparse.Namespace:
    """``args`` with what the trainer's ``command`` decides: its flags (the trainer's own
    parser, ``megatron_rl.train.config.parse_args``), or ``torchrun ... -m megatron_rl.train
    FLAGS`` (world size ``--nnodes`` x ``--nproc-per-node``)."""
    from megatron_rl.train.config import parse_args as parse_trainer_args

    both = sorted(given & set(FROM_TRAINER))
    flags, world_size, gpus_per_node = _split_launcher(command)
    if world_size is not None:
        both += sorted(given & {"world_size", "dp", "gpus_per_node"})
    if both:
        names = ", ".join("--" + name.replace("_", "-") for name in both)
        raise ValueError(f"{names}: the trainer's command after -- decides this; drop it")
    config = parse_trainer_args(flags)
    if config.task.max_prompt_length is None:
        raise ValueError(
            "the trainer's command gives no --max-prompt-length: a micro-batch's tokens are "
            "--micro-batch-size x (--max-prompt-length + --max-response-length)"
        )
    length = config.task.max_prompt_length + config.rollout.max_response_length
    replay = config.replay.mode
    micro = config.schedule.micro_batch_size
    values = {
        "tp": config.parallel.tensor_parallel,
        "pp": config.parallel.pipeline_parallel,
        "ep": config.parallel.expert_parallel,
        "etp": config.parallel.expert_tensor_parallel,
        "cp": config.parallel.context_parallel,
        "sp": config.parallel.sequence_parallel,
        "pipeline_layers": None,
        "decoder_first_pipeline_num_layers": config.model.first_stage_layers,
        "decoder_last_pipeline_num_layers": config.model.last_stage_layers,
        "virtual_pipeline_model_parallel_size": config.model.virtual_stages,
        "num_layers_per_virtual_pipeline_stage": config.model.layers_per_virtual_stage,
        "micro_batches": _micro_batches(config, args, world_size),
        "dtype": config.model.dtype,
        "distributed_optimizer": config.optimizer.use_distributed_optimizer,
        "optimizer_offload_fraction": (
            config.optimizer.offload_fraction if config.optimizer.offloads else 0.0
        ),
        "recompute": "full" if config.model.recompute else "none",
        "micro_batch_tokens": micro * length,
        "micro_batch_sequences": micro,
        "routing_replay": replay,
        "routing_codec": config.replay.dtype,
        "routing_tokens": None,
        "routing_responses": config.samples_per_rollout if replay != "off" else None,
        "routing_response_tokens": length if replay != "off" else None,
        "reference": "gpu" if config.objective.kl_coef > 0 else "off",
        "spec": "local" if config.model.spec == "local" else "te",
        "colocated": config.engine.colocate,
        "server_tp": config.engine.sglang_engine_ranks,
        **_sync_staging(config.engine),
        "lora_rank": config.lora.lora_rank,
        "lora_targets": config.lora.lora_targets,
        "lora_experts": config.lora.lora_experts,
    }
    if "model" not in given:
        values["model"] = config.task.model
    if world_size is not None:
        values.update(world_size=world_size, dp=None, gpus_per_node=gpus_per_node)
    return argparse.Namespace(**{**vars(args), **values})


def _micro_batches(config, args: argparse.Namespace, world_size: int | None) -> int | None:
    """Micro-batches per optimizer step on a data-parallel rank: ``--global-batch-size`` /
    (data parallel x ``--micro-batch-size``), the data-parallel size from torchrun's world size,
    else this tool's ``--world-size`` / ``--dp`` (1 without either); None under a token budget
    (``--max-tokens-per-gpu``: the count varies with the samples' lengths)."""
    schedule = config.schedule
    if schedule.token_budget:
        return None
    world = world_size if world_size is not None else args.world_size
    dp = config.data_parallel_size(world) if world is not None else (args.dp or 1)
    return schedule.global_batch_size // (dp * schedule.micro_batch_size)


def _sync_staging(engine) -> dict:
    """What the trainer's weight sync keeps allocated (`PlanOptions.sync_staging_buffers`):
    SGLang servers fed by the distributed transport, 2 buckets on each sender (every stage's
    first rank, or rank 0 with --weight-sync-from-rank-0); by CUDA IPC (tensor), 1 on every rank;
    the disk transport, the in-process engine and colocated mode (its bucket is a phase of the
    colocated plan), none."""
    transport = engine.weight_sync_transport
    if engine.kind != "sglang" or engine.colocate or transport == "disk":
        return {"sync_staging_buffers": 0, "sync_senders": "every-stage"}
    if transport == "tensor":
        return {"sync_staging_buffers": 1, "sync_senders": "every-rank"}
    senders = "every-stage" if engine.per_stage_senders else "first-stage"
    return {"sync_staging_buffers": 2, "sync_senders": senders}


def _split_launcher(command: list[str]) -> tuple[list[str], int | None, int | None]:
    """``(trainer flags, world size, GPUs per node)`` of ``command``: the flags themselves
    (no world size), or a command that runs ``-m megatron_rl.train`` (torchrun's
    ``--nnodes`` x ``--nproc-per-node``; 1 x 1 where it gives none)."""
    if "megatron_rl.train" not in command:
        return command, None, None
    at = command.index("megatron_rl.train")
    launcher = command[:at]
    if not launcher or Path(launcher[0]).name != "torchrun":
        return command[at + 1 :], None, None

    def value(flag: str) -> int:
        for i, word in enumerate(launcher):
            if word == flag and i + 1 < len(launcher):
                return int(launcher[i + 1])
            if word.startswith(flag + "="):
                return int(word.split("=", 1)[1])
        return 1

    nodes, per_node = value("--nnodes"), value("--nproc-per-node")
    return command[at + 1 :], nodes * per_node, per_node
