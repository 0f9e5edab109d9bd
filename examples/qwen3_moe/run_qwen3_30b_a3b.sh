#!/usr/bin/env bash
# 32-GPU RL job for Qwen3-30B-A3B: 2 nodes train (torchrun, megatron-core), 2 nodes serve
# rollouts (one SGLang server per node, TP 8 / EP 8). Run this script on EVERY node with the
# same environment; NODE_RANK decides the role.
#
#   HF_CKPT=/shared/Qwen3-30B-A3B PROMPTS=/shared/dapo-math-17k.parquet MASTER_ADDR=node0 \
#   ROLLOUT_HOSTS="node2 node3" NODE_RANK=0 bash examples/qwen3_moe/run_qwen3_30b_a3b.sh
#
# LOSS=vespo|epic|gspo|grpo|... and REPLAY=off|r2|r3 pick the arm; STALENESS is N; KL_COEF
# overrides the recipe's KL coefficient (see RL_ARGS); OPTIMIZER_CPU_OFFLOAD=1 keeps the Adam
# state in host memory (OPTIMIZER_OFFLOAD_FRACTION of it, default all).
# ASYNC=K, PARTIAL=1, CARRY_OVER=M, MASK_STALE=1: asynchronous rollouts (common.sh, async_args).
# RECIPE=epic-paper|vespo-paper with ARM=<arm> runs a paper's protocol instead (its table's values,
# megatron_rl/recipes.py; EVAL_DATA="aime24=/shared/aime24.jsonl ..." names the evaluation sets):
#   RECIPE=epic-paper ARM=ctpo EVAL_DATA="aime24=... aime25=... amc23=... hmmt25=..." NODE_RANK=0 ...
# DRY_RUN=1 prints the commands of this node instead of running them (and what it would check).
# Under SLURM: examples/qwen3_moe/slurm_qwen3_30b_a3b.sbatch sets the node variables.
#
# RUN_DIR must be on a filesystem every node sees: every node writes RUN_DIR/.nodes/node<RANK>
# and node 0 waits (NODE_WAIT_S, default 300 s) until all four are visible (LAUNCH_ID, set by the
# SLURM entry to the job id, tells this launch's markers from an earlier one's). A failed node
# ends the job: node 0 rewrites RUN_DIR/job.alive while training runs and removes it when it ends;
# the serving nodes stop their servers when it is removed or unchanged for HEARTBEAT_TIMEOUT s
# (default 300). torchrun ends every rank when one fails; SIGTERM/SIGINT to this script stops
# torchrun (and its ranks). Rerunning the same command resumes from the last checkpoint in
# RUN_DIR/checkpoints (the first run starts fresh: --load is the --save folder).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "${HERE}/common.sh"
source "${HERE}/model_qwen3_30b_a3b.sh"

PROMPTS=${PROMPTS:?set PROMPTS to a JSONL/Parquet prompt file (DAPO-Math-17k layout works)}
NODE_RANK=${NODE_RANK:?set NODE_RANK (0,1 train; 2,3 serve)}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the first training node}
ROLLOUT_HOSTS=(${ROLLOUT_HOSTS:?set ROLLOUT_HOSTS to the two serving nodes})
LOSS=${LOSS:-vespo}
REPLAY=${REPLAY:-off}
apply_recipe  # common.sh: RECIPE/ARM set LOSS, REPLAY and RECIPE_ARGS
STALENESS=${STALENESS:-8}
SGLANG_PORT=${SGLANG_PORT:-30000}
RUN_DIR=${RUN_DIR:-runs/qwen3-30b-a3b-${RECIPE:+${RECIPE}-}${ARM:-${LOSS}-${REPLAY}}-N${STALENESS}}
TRAIN_NODES=2
GPUS_PER_NODE=8
ROLLOUT_PROMPTS=64
SAMPLES_PER_PROMPT=8
init_launch

ROLLOUT_ARGS=(
  --rollout-engine sglang
  --weight-sync-transport distributed
  --sglang-engine-ranks 8
  --rollout-batch-size "${ROLLOUT_PROMPTS}"
  --n-samples-per-prompt "${SAMPLES_PER_PROMPT}"
  --max-response-length 16384
  --temperature 1.0
)
for host in "${ROLLOUT_HOSTS[@]}"; do
  ROLLOUT_ARGS+=(--sglang-url "http://${host}:${SGLANG_PORT}")
done
if [[ "${REPLAY}" == r3 ]]; then
  ROLLOUT_ARGS+=(--sglang-return-routed-experts)
fi

# KL to the frozen initial policy, per recipe (KL_COEF overrides): the EPIC paper's protocol uses
# 1e-3 for every method it compares, so epic and its baselines (grpo, dapo, gspo) keep it;
# VESPO's objective has no KL term (and slime's Qwen3-30B-A3B recipe uses 0). A KL term keeps a
# second copy of the policy's weights per GPU; it waits in host memory between old-logprob passes
# (--no-reference-offload keeps it on the GPU): see tools/memory_plan.py --reference.
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
if [[ "${OPTIMIZER_CPU_OFFLOAD:-0}" == 1 ]]; then
  OPTIM_ARGS+=(--optimizer-cpu-offload --optimizer-offload-fraction "${OPTIMIZER_OFFLOAD_FRACTION:-1.0}")
fi

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

# a serving node: one SGLang server on all 8 GPUs
SERVE_ARGS=(
  --model-path "${HF_CKPT}" --host 0.0.0.0 --base-port "${SGLANG_PORT}"
  --num-servers 1 --tp-size 8 --ep-size 8 --mem-fraction-static 0.7
  --log-dir "${RUN_DIR}"
)
if [[ "${REPLAY}" == r3 ]]; then SERVE_ARGS+=(--routed-experts); fi

async_args  # common.sh: ASYNC, PARTIAL, CARRY_OVER, MASK_STALE
TRAIN_CMD=(
  torchrun
  --nnodes "${TRAIN_NODES}" --node-rank "${NODE_RANK}" --nproc-per-node "${GPUS_PER_NODE}"
  --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT:-29500}"
  -m megatron_rl.train
  "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${RL_ARGS[@]}"
  "${OPTIM_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${ASYNC_ARGS[@]}"
  "${RECIPE_ARGS[@]}"
)

launch_node  # common.sh: check NODE_RANK, announce this node, then serve or train
