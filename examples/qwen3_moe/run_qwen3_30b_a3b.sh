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
source "${HERE}/model_qwen3_30b_a3b.sh"

PROMPTS=${PROMPTS:?set PROMPTS to a JSONL/Parquet prompt file (DAPO-Math-17k layout works)}
NODE_RANK=${NODE_RANK:?set NODE_RANK (0,1 train; 2,3 serve)}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the first training node}
ROLLOUT_HOSTS=(${ROLLOUT_HOSTS:?set ROLLOUT_HOSTS to the two serving nodes})
LOSS=${LOSS:-vespo}
REPLAY=${REPLAY:-off}
STALENESS=${STALENESS:-8}
SGLANG_PORT=${SGLANG_PORT:-30000}
RUN_DIR=${RUN_DIR:-runs/qwen3-30b-a3b-${LOSS}-${REPLAY}-N${STALENESS}}
TRAIN_NODES=2
GPUS_PER_NODE=8
ROLLOUT_PROMPTS=64
SAMPLES_PER_PROMPT=8
NODES=$(( TRAIN_NODES + ${#ROLLOUT_HOSTS[@]} ))
LAUNCH_ID=${LAUNCH_ID:-${SLURM_JOB_ID:-}}
NODE_WAIT_S=${NODE_WAIT_S:-300}
HEARTBEAT="${RUN_DIR}/job.alive"
HEARTBEAT_INTERVAL=${HEARTBEAT_INTERVAL:-15}
HEARTBEAT_TIMEOUT=${HEARTBEAT_TIMEOUT:-300}

dry_run() { [[ "${DRY_RUN:-0}" == 1 ]]; }

# The host of node $1 as this launch knows it (NODE_HOSTS: all of them, set by the SLURM entry).
node_host() {
  local hosts=(${NODE_HOSTS:-})
  if (( $1 < ${#hosts[@]} )); then echo "${hosts[$1]}"
  elif (( $1 == 0 )); then echo "${MASTER_ADDR}"
  elif (( $1 >= TRAIN_NODES )); then echo "${ROLLOUT_HOSTS[$1 - TRAIN_NODES]}"
  else echo "host unknown"; fi
}

# This node's marker in the run folder: "launch=<LAUNCH_ID> host=<hostname>".
announce_node() {
  local marker="${RUN_DIR}/.nodes/node${NODE_RANK}"
  if dry_run; then
    echo "# would write ${marker}: launch=${LAUNCH_ID} host=${HOSTNAME}"
    return
  fi
  mkdir -p "${RUN_DIR}/.nodes"
  echo "launch=${LAUNCH_ID} host=${HOSTNAME}" > "${marker}.tmp.$$"
  mv -f "${marker}.tmp.$$" "${marker}"
}

# Node 0: wait (bounded) until every node's marker of this launch is visible here.
wait_for_nodes() {
  local checks="RUN_DIR/.nodes/node0 .. node$(( NODES - 1 )) of launch '${LAUNCH_ID}'"
  if dry_run; then
    echo "# would wait up to ${NODE_WAIT_S} s for ${checks} (RUN_DIR=${RUN_DIR} on a filesystem every node sees)"
    return
  fi
  if [[ -z "${LAUNCH_ID}" ]]; then
    echo "note: LAUNCH_ID is unset, so markers left in ${RUN_DIR}/.nodes by an earlier launch count too; set the same LAUNCH_ID on every node for a strict check" >&2
  fi
  local deadline=$(( SECONDS + NODE_WAIT_S )) missing marker line n
  while :; do
    missing=()
    for (( n = 0; n < NODES; n++ )); do
      marker="${RUN_DIR}/.nodes/node${n}"
      line=$(head -n 1 "${marker}" 2>/dev/null || true)
      if [[ "${line}" != "launch=${LAUNCH_ID} host="* ]]; then
        missing+=("node ${n} ($(node_host "${n}"))")
      fi
    done
    (( ${#missing[@]} == 0 )) && return 0
    if (( SECONDS >= deadline )); then
      local IFS=,
      echo "error: after ${NODE_WAIT_S} s node 0 (${HOSTNAME}) still does not see the markers of ${missing[*]} in $(cd "${RUN_DIR}" && pwd)/.nodes: RUN_DIR must be on a filesystem every node sees (and every node must run this launch, LAUNCH_ID='${LAUNCH_ID}')" >&2
      return 1
    fi
    sleep 2
  done
}

# Node 0: rewrite the heartbeat while this script lives (the loop ends with it, even on SIGKILL).
start_heartbeat() {
  if dry_run; then
    echo "# would rewrite ${HEARTBEAT} every ${HEARTBEAT_INTERVAL} s while training runs, and remove it when it ends"
    return
  fi
  local script_pid=$$ beat=1
  write_beat() {
    echo "host=${HOSTNAME} beat=$1 time=$(date +%s)" > "${HEARTBEAT}.tmp"
    mv -f "${HEARTBEAT}.tmp" "${HEARTBEAT}"
  }
  write_beat "${beat}"  # the first beat before anything else starts
  (
    while sleep "${HEARTBEAT_INTERVAL}" && kill -0 "${script_pid}" 2>/dev/null; do
      beat=$(( beat + 1 ))
      write_beat "${beat}"
    done
  ) &
  HEARTBEAT_PID=$!
}

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
  --wandb-exp-name "qwen3-30b-a3b-${LOSS}-${REPLAY}-N${STALENESS}"
)

if (( NODE_RANK < 0 || NODE_RANK >= NODES )); then
  echo "error: NODE_RANK=${NODE_RANK}: must be 0..$(( NODES - 1 ))" >&2
  exit 1
fi
announce_node

if (( NODE_RANK >= TRAIN_NODES )); then
  # a serving node: one SGLang server on all 8 GPUs; SIGTERM to this script stops it, and so does
  # the end of the training job (its heartbeat removed, or unchanged for HEARTBEAT_TIMEOUT s)
  SERVE_ARGS=(
    --model-path "${HF_CKPT}" --host 0.0.0.0 --base-port "${SGLANG_PORT}"
    --num-servers 1 --tp-size 8 --ep-size 8 --mem-fraction-static 0.7
    --log-dir "${RUN_DIR}"
    --heartbeat-file "${HEARTBEAT}" --heartbeat-timeout "${HEARTBEAT_TIMEOUT}"
  )
  if [[ "${REPLAY}" == r3 ]]; then SERVE_ARGS+=(--routed-experts); fi
  if dry_run; then SERVE_ARGS+=(--dry-run); fi
  exec python -m megatron_rl.rollout.serve "${SERVE_ARGS[@]}"
fi

# A training node. megatron-core's tensor/sequence-parallel layers issue their all-gather and
# reduce-scatter before the weight-gradient GEMM they overlap with, and rely on the GPU running
# kernels in issue order (one hardware queue) for that overlap (see its tensor_parallel/layers.py
# and distributed/param_and_grad_buffer.py). No NCCL variables are set: torch's defaults already
# abort a rank on an NCCL error or timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING), and the network
# choices (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) belong to the cluster's environment.
export CUDA_DEVICE_MAX_CONNECTIONS=1
if dry_run; then echo "export CUDA_DEVICE_MAX_CONNECTIONS=1"; fi

TRAIN_CMD=(
  torchrun
  --nnodes "${TRAIN_NODES}" --node-rank "${NODE_RANK}" --nproc-per-node "${GPUS_PER_NODE}"
  --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT:-29500}"
  -m megatron_rl.train
  "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${RL_ARGS[@]}"
  "${OPTIM_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}"
)

if dry_run; then
  if (( NODE_RANK == 0 )); then start_heartbeat; wait_for_nodes; fi
  echo "${TRAIN_CMD[*]}"
  exit 0
fi

# torchrun in the background under traps: SIGTERM/SIGINT (or any exit of this script) stops it,
# which stops its ranks; node 0 then removes the heartbeat so the serving nodes stop at once.
TORCHRUN_PID=
HEARTBEAT_PID=
stop_training() {
  trap - EXIT TERM INT
  if [[ -n "${TORCHRUN_PID}" ]] && kill -0 "${TORCHRUN_PID}" 2>/dev/null; then
    kill -TERM "${TORCHRUN_PID}" 2>/dev/null || true
    wait "${TORCHRUN_PID}" 2>/dev/null || true
  fi
  if [[ -n "${HEARTBEAT_PID}" ]]; then
    kill "${HEARTBEAT_PID}" 2>/dev/null || true
    wait "${HEARTBEAT_PID}" 2>/dev/null || true
    rm -f "${HEARTBEAT}"
  fi
}
trap 'stop_training' EXIT
trap 'echo "signal: stopping torchrun" >&2; stop_training; exit 143' TERM INT
if (( NODE_RANK == 0 )); then
  start_heartbeat
  wait_for_nodes
fi
"${TRAIN_CMD[@]}" &
TORCHRUN_PID=$!
status=0
wait "${TORCHRUN_PID}" || status=$?
exit "${status}"
