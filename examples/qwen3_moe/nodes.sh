# shellcheck shell=bash
# The nodes of a Qwen3-MoE job (sourced by common.sh, never run): node roles, the
# shared-filesystem check, the heartbeat that ties the serving nodes to training, torchrun under
# traps, colocated nodes, and the SLURM entry. Nothing here knows the model or the trainer's
# arguments (common.sh, rl_job_args, builds those).
#
# Set before `init_launch`: RUN_DIR, NODE_RANK, MASTER_ADDR, ROLLOUT_HOSTS (array), TRAIN_NODES,
# GPUS_PER_NODE; before `launch_node`: SERVE_ARGS (array: the arguments of
# `python -m megatron_rl.rollout.serve`) and TRAIN_CMD (array: a training node's torchrun).

# The per-launch variables every node derives the same way (the environment overrides them).
init_launch() {
  NODES=$(( TRAIN_NODES + ${#ROLLOUT_HOSTS[@]} ))
  LAUNCH_ID=${LAUNCH_ID:-${SLURM_JOB_ID:-}}
  NODE_WAIT_S=${NODE_WAIT_S:-300}
  HEARTBEAT="${RUN_DIR}/job.alive"
  HEARTBEAT_INTERVAL=${HEARTBEAT_INTERVAL:-15}
  HEARTBEAT_TIMEOUT=${HEARTBEAT_TIMEOUT:-300}
  TORCHRUN_PID=
  HEARTBEAT_PID=
}

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

# torchrun (and its ranks) stop, then node 0's heartbeat goes so the serving nodes stop at once.
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

# A serving node: the SGLang servers of SERVE_ARGS, stopped by SIGTERM to this script (serve
# replaces it) or by the end of the training job (its heartbeat removed, or unchanged for
# HEARTBEAT_TIMEOUT s).
serve_node() {
  SERVE_ARGS+=(--heartbeat-file "${HEARTBEAT}" --heartbeat-timeout "${HEARTBEAT_TIMEOUT}")
  if dry_run; then SERVE_ARGS+=(--dry-run); fi
  exec python -m megatron_rl.rollout.serve "${SERVE_ARGS[@]}"
}

# A training node: TRAIN_CMD under traps (node 0 also beats and checks every node is there).
train_node() {
  # megatron-core's tensor/sequence-parallel layers issue their all-gather and reduce-scatter
  # before the weight-gradient GEMM they overlap with, and rely on the GPU running kernels in
  # issue order (one hardware queue) for that overlap (see its tensor_parallel/layers.py and
  # distributed/param_and_grad_buffer.py). No NCCL variables are set: torch's defaults already
  # abort a rank on an NCCL error or timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING), and the network
  # choices (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) belong to the cluster's environment.
  export CUDA_DEVICE_MAX_CONNECTIONS=1
  if dry_run; then
    echo "export CUDA_DEVICE_MAX_CONNECTIONS=1"
    if (( NODE_RANK == 0 )); then start_heartbeat; wait_for_nodes; fi
    echo "${TRAIN_CMD[*]}"
    exit 0
  fi
  # torchrun in the background under traps: SIGTERM/SIGINT (or any exit of this script) stops
  # it, which stops its ranks; node 0 then removes the heartbeat.
  trap 'stop_training' EXIT
  trap 'echo "signal: stopping torchrun" >&2; stop_training; exit 143' TERM INT
  if (( NODE_RANK == 0 )); then
    start_heartbeat
    wait_for_nodes
  fi
  "${TRAIN_CMD[@]}" &
  TORCHRUN_PID=$!
  local status=0
  wait "${TORCHRUN_PID}" || status=$?
  exit "${status}"
}

# This node's role from NODE_RANK: 0 .. TRAIN_NODES-1 train, the rest serve.
launch_node() {
  if (( NODE_RANK < 0 || NODE_RANK >= NODES )); then
    echo "error: NODE_RANK=${NODE_RANK}: must be 0..$(( NODES - 1 ))" >&2
    exit 1
  fi
  announce_node
  if (( NODE_RANK >= TRAIN_NODES )); then serve_node; fi
  train_node
}

# The SLURM entry: slurm_entry SELF RUN_SCRIPT NODES TRAIN_NODES [--node] (NODES "all": as many
# as the allocation has, all training; the run script gets NUM_NODES). The batch step maps
# the allocation onto the run script's variables and starts one srun task per node (srun's
# --kill-on-bad-exit=1 ends every task when one exits non-zero); each task (--node) runs the run
# script with NODE_RANK=SLURM_NODEID. DRY_RUN=1 prints the srun command, then the commands of
# every node, each after a "## node N (host)" line. The one task of a node gets every core of it
# (--cpus-per-task from SLURM_CPUS_ON_NODE; srun does not inherit sbatch's CPU count) and no CPU
# binding (--cpu-bind=none): under cgroup task binding torchrun's 8 ranks, their data loaders and
# the SGLang servers would otherwise share the task's single default CPU.
slurm_entry() {
  local self=$1 run_script=$2 nodes=$3 train_nodes=$4
  shift 4
  if [[ "${1:-}" == --node ]]; then
    # one srun task: this node's role from SLURM (one task per node, so PROCID == NODEID)
    NODE_RANK=${SLURM_NODEID:?--node runs inside srun (SLURM_NODEID unset)}
    if [[ "${SLURM_PROCID:-${NODE_RANK}}" != "${NODE_RANK}" ]]; then
      echo "error: SLURM_PROCID=${SLURM_PROCID} != SLURM_NODEID=${NODE_RANK}: run one task per node" >&2
      exit 1
    fi
    export NODE_RANK
    exec bash "${run_script}"
  fi
  # the batch step: node roles from the allocation, then one task per node
  local hosts node
  mapfile -t hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?run under sbatch (SLURM_JOB_NODELIST unset)}")
  if [[ "${nodes}" == all ]]; then  # every node of the allocation trains (colocated mode)
    nodes=${#hosts[@]} train_nodes=${#hosts[@]}
  fi
  if (( ${#hosts[@]} != nodes )); then
    echo "error: the allocation has ${#hosts[@]} nodes (${hosts[*]}); this job needs ${nodes}" >&2
    exit 1
  fi
  export MASTER_ADDR="${hosts[0]}"
  export ROLLOUT_HOSTS="${hosts[*]:train_nodes}"
  export NODE_HOSTS="${hosts[*]}"
  export LAUNCH_ID="${SLURM_JOB_ID:?run under sbatch (SLURM_JOB_ID unset)}"
  export NUM_NODES="${nodes}"
  local cpus=${SLURM_CPUS_ON_NODE:?run under sbatch (SLURM_CPUS_ON_NODE unset)}
  local step=(
    srun --nodes="${nodes}" --ntasks="${nodes}" --ntasks-per-node=1 --kill-on-bad-exit=1
    --cpus-per-task="${cpus}" --cpu-bind=none
    bash "${self}" --node
  )
  if ! dry_run; then
    exec "${step[@]}"
  fi
  echo "${step[*]}"
  for (( node = 0; node < nodes; node++ )); do
    echo "## node ${node} (${hosts[node]})"
    SLURM_NODEID=${node} SLURM_PROCID=${node} bash "${self}" --node
  done
}

# ----------------------------------------------------------------------------- colocated mode
# The trainer's --colocate (run_qwen3_30b_a3b_colocated.sh): every node trains AND serves, on the
# same GPUs. A run script sets SERVE_ARGS (this node's server on all of its GPUs: the arguments of
# `python -m megatron_rl.rollout.serve`, with --memory-saver and --health-timeout SERVER_WAIT_S)
# and TRAIN_CMD, then calls `launch_colocated_node`. The server starts first, by serve in a
# process group of its own (log: RUN_DIR/sglang-node<RANK>.log), and must answer /health (serve
# then prints its "URL" line) before torchrun starts: SGLang sizes its KV cache from the memory
# free when it starts, so the trainer must hold none of it yet. The server stops (SIGTERM to
# serve, which stops its server; SIGKILL after 45 s) when training ends, fails, or this script is
# signalled; torchrun ends every node's ranks when one fails, so every node's server goes with it.

# Start serve in the background and wait until it reports its server healthy; 1 if it exits
# first (its server died, or did not answer /health within its --health-timeout).
start_server() {
  local log="${RUN_DIR}/sglang-node${NODE_RANK}.log" first=1
  mkdir -p "${RUN_DIR}"
  # appended: a resumed launch keeps the log of the run it resumes (the server's side of a
  # crash); only this launch's lines (from line `first`) count
  if [[ -f "${log}" ]]; then first=$(( $(wc -l < "${log}") + 1 )); fi
  setsid python -m megatron_rl.rollout.serve "${SERVE_ARGS[@]}" >> "${log}" 2>&1 &
  SERVER_PID=$!
  until tail -n "+${first}" "${log}" | grep -q '^URL '; do
    if ! kill -0 "${SERVER_PID}" 2>/dev/null; then
      echo "error: node ${NODE_RANK}'s SGLang server exited before answering /health; see ${log}" >&2
      stop_server  # what is left of its group
      return 1
    fi
    sleep 1
  done
}

# Stop serve (its own group leader: setsid), which stops its server's process group.
stop_server() {
  [[ -n "${SERVER_PID:-}" ]] || return 0
  kill -TERM -- "-${SERVER_PID}" 2>/dev/null || true
  local i
  for (( i = 0; i < 45; i++ )); do
    kill -0 "${SERVER_PID}" 2>/dev/null || break
    sleep 1
  done
  kill -KILL -- "-${SERVER_PID}" 2>/dev/null || true
  wait "${SERVER_PID}" 2>/dev/null || true
  SERVER_PID=
}

# This node: its server, then `train_node` (in a subshell, under its own traps); the server
# stops when training ends or on SIGTERM/SIGINT to this script.
colocated_node() {
  if dry_run; then
    python -m megatron_rl.rollout.serve "${SERVE_ARGS[@]}" --dry-run
    echo "# would start it in the background, wait up to ${SERVER_WAIT_S:-900} s until it answers /health, then train; the server stops when training ends"
    train_node
  fi
  SERVER_PID=
  TRAIN_PID=
  trap 'stop_server' EXIT
  trap 'echo "signal: stopping training, then the server" >&2; stop_colocated; exit 143' TERM INT
  start_server || exit 1
  train_node &
  TRAIN_PID=$!
  local status=0
  wait "${TRAIN_PID}" || status=$?
  exit "${status}"
}

# Training (its subshell stops torchrun on SIGTERM), then the server.
stop_colocated() {
  if [[ -n "${TRAIN_PID:-}" ]]; then
    kill -TERM "${TRAIN_PID}" 2>/dev/null || true
    wait "${TRAIN_PID}" 2>/dev/null || true
  fi
  stop_server
}

# This node's role in colocated mode: every node trains and serves.
launch_colocated_node() {
  if (( NODE_RANK < 0 || NODE_RANK >= NODES )); then
    echo "error: NODE_RANK=${NODE_RANK}: must be 0..$(( NODES - 1 ))" >&2
    exit 1
  fi
  announce_node
  colocated_node
}
