#!/usr/bin/env bash
# 64-GPU RL job for Qwen3-235B-A22B: 4 nodes train (torchrun, megatron-core, 32 GPUs: TP 4 + SP,
# PP 4, EP 8, DP 2), 4 nodes serve rollouts (one SGLang server per node, TP 8 / EP 8). Run this
# script on EVERY node with the same environment; NODE_RANK decides the role.
#
#   HF_CKPT=/shared/Qwen3-235B-A22B PROMPTS=/shared/dapo-math-17k.parquet MASTER_ADDR=node0 \
#   ROLLOUT_HOSTS="node4 node5 node6 node7" NODE_RANK=0 bash examples/qwen3_moe/run_qwen3_235b_a22b.sh
#
# LOSS=vespo|epic|gspo|grpo|... and REPLAY=off|r2|r3 pick the arm; STALENESS is N; KL_COEF
# overrides the recipe's KL coefficient. The Adam state always lives in host memory
# (--optimizer-cpu-offload: the model does not fit 32 80-GB GPUs without it, see the memory plan
# below); OPTIMIZER_OFFLOAD_FRACTION (default 1.0) keeps only that share of it there.
# ASYNC_SAVE=1 writes checkpoints in the background (--async-save).
# ASYNC=K, PARTIAL=1, CARRY_OVER=M, MASK_STALE=1: asynchronous rollouts (common.sh, async_args).
# RECIPE=epic-paper|vespo-paper with ARM=<arm> and EVAL_DATA runs a paper's protocol (see
# run_qwen3_30b_a3b.sh and megatron_rl/recipes.py).
# DRY_RUN=1 prints the commands of this node instead of running them (and what it would check).
# Under SLURM: examples/qwen3_moe/slurm_qwen3_235b_a22b.sbatch sets the node variables.
#
# RUN_DIR must be on a filesystem every node sees: every node writes RUN_DIR/.nodes/node<RANK>
# and node 0 waits (NODE_WAIT_S, default 300 s) until all of them are visible (LAUNCH_ID, set by
# the SLURM entry to the job id, tells this launch's markers from an earlier one's). A failed node
# ends the job: node 0 rewrites RUN_DIR/job.alive while training runs and removes it when it
# ends; the serving nodes stop their servers when it is removed or unchanged for
# HEARTBEAT_TIMEOUT s (default 300). torchrun ends every rank when one fails; SIGTERM/SIGINT to
# this script stops torchrun (and its ranks). Rerunning the same command resumes from the last
# checkpoint in RUN_DIR/checkpoints (the first run starts fresh: --load is the --save folder);
# checkpoints are megatron dist-checkpointing (torch_dist), so a rerun may also change the layout.
#
# ---------------------------------------------------------------------------- memory plan
# Per GPU, from tools/memory_plan.py (bf16, full recompute, micro-batches of one 2,048 + 16,384
# token sample, R2 recordings on the GPU, the KL reference's weights on the GPU during its pass:
# the worst arm). Parameters, gradient buffers, optimizer state, routing state and the reference
# are counted exactly; activations, logits and the 4 GiB reserve are estimates.
#
#   python tools/memory_plan.py --model qwen3-235b-a22b --tp 4 --pp 4 --ep 8 --world-size 32 \
#       --decoder-first-pipeline-num-layers 23 --decoder-last-pipeline-num-layers 23 \
#       --optimizer-offload-fraction 1 --micro-batch-tokens 18432 --routing-replay r2 \
#       --routing-responses 512 --routing-response-tokens 18432 --reference gpu --gpu-gib 80
#
#   chosen: TP4+SP PP4 (23/24/24/23) EP8 DP2, EDP1, stage 1 (the fullest), GiB:
#     parameters, bf16 (dense + experts) 14.32; fp32 gradient buffers 28.64; optimizer on GPU 0
#     (all offloaded); routing state + targets (R2) 0.22; reference model (KL arms) 14.32;
#     reserve 4.00; static 61.50, then the largest phase of a step: a recomputed layer's
#     backward 3.93 (the last layer's attention 3.06, the chunked gradient check 0.44)
#     total 65.43 GiB at "backward: a recomputed layer"  FITS 80 (stages 0-3: 64.9-65.4)
#     host memory: Adam master/m/v + grad copy 111.28 per GPU
#   i.e. about 0.9 TiB of host memory per training node (+ 14 GiB per GPU for the offloaded KL
#   reference between its passes): the training nodes need 2 TiB-class hosts. Keeping part of the
#   state on the GPU: OPTIMIZER_OFFLOAD_FRACTION=0.9 plans 73.8 GiB (fits), 0.8 does not (82.1).
#   The same without offload: 148.9 GiB on stage 1 (the expert Adam state, 12 B per parameter
#   with no expert data parallelism to shard it over, is 81 GiB alone). The trainer checks the
#   gradients for NaN/Inf in chunks (backend/grad_check.py): over a whole buffer at once that
#   check alone held 47 GiB and this layout planned 108.8 GiB.
#
#   without pipeline parallelism (same 32 GPUs, TP4+SP, full offload, same options):
#     EP8  DP8 (EDP4):  237.5 GiB  DOES NOT FIT (56.7 GiB of bf16 params, 113.3 GiB of fp32 grads)
#     EP16 DP8 (EDP2):  131.7 GiB  DOES NOT FIT (params + grads alone 90.7 GiB)
#     EP32 DP8 (EDP1):   78.9 GiB  fits with 1.1 GiB to spare (61.8 GiB without the KL
#                                  reference), with an all-to-all across all 4 nodes in every
#                                  one of the 94 MoE layers
#   16 GPUs (TP4 PP4 EP4 DP1) do not fit either: 91.8 GiB without the reference (the params and
#   fp32 grads of 1/16 of the 227B expert parameters and of a stage's attention: 83.5 GiB).
#   PP4 EP8 keeps each pipeline stage on one node, so the expert all-to-all stays on NVLink and only the stage-to-stage activations and
#   the DP2 gradient reduction cross nodes. The bubble: 32 micro-batches per rank and step at
#   STALENESS=8, (4-1)/(32+4-1) = 9%.
#
# The serving nodes hold the whole model per server: 235B bf16 parameters are 54.7 GiB of each
# GPU's 80 at TP 8, so SGLang gets --mem-fraction-static 0.85 (about 12 GiB of KV cache per GPU).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "${HERE}/common.sh"
source "${HERE}/model_qwen3_235b_a22b.sh"

PROMPTS=${PROMPTS:?set PROMPTS to a JSONL/Parquet prompt file (DAPO-Math-17k layout works)}
NODE_RANK=${NODE_RANK:?set NODE_RANK (0..3 train; 4.. serve)}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the first training node}
ROLLOUT_HOSTS=(${ROLLOUT_HOSTS:?set ROLLOUT_HOSTS to the serving nodes (one SGLang server each)})
LOSS=${LOSS:-vespo}
REPLAY=${REPLAY:-off}
apply_recipe  # common.sh: RECIPE/ARM (a paper's protocol at its scale) set LOSS, REPLAY, RECIPE_ARGS
STALENESS=${STALENESS:-8}
SGLANG_PORT=${SGLANG_PORT:-30000}
RUN_DIR=${RUN_DIR:-runs/qwen3-235b-a22b-${RECIPE:+${RECIPE}-}${ARM:-${LOSS}-${REPLAY}}-N${STALENESS}}
TRAIN_NODES=4
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

# KL to the frozen initial policy, per recipe (KL_COEF overrides), as for Qwen3-30B-A3B: 1e-3 for
# epic and its baselines, 0 for VESPO. The reference's weights wait in host memory between
# old-logprob passes (the memory plan above counts them on the GPU, during the pass).
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
  --optimizer-cpu-offload
  --optimizer-offload-fraction "${OPTIMIZER_OFFLOAD_FRACTION:-1.0}"
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
  --ckpt-format torch_dist
  --wandb-project "${WANDB_PROJECT:-megatron-rl}"
  --wandb-exp-name "$(basename "${RUN_DIR}")"
)
if [[ "${ASYNC_SAVE:-0}" == 1 ]]; then OUTPUT_ARGS+=(--async-save); fi

# a serving node: one SGLang server on all 8 GPUs
SERVE_ARGS=(
  --model-path "${HF_CKPT}" --host 0.0.0.0 --base-port "${SGLANG_PORT}"
  --num-servers 1 --tp-size 8 --ep-size 8 --mem-fraction-static 0.85
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
