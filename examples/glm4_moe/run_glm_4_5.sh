#!/usr/bin/env bash
# RL job for GLM-4.5 (355B) on H200 nodes: TRAIN_NODES nodes train (torchrun, megatron-core:
# TP 8 + SP, PP 4, EP 2 x TRAIN_NODES), the ROLLOUT_HOSTS serve rollouts (one SGLang server per
# node, TP 8 / EP 8, bf16). The 128-GPU job is TRAIN_NODES=8 (default) with 8 serving nodes, the
# 64-GPU job TRAIN_NODES=4 with 4. Run this script on EVERY node with the same environment;
# NODE_RANK decides the role.
#
#   HF_CKPT=/shared/GLM-4.5 PROMPTS=/shared/dapo-math-17k.parquet MASTER_ADDR=node0 \
#   TRAIN_NODES=4 ROLLOUT_HOSTS="node4 node5 node6 node7" NODE_RANK=0 \
#   bash examples/glm4_moe/run_glm_4_5.sh
#
# LOSS, REPLAY, RECIPE/ARM/EVAL_DATA and the other knobs as in the Qwen3-MoE launchers
# (../qwen3_moe/common.sh lists them). The model's arguments, the layouts and their memory plan:
# models/glm_4_5.sh. RUN_DIR must be on a filesystem every node sees (../qwen3_moe/nodes.sh).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "${HERE}/../qwen3_moe/common.sh"
TRAIN_NODES=${TRAIN_NODES:-8}
source "${HERE}/models/glm_4_5.sh"

NODE_RANK=${NODE_RANK:?set NODE_RANK (0..TRAIN_NODES-1 train; the rest serve)}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the first training node}
ROLLOUT_HOSTS=(${ROLLOUT_HOSTS:?set ROLLOUT_HOSTS to the serving nodes (one SGLang server each)})

rl_job_args  # common.sh: TRAIN_CMD (the trainer's torchrun) and SERVE_ARGS (the servers)
launch_node  # nodes.sh: check NODE_RANK, announce this node, then serve or train
