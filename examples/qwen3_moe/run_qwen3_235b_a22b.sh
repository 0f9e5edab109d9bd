#!/usr/bin/env bash
# 64-GPU RL job for Qwen3-235B-A22B: 4 nodes train (torchrun, megatron-core, 32 GPUs: TP 4 + SP,
# PP 4, EP 8, DP 2, the Adam state in host memory), 4 nodes serve rollouts (one SGLang server per
# node, TP 8 / EP 8). Run this script on EVERY node with the same environment; NODE_RANK decides
# the role.
#
#   HF_CKPT=/shared/Qwen3-235B-A22B PROMPTS=/shared/dapo-math-17k.parquet MASTER_ADDR=node0 \
#   ROLLOUT_HOSTS="node4 node5 node6 node7" NODE_RANK=0 bash examples/qwen3_moe/run_qwen3_235b_a22b.sh
#
# LOSS, REPLAY, RECIPE/ARM/EVAL_DATA and the other knobs as in run_qwen3_30b_a3b.sh (common.sh
# lists them); OPTIMIZER_OFFLOAD_FRACTION (default 1.0) keeps only that share of the Adam state
# in host memory, ASYNC_SAVE=1 writes checkpoints in the background. The model's arguments, the
# layout's reasons and its memory plan: models/qwen3_235b_a22b.sh. Under SLURM:
# slurm_qwen3_235b_a22b.sbatch.
#
# RUN_DIR must be on a filesystem every node sees; node markers, the heartbeat and resuming work
# as in run_qwen3_30b_a3b.sh (nodes.sh). Checkpoints are megatron dist-checkpointing (torch_dist),
# so a rerun may also change the layout.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "${HERE}/common.sh"
source "${HERE}/models/qwen3_235b_a22b.sh"

NODE_RANK=${NODE_RANK:?set NODE_RANK (0..3 train; 4.. serve)}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the first training node}
ROLLOUT_HOSTS=(${ROLLOUT_HOSTS:?set ROLLOUT_HOSTS to the serving nodes (one SGLang server each)})
TRAIN_NODES=4

rl_job_args  # common.sh: TRAIN_CMD (the trainer's torchrun) and SERVE_ARGS (the servers)
launch_node  # nodes.sh: check NODE_RANK, announce this node, then serve or train
