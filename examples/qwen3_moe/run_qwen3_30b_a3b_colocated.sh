#!/usr/bin/env bash
# Colocated RL job for Qwen3-30B-A3B (the trainer's --colocate): NUM_NODES nodes x 8 GPUs (4 by
# default, 1 works as well), every node both trains (torchrun, 8 ranks: TP 2 + SP, EP 8) and
# serves (one SGLang server, TP 8 / EP 8, on the same GPUs). Run it on EVERY node with the same
# environment; NODE_RANK is the node's place in NODE_HOSTS.
#
#   HF_CKPT=/shared/Qwen3-30B-A3B PROMPTS=/shared/dapo-math-17k.parquet \
#   NODE_HOSTS="node0 node1 node2 node3" NODE_RANK=0 bash examples/qwen3_moe/run_qwen3_30b_a3b_colocated.sh
#
# The weights go by CUDA IPC (tensor transport): each trainer rank hands its handles to the
# server on its own GPUs, which is on its own node, so a rank checks only that ITS server is
# local; the other nodes' servers need not be. LOSS, REPLAY, STALENESS, KL_COEF as in
# run_qwen3_30b_a3b.sh (common.sh); synchronous, so RECIPE, ARM, ASYNC, PARTIAL, CARRY_OVER and
# MASK_STALE are refused. Each node's server (megatron_rl.rollout.serve --memory-saver) must
# answer /health within SERVER_WAIT_S (900 s) before torchrun starts (nodes.sh, colocated_node).
# MEM_FRACTION is the memory plan's (docs/cluster-launch.md, "Colocated"): 0.76 at 80 GiB (KV
# 53.69 GiB = 2,345,803 tokens per GPU); on 141-GiB GPUs pass MEM_FRACTION=0.86 (4,987,341).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "${HERE}/common.sh"
source "${HERE}/models/qwen3_30b_a3b.sh"

refuse_async_knobs  # common.sh: colocated mode is synchronous
NUM_NODES=${NUM_NODES:-4}
NODE_HOSTS=${NODE_HOSTS:?set NODE_HOSTS to the hosts of the ${NUM_NODES} nodes, node 0 first}
HOSTS=(${NODE_HOSTS})
if (( ${#HOSTS[@]} != NUM_NODES )); then
  echo "error: NODE_HOSTS has ${#HOSTS[@]} hosts (${NODE_HOSTS}); this job needs ${NUM_NODES}" >&2
  exit 1
fi
NODE_RANK=${NODE_RANK:?set NODE_RANK (0..$(( NUM_NODES - 1 )): every node trains and serves)}
MASTER_ADDR=${MASTER_ADDR:-${HOSTS[0]}}
ROLLOUT_HOSTS=()  # no serving-only nodes
TRAIN_NODES=${NUM_NODES}
RUN_NAME=${MODEL_NAME}-colocated
COLOCATE=1
SERVER_MEM_FRACTION=${MEM_FRACTION:-0.76}  # the memory plan's, at 80 GiB (141 GiB: 0.86)

rl_job_args  # common.sh: TRAIN_CMD, and SERVE_ARGS for this node's server
launch_colocated_node  # nodes.sh: check NODE_RANK, announce this node, its server, then train
