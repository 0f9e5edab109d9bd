# shellcheck shell=bash
# Shared by the Qwen3-MoE launchers (sourced, never run), as slime's launchers are: a model file
# (models/*.sh) sets the model's arguments and topology, a run script sets its nodes, and
# `rl_job_args` here builds everything else of the RL job (the trainer's torchrun command and the
# SGLang servers' arguments) from the environment. The nodes themselves (roles, shared-filesystem
# check, heartbeat, torchrun under traps, colocated nodes, the SLURM entry) are nodes.sh.
#
# The environment rl_job_args reads (every launcher; docs/cluster-launch.md):
#   PROMPTS (required), LOSS (vespo), REPLAY (off|r2|r3), STALENESS (N, 8), KL_COEF (default per
#   loss: `python -m megatron_rl.recipes --kl-default LOSS`), SGLANG_PORT (30000), MASTER_PORT
#   (29500), RUN_DIR (runs/<run name>-<arm>-N<N>), WANDB_PROJECT (megatron-rl); RECIPE, ARM,
#   EVAL_DATA (apply_recipe); ASYNC, PARTIAL, CARRY_OVER, CARRY_OVER_ROUND_TOKENS, MASK_STALE
#   (async_args); OPTIMIZER_CPU_OFFLOAD=1 and OPTIMIZER_OFFLOAD_FRACTION (the Adam state in host
#   memory, where the model file makes it optional); ASYNC_SAVE=1 (torch_dist checkpoints only);
#   DRY_RUN=1 prints the commands of this node instead of running them.
# Overrides of the model file's shape, for other clusters and for the one-machine rehearsal
# (tools/rehearse_launchers.py): GPUS_PER_NODE; TRAIN_PARALLEL (replaces the model file's
# PARALLEL_ARGS, e.g. "--tensor-model-parallel-size 1 --expert-model-parallel-size 2");
# SERVER_TP, SERVER_EP, SERVER_MEM_FRACTION; SERVER_BIND_HOST (the address the servers listen on,
# 0.0.0.0); TRAIN_EXTRA_ARGS (trainer flags appended last, so they win over everything before);
# SGLANG_EXTRA_ARGS (flags for every SGLang server, through serve's --sglang-args).
source "$(dirname "${BASH_SOURCE[0]}")/nodes.sh"

dry_run() { [[ "${DRY_RUN:-0}" == 1 ]]; }

# RECIPE=<name> ARM=<arm>: a paper's protocol (megatron_rl/recipes.py) instead of LOSS/REPLAY.
# Sets RECIPE_ARGS (the arm's trainer flags at the paper's scale, staleness STALENESS when set,
# then one --eval-prompt-data per EVAL_DATA entry "NAME=PATH"), and LOSS and REPLAY from the
# arm's flags (run names, the servers' --routed-experts). The recipe's flags come last on the
# trainer's command line, so they win over the launcher's defaults. Without RECIPE: nothing.
apply_recipe() {
  RECIPE_ARGS=()
  [[ -n "${RECIPE:-}" ]] || return 0
  ARM=${ARM:?set ARM to an arm of RECIPE=${RECIPE} (python -m megatron_rl.recipes --list)}
  local data=(${EVAL_DATA:?set EVAL_DATA to the evaluation sets, "NAME=PATH NAME=PATH ..."})
  local staleness=()
  if [[ -n "${STALENESS:-}" ]]; then staleness=(--staleness "${STALENESS}"); fi
  mapfile -t RECIPE_ARGS < <(${PYTHON:-python} -m megatron_rl.recipes "${RECIPE}" "${ARM}" --scale "${staleness[@]}")
  (( ${#RECIPE_ARGS[@]} )) || { echo "RECIPE=${RECIPE} ARM=${ARM}: no flags (see above)" >&2; exit 2; }
  local i
  LOSS=${ARM} REPLAY=off
  for (( i = 0; i + 1 < ${#RECIPE_ARGS[@]}; i++ )); do
    case "${RECIPE_ARGS[i]}" in
      --loss) LOSS=${RECIPE_ARGS[i + 1]} ;;
      --routing-replay) REPLAY=${RECIPE_ARGS[i + 1]} ;;
    esac
  done
  for i in "${data[@]}"; do RECIPE_ARGS+=(--eval-prompt-data "${i}"); done
}

# Asynchrony (ASYNC_ARGS, none by default; docs/trainer.md, "Asynchronous rollouts"):
#   ASYNC=K                 generate up to K rollouts ahead of training (--async-rollout
#                           --max-staleness K)
#   PARTIAL=1               with ASYNC: requests in flight at a weight sync are paused in SGLang's
#                           retract mode and finish under the new weights (--partial-rollout)
#   CARRY_OVER=M            M groups more than the batch in flight; a step trains on the first
#                           finished groups, the rest carry over (--carry-over-groups), in rounds
#                           of CARRY_OVER_ROUND_TOKENS tokens (default: a quarter of the length)
#   MASK_STALE=1            tokens more than K versions old leave the loss (--mask-stale-tokens)
# PARTIAL and CARRY_OVER make samples span weight versions, so the engine's log-probs become the
# behaviour policy (--behavior-logprobs rollout) unless the arm sets a --rollout-correction.
async_args() {
  ASYNC_ARGS=()
  if [[ -n "${ASYNC:-}" ]]; then ASYNC_ARGS+=(--async-rollout --max-staleness "${ASYNC}"); fi
  if [[ "${PARTIAL:-0}" == 1 ]]; then
    ASYNC_ARGS+=(--partial-rollout --sglang-pause-mode retract)
  fi
  if [[ -n "${CARRY_OVER:-}" ]]; then
    ASYNC_ARGS+=(--carry-over-groups "${CARRY_OVER}")
    if [[ -n "${CARRY_OVER_ROUND_TOKENS:-}" ]]; then
      ASYNC_ARGS+=(--carry-over-round-tokens "${CARRY_OVER_ROUND_TOKENS}")
    fi
  fi
  if [[ "${MASK_STALE:-0}" == 1 ]]; then ASYNC_ARGS+=(--mask-stale-tokens); fi
  if [[ "${PARTIAL:-0}" == 1 || -n "${CARRY_OVER:-}" ]]; then
    ASYNC_ARGS+=(--behavior-logprobs rollout)
  fi
}


# Colocated mode is synchronous (the servers hold no KV cache between steps, and the next rollout
# cannot generate while the trainer holds the GPUs) and has no evaluation: its knobs are refused.
refuse_async_knobs() {
  local knob
  for knob in RECIPE ARM ASYNC CARRY_OVER MASK_STALE; do
    if [[ -n "${!knob:-}" ]]; then
      echo "error: ${knob}=${!knob}: colocated mode is synchronous and has no evaluation;" \
        "use run_qwen3_30b_a3b.sh" >&2
      exit 2
    fi
  done
  if [[ "${PARTIAL:-0}" == 1 ]]; then
    echo "error: PARTIAL=1: colocated mode is synchronous; use run_qwen3_30b_a3b.sh" >&2
    exit 2
  fi
}

# The RL job's arguments, from the model file (MODEL_NAME, MODEL_ARGS, PARALLEL_ARGS, GPUS_PER_NODE,
# SERVER_TP, SERVER_EP, SERVER_MEM_FRACTION, OPTIMIZER_OFFLOAD=always|opt-in, CKPT_FORMAT and
# optionally SERVER_CKPT, the servers' checkpoint when it is not HF_CKPT), the
# run script (TRAIN_NODES, ROLLOUT_HOSTS: the serving nodes, RUN_NAME; COLOCATE=1 with
# NODE_HOSTS: every node trains and serves) and the environment above. Sets LOSS, REPLAY,
# STALENESS, RUN_DIR, the launch variables (init_launch), TRAIN_CMD and SERVE_ARGS.
rl_job_args() {
  PROMPTS=${PROMPTS:?set PROMPTS to a JSONL/Parquet prompt file (DAPO-Math-17k layout works)}
  LOSS=${LOSS:-vespo}
  REPLAY=${REPLAY:-off}
  apply_recipe  # RECIPE/ARM (a paper's protocol at its scale) set LOSS, REPLAY, RECIPE_ARGS
  STALENESS=${STALENESS:-8}
  SGLANG_PORT=${SGLANG_PORT:-30000}
  local arm=${RECIPE:+${RECIPE}-}${ARM:-${LOSS}-${REPLAY}}
  RUN_DIR=${RUN_DIR:-runs/${RUN_NAME:-${MODEL_NAME}}-${arm}-N${STALENESS}}
  init_launch
  if [[ -n "${TRAIN_PARALLEL:-}" ]]; then PARALLEL_ARGS=(${TRAIN_PARALLEL}); fi
  local prompts=64 samples=8 host server_hosts=("${ROLLOUT_HOSTS[@]}")
  local rollout=(--rollout-engine sglang --weight-sync-transport distributed)
  if [[ "${COLOCATE:-0}" == 1 ]]; then
    rollout=(--rollout-engine sglang --colocate --weight-sync-transport tensor)
    server_hosts=(${NODE_HOSTS})
  fi
  rollout+=(
    --sglang-engine-ranks "${SERVER_TP}"
    --rollout-batch-size "${prompts}"
    --n-samples-per-prompt "${samples}"
    --max-response-length 16384
    --temperature 1.0
  )
  for host in "${server_hosts[@]}"; do rollout+=(--sglang-url "http://${host}:${SGLANG_PORT}"); done
  if [[ "${REPLAY}" == r3 ]]; then rollout+=(--sglang-return-routed-experts); fi

  # KL to the frozen initial policy: KL_COEF, else the loss's default (megatron_rl/recipes.py).
  # A KL term keeps a second copy of the policy's weights per GPU; it waits in host memory
  # between old-logprob passes (see tools/memory_plan.py --reference).
  KL_COEF=${KL_COEF:-$(${PYTHON:-python} -m megatron_rl.recipes --kl-default "${LOSS}")}
  local rl=(
    --loss "${LOSS}" --advantage-estimator grpo --routing-replay "${REPLAY}"
    --routing-dtype auto --kl-coef "${KL_COEF}"
  )
  # staleness N: one rollout of 512 samples is consumed by N sequential optimizer steps. The Adam
  # state in host memory: always where the model needs it (placed before --seed), else on request.
  local offload=(
    --optimizer-cpu-offload --optimizer-offload-fraction "${OPTIMIZER_OFFLOAD_FRACTION:-1.0}"
  )
  local optim=(
    --train-iters 300 --micro-batch-size 1
    --global-batch-size $(( prompts * samples / STALENESS ))
    --lr 1e-6 --clip-grad 1.0 --use-distributed-optimizer --overlap-grad-reduce
  )
  if [[ "${OPTIMIZER_OFFLOAD}" == always ]]; then optim+=("${offload[@]}"); fi
  optim+=(--seed 1234)
  if [[ "${OPTIMIZER_OFFLOAD}" == opt-in && "${OPTIMIZER_CPU_OFFLOAD:-0}" == 1 ]]; then
    optim+=("${offload[@]}")
  fi
  local data=(--prompt-data "${PROMPTS}" --max-prompt-length 2048 --reward math)
  local output=(
    --run-dir "${RUN_DIR}" --save "${RUN_DIR}/checkpoints" --load "${RUN_DIR}/checkpoints"
    --save-interval 20
  )
  if [[ -n "${CKPT_FORMAT:-}" ]]; then output+=(--ckpt-format "${CKPT_FORMAT}"); fi
  output+=(
    --wandb-project "${WANDB_PROJECT:-megatron-rl}" --wandb-exp-name "$(basename "${RUN_DIR}")"
  )
  if [[ "${CKPT_FORMAT:-}" == torch_dist && "${ASYNC_SAVE:-0}" == 1 ]]; then
    output+=(--async-save)
  fi
  async_args  # ASYNC, PARTIAL, CARRY_OVER, MASK_STALE
  TRAIN_CMD=(
    torchrun
    --nnodes "${TRAIN_NODES}" --node-rank "${NODE_RANK}" --nproc-per-node "${GPUS_PER_NODE}"
    --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT:-29500}"
    -m megatron_rl.train
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${rollout[@]}" "${rl[@]}"
    "${optim[@]}" "${data[@]}" "${output[@]}" "${ASYNC_ARGS[@]}" "${RECIPE_ARGS[@]}"
    ${TRAIN_EXTRA_ARGS:-}
  )
  # one SGLang server per node on all of its GPUs (megatron_rl.rollout.serve), on SERVER_CKPT
  # where the model file sets one (DeepSeek-V3: the block-FP8 release), else on HF_CKPT
  SERVE_ARGS=(
    --model-path "${SERVER_CKPT:-${HF_CKPT}}" --host "${SERVER_BIND_HOST:-0.0.0.0}" --base-port "${SGLANG_PORT}"
    --num-servers 1 --tp-size "${SERVER_TP}" --ep-size "${SERVER_EP}"
    --mem-fraction-static "${SERVER_MEM_FRACTION}"
  )
  # SGLang's own interpreter on every serving node, colocated or not: sglang 0.5.23 pins torch
  # and transformers versions the trainer's environment does not hold
  if [[ -n "${SGLANG_PYTHON:-}" ]]; then SERVE_ARGS+=(--python "${SGLANG_PYTHON}"); fi
  if [[ -n "${SGLANG_EXTRA_ARGS:-}" ]]; then SERVE_ARGS+=(--sglang-args "${SGLANG_EXTRA_ARGS}"); fi
  if [[ "${COLOCATE:-0}" == 1 ]]; then
    # released and resumed by the trainer, CUDA graphs included; output in the node's log
    SERVE_ARGS+=(--memory-saver --health-timeout "${SERVER_WAIT_S:-900}")
  else
    # a folder per node: every serving node numbers its servers' logs from sglang_0.log
    SERVE_ARGS+=(--log-dir "${RUN_DIR}/logs/node${NODE_RANK}")
  fi
  if [[ "${REPLAY}" == r3 ]]; then SERVE_ARGS+=(--routed-experts); fi
}
