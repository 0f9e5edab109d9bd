#!/usr/bin/env bash
# RL job for DeepSeek-V3 (671B) on H200 nodes: TRAIN_NODES nodes train (torchrun, megatron-core:
# TP 8 + SP, PP 8, EP 8 x TRAIN_NODES / 8), the ROLLOUT_HOSTS serve rollouts (one SGLang server
# per node on the block-FP8 release, TP 8 / EP 8). The 256-GPU job is TRAIN_NODES=16 (default)
# with 16 serving nodes, the 128-GPU job TRAIN_NODES=8 with 8. Run this script on EVERY node with
# the same environment; NODE_RANK decides the role.
#
#   HF_CKPT=/shared/DeepSeek-V3-bf16 SERVE_CKPT=/shared/DeepSeek-V3 \
#   PROMPTS=/shared/dapo-math-17k.parquet MASTER_ADDR=node0 TRAIN_NODES=8 \
#   ROLLOUT_HOSTS="node8 node9 node10 node11 node12 node13 node14 node15" NODE_RANK=0 \
#   bash examples/deepseek_v3/run_deepseek_v3.sh
#
# LOSS, REPLAY, RECIPE/ARM/EVAL_DATA and the other knobs as in the Qwen3-MoE launchers
# (../qwen3_moe/common.sh lists them). The model's arguments, the layouts and their memory plan:
# models/deepseek_v3.sh. RUN_DIR must be on a filesystem every node sees (../qwen3_moe/nodes.sh).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "${HERE}/../qwen3_moe/common.sh"
TRAIN_NODES=${TRAIN_NODES:-16}
source "${HERE}/models/deepseek_v3.sh"

NODE_RANK=${NODE_RANK:?set NODE_RANK (0..TRAIN_NODES-1 train; the rest serve)}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the first training node}
ROLLOUT_HOSTS=(${ROLLOUT_HOSTS:?set ROLLOUT_HOSTS to the serving nodes (one SGLang server each)})

rl_job_args  # common.sh: TRAIN_CMD (the trainer's torchrun) and SERVE_ARGS (the servers)
launch_node  # nodes.sh: check NODE_RANK, announce this node, then serve or train
