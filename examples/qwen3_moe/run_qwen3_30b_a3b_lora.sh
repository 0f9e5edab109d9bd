#!/usr/bin/env bash
# 16-GPU LoRA RL job for Qwen3-30B-A3B: 1 node trains (torchrun, 8 GPUs: TP 2 + SP, EP 8, DP 4;
# rank-32 adapters on every linear layer, the routed experts' per expert; the base frozen, so
# gradient buffers and Adam state are the adapters' only), 1 node serves (one SGLang server, TP 8
# / EP 8, which receives the merged weights W + (alpha / r) B A at every sync). Full fine-tuning
# of this layout needs 2 training nodes (run_qwen3_30b_a3b.sh); the memory plan of this command
# (megatron-rl plan --gpu-gib 80 -- <its torchrun line>) fits one node of 80 GB GPUs. Run this
# script on BOTH nodes with the same environment; NODE_RANK decides the role.
#
#   HF_CKPT=/shared/Qwen3-30B-A3B PROMPTS=/shared/dapo-math-17k.parquet MASTER_ADDR=node0 \
#   ROLLOUT_HOSTS=node1 NODE_RANK=0 bash examples/qwen3_moe/run_qwen3_30b_a3b_lora.sh
#
# LORA_RANK (32; alpha is twice it), LORA_TARGETS (all_linear; attention, all_dense, ...: see
# docs/trainer.md, "LoRA"), LORA_EXPERTS (per-expert | shared: shared needs EP 1) and LORA_LR
# (1e-5: adapters take a larger step than full fine-tuning's 1e-6) pick the adapters; every
# other knob is the 30B launcher's (common.sh). Checkpoints hold the adapters and the base's
# identity (torch format: resume at the same layout).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "${HERE}/common.sh"
source "${HERE}/models/qwen3_30b_a3b.sh"

NODE_RANK=${NODE_RANK:?set NODE_RANK (0 trains; 1 serves)}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the training node}
ROLLOUT_HOSTS=(${ROLLOUT_HOSTS:?set ROLLOUT_HOSTS to the serving node})
TRAIN_NODES=1
LORA_RANK=${LORA_RANK:-32}
RUN_NAME=${MODEL_NAME}-lora${LORA_RANK}
# the adapters' flags come before TRAIN_EXTRA_ARGS, which still wins over everything
TRAIN_EXTRA_ARGS="--lora-rank ${LORA_RANK} --lora-alpha $(( 2 * LORA_RANK )) \
--lora-targets ${LORA_TARGETS:-all_linear} --lora-experts ${LORA_EXPERTS:-per-expert} \
--lr ${LORA_LR:-1e-5} ${TRAIN_EXTRA_ARGS:-}"

rl_job_args  # common.sh: TRAIN_CMD (the trainer's torchrun) and SERVE_ARGS (the server)
launch_node  # nodes.sh: check NODE_RANK, announce this node, then serve or train
