#!/usr/bin/env bash
# 32-GPU RL job for Qwen3-30B-A3B: 2 nodes train (torchrun, megatron-core, 16 GPUs: TP 2 + SP,
# EP 8, DP 8), 2 nodes serve rollouts (one SGLang server per node, TP 8 / EP 8). Run this script
# on EVERY node with the same environment; NODE_RANK decides the role.
#
#   HF_CKPT=/shared/Qwen3-30B-A3B PROMPTS=/shared/dapo-math-17k.parquet MASTER_ADDR=node0 \
#   ROLLOUT_HOSTS="node2 node3" NODE_RANK=0 bash examples/qwen3_moe/run_qwen3_30b_a3b.sh
#
# LOSS=vespo|epic|gspo|grpo|... and REPLAY=off|r2|r3 pick the arm; RECIPE=epic-paper|vespo-paper
# with ARM and EVAL_DATA="aime24=/shared/aime24.jsonl ..." runs a paper's protocol instead; the
# other knobs (STALENESS, KL_COEF, OPTIMIZER_CPU_OFFLOAD, ASYNC, DRY_RUN=1, ...) are listed in
# common.sh. The model's arguments: models/qwen3_30b_a3b.sh. Under SLURM:
# slurm_qwen3_30b_a3b.sbatch.
#
# RUN_DIR must be on a filesystem every node sees: node 0 waits until every node's marker
# RUN_DIR/.nodes/node<RANK> is visible (NODE_WAIT_S, default 300 s). A failed node ends the job:
# node 0 rewrites RUN_DIR/job.alive while training runs, and the serving nodes stop when it is
# removed or unchanged for HEARTBEAT_TIMEOUT s (nodes.sh). Rerunning the same command resumes
# from the last checkpoint in RUN_DIR/checkpoints (the first run starts fresh).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "${HERE}/common.sh"
source "${HERE}/models/qwen3_30b_a3b.sh"

NODE_RANK=${NODE_RANK:?set NODE_RANK (0,1 train; 2,3 serve)}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the first training node}
ROLLOUT_HOSTS=(${ROLLOUT_HOSTS:?set ROLLOUT_HOSTS to the two serving nodes})
TRAIN_NODES=2

rl_job_args  # common.sh: TRAIN_CMD (the trainer's torchrun) and SERVE_ARGS (the servers)
launch_node  # nodes.sh: check NODE_RANK, announce this node, then serve or train
