#!/usr/bin/env bash
# 32-GPU colocated RL job for Qwen3-30B-A3B (the trainer's --colocate): 4 nodes x 8 GPUs, and
# every node both trains (torchrun, 8 ranks: TP 2 + SP, EP 8, data parallel 16 over the 32 GPUs)
# and serves (one SGLang server, TP 8 / EP 8, on the same 8 GPUs). Around each rollout the trainer
# offloads its parameters, gradient buffers and optimizer state to host memory and the servers
# resume their KV cache and CUDA graphs; before the update the servers release all of their
# memory (--enable-memory-saver: torch_memory_saver unmaps it) and the trainer onloads; the
# weights go by CUDA IPC (--weight-sync-transport tensor). At start-up the trainer has the servers
# release their KV cache and CUDA graphs before it builds its model and optimizer (train/
# trainer.py, slime's order), so while it builds the servers hold only their weights. Run this
# script on EVERY node with the same environment; NODE_RANK is the node's place in NODE_HOSTS.
#
#   HF_CKPT=/shared/Qwen3-30B-A3B PROMPTS=/shared/dapo-math-17k.parquet \
#   NODE_HOSTS="node0 node1 node2 node3" NODE_RANK=0 \
#   bash examples/qwen3_moe/run_qwen3_30b_a3b_colocated.sh
#
# LOSS, REPLAY, STALENESS and KL_COEF as in run_qwen3_30b_a3b.sh. Colocated mode is synchronous:
# RECIPE (its evaluation sets), ASYNC, PARTIAL and CARRY_OVER are refused (the servers hold no KV
# cache between steps, and the next rollout cannot generate while the trainer holds the GPUs).
# DRY_RUN=1 prints this node's commands. Under SLURM: slurm_qwen3_30b_a3b_colocated.sbatch.
#
# Each node starts its server first and waits for its /health (SERVER_WAIT_S, default 900 s),
# then torchrun (common.sh, colocated_node): SGLang sizes its KV pool from the memory free when
# it starts. RUN_DIR, the node markers, the heartbeat and resuming work as in the disaggregated
# launcher; the server stops with its node's training.
#
# Why one TP-8 server per node rather than one per trainer TP group (TP 2, four per node): the
# weights share is 1/8 of the model per GPU (7.1 GiB, against 28.4 at TP 2), so the weight sync
# peaks at 49.9 GiB per GPU (71.2 at TP 2) and each GPU keeps 53.7 GiB of KV (33.2 at TP 2); and
# it is the disaggregated launcher's server (TP 8 / EP 8, --sglang-engine-ranks 8). Its cost: the
# 4 KV heads are replicated twice over TP 8, so a node holds 2.35M tokens where four TP-2 servers
# would hold 2.90M (and two TP-4 servers, which this launcher does not offer, 4.14M).
#
# --mem-fraction-static from the memory plan (docs/cluster-launch.md, "Colocated"), per GPU:
#   python tools/memory_plan.py --model qwen3-30b-a3b --tp 2 --ep 8 --world-size 32 \
#       --micro-batch-tokens 18432 --gpu-gib 80 --colocated --server-tp 8
#   startup  trainer static 39.26 + server weights 7.11 + released server 3.0 (assumed) = 49.37 GiB
#   train    trainer peak 47.39 + released server 3.0                                 = 50.39 GiB
#   sync     trainer static 39.26 + server weights 7.11 + 3.0 + bucket 0.5             = 49.87 GiB
#   rollout  trainer resident 4.0 + weights 7.11 + KV 53.69 + SGLang reserve 14.5      = 79.30 GiB
#   -> 80 GiB: --mem-fraction-static 0.76, KV 53.69 GiB = 2,345,803 tokens (24,576 B per token
#      per GPU: 48 layers x 2 x 1 KV head x 128 x 2 B); 141 GiB: 0.86, 114.15 GiB = 4,987,341
#   host: 282 GiB of offloaded state per node (8 ranks x 35.3 GiB), of 2 TiB
# MEM_FRACTION defaults to the 80-GiB fraction, 0.76. On 141-GiB GPUs (H200) pass
# MEM_FRACTION=0.86: the same command with --gpu-gib 141 prints it.
#
# NOT YET RUNNABLE ON MORE THAN ONE NODE: the tensor transport pushes every bucket from global
# rank 0 as a CUDA IPC handle of rank 0's GPU (rollout/weight_sync/tensor.py), which the servers
# of nodes 1-3 cannot open (another host's GPU), so the first sync fails. Until each node's ranks
# push to their own node's server, NUM_NODES=1 runs the same job on one node (8 GPUs, data
# parallel 4; the plan fits 141-GB GPUs, with MEM_FRACTION=0.86, not 80-GB ones: 82.4 GiB while
# training).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "${HERE}/common.sh"
source "${HERE}/model_qwen3_30b_a3b.sh"

for knob in RECIPE ASYNC CARRY_OVER; do
  if [[ -n "${!knob:-}" ]]; then
    echo "error: ${knob}=${!knob}: colocated mode is synchronous and has no evaluation; use run_qwen3_30b_a3b.sh" >&2
    exit 2
  fi
done
if [[ "${PARTIAL:-0}" == 1 ]]; then
  echo "error: PARTIAL=1: colocated mode is synchronous; use run_qwen3_30b_a3b.sh" >&2
  exit 2
fi
PROMPTS=${PROMPTS:?set PROMPTS to a JSONL/Parquet prompt file (DAPO-Math-17k layout works)}
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
LOSS=${LOSS:-vespo}
REPLAY=${REPLAY:-off}
STALENESS=${STALENESS:-8}
SGLANG_PORT=${SGLANG_PORT:-30000}
MEM_FRACTION=${MEM_FRACTION:-0.76}  # the memory plan's, at 80 GiB (above; 141 GiB: 0.86)
RUN_DIR=${RUN_DIR:-runs/qwen3-30b-a3b-colocated-${LOSS}-${REPLAY}-N${STALENESS}}
TRAIN_NODES=${NUM_NODES}
GPUS_PER_NODE=8
ROLLOUT_PROMPTS=64
SAMPLES_PER_PROMPT=8
init_launch

ROLLOUT_ARGS=(
  --rollout-engine sglang
  --colocate
  --weight-sync-transport tensor
  --sglang-engine-ranks 8
  --rollout-batch-size "${ROLLOUT_PROMPTS}"
  --n-samples-per-prompt "${SAMPLES_PER_PROMPT}"
  --max-response-length 16384
  --temperature 1.0
)
for host in "${HOSTS[@]}"; do
  ROLLOUT_ARGS+=(--sglang-url "http://${host}:${SGLANG_PORT}")
done
if [[ "${REPLAY}" == r3 ]]; then
  ROLLOUT_ARGS+=(--sglang-return-routed-experts)
fi

# KL to the frozen initial policy, per recipe (KL_COEF overrides), as in run_qwen3_30b_a3b.sh
case "${LOSS}" in
  epic|grpo|dapo|gspo|gspo_token) DEFAULT_KL=0.001 ;;
  *) DEFAULT_KL=0 ;;
esac
KL_COEF=${KL_COEF:-${DEFAULT_KL}}

RL_ARGS=(
  --loss "${LOSS}"
  --advantage-estimator grpo
  --routing-replay "${REPLAY}"
  --routing-dtype auto
  --kl-coef "${KL_COEF}"
)

OPTIM_ARGS=(
  --train-iters 300
  --micro-batch-size 1
  # staleness N: one rollout of 512 samples is consumed by N sequential optimizer steps
  --global-batch-size $(( ROLLOUT_PROMPTS * SAMPLES_PER_PROMPT / STALENESS ))
  --lr 1e-6
  --clip-grad 1.0
  --use-distributed-optimizer
  --overlap-grad-reduce
  --seed 1234
)

DATA_ARGS=(
  --prompt-data "${PROMPTS}"
  --max-prompt-length 2048
  --reward math
)

OUTPUT_ARGS=(
  --run-dir "${RUN_DIR}"
  --save "${RUN_DIR}/checkpoints"
  --load "${RUN_DIR}/checkpoints"
  --save-interval 20
  --wandb-project "${WANDB_PROJECT:-megatron-rl}"
  --wandb-exp-name "$(basename "${RUN_DIR}")"
)

# this node's server, on all 8 GPUs: the arguments of megatron_rl.rollout.launch.server_command
# (as the disaggregated launcher's) plus --enable-memory-saver
SERVER_CMD=(
  "${SGLANG_PYTHON:-python}" -m sglang.launch_server
  --model-path "${HF_CKPT}" --host 0.0.0.0 --port "${SGLANG_PORT}"
  --tp-size 8 --mem-fraction-static "${MEM_FRACTION}" --dtype auto --ep-size 8
  --skip-tokenizer-init
)
if [[ "${REPLAY}" == r3 ]]; then SERVER_CMD+=(--enable-return-routed-experts); fi
SERVER_CMD+=(--enable-memory-saver)
SERVER_URL="http://127.0.0.1:${SGLANG_PORT}"

TRAIN_CMD=(
  torchrun
  --nnodes "${TRAIN_NODES}" --node-rank "${NODE_RANK}" --nproc-per-node "${GPUS_PER_NODE}"
  --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT:-29500}"
  -m megatron_rl.train
  "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${RL_ARGS[@]}"
  "${OPTIM_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}"
)

launch_colocated_node  # common.sh: check NODE_RANK, announce this node, its server, then train
