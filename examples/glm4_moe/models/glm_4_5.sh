# shellcheck shell=bash
# GLM-4.5 (355B): the model's arguments and topology (sourced by the run script after it set
# TRAIN_NODES; ../qwen3_moe/common.sh's rl_job_args reads them). The architecture comes from the
# HF checkpoint's config.json (92 layers, the first 3 dense; hidden 5120; 96 query / 8 KV heads of
# 128 with q/k/v biases and qk-norm, rope on half of each head; 160 routed experts top-8, no
# group limit; one shared expert; vocabulary 151,552). The preset glm-4.5
# (megatron_rl/model/presets.py) has the same shape, for the memory plan. The
# multi-token-prediction layer is skipped on load.
HF_CKPT=${HF_CKPT:?set HF_CKPT to the GLM-4.5 HF checkpoint folder (shared filesystem)}
MODEL_NAME=glm-4.5

MODEL_ARGS=(
  --model "${HF_CKPT}"
  --bf16
  --recompute-granularity full
)

# Tensor parallel 8 (+ sequence parallel; 8 KV heads cap TP at 8) inside a node, pipeline
# parallel 4 (92 layers, 23 per stage), expert parallel over the data-parallel ranks of a stage,
# no context parallelism (the trainer refuses it). Per GPU, from tools/memory_plan.py of this
# launcher's trainer command (bf16, full recompute, 18,432-token micro-batches, R2 recordings of
# 512 samples, the KL reference on the GPU during its pass: the fullest arm; the numbers are in
# docs/cluster-launch.md):
#   TRAIN_NODES=8 (the 128-GPU job, 64 train): EP16 DP2, Adam on the GPU:
#     115.8 GiB on stage 3 (the log-probs backward), fits 141
#   TRAIN_NODES=4 (the 64-GPU job, 32 train): EP8 DP1, Adam in host memory:
#     92.5 GiB on stage 3, fits 141; without the offload 220.2 GiB, which does not; 170 GiB of
#     host memory per GPU (1.4 TiB per node)
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
case "${TRAIN_NODES}" in
  8) EXPERT_PARALLEL=16 OPTIMIZER_OFFLOAD=opt-in ;;
  4) EXPERT_PARALLEL=8 OPTIMIZER_OFFLOAD=always ;;
  *) echo "error: TRAIN_NODES=${TRAIN_NODES}: GLM-4.5 has layouts for 8 or 4 training nodes" >&2
     exit 2 ;;
esac
PARALLEL_ARGS=(
  --tensor-model-parallel-size 8
  --sequence-parallel
  --pipeline-model-parallel-size 4
  --expert-model-parallel-size "${EXPERT_PARALLEL}"
)
CKPT_FORMAT=torch_dist

# One SGLang server per serving node on HF_CKPT: 355B bf16 parameters are 82 GiB of each GPU's
# 141 at TP 8, so SGLang gets 85% static (about 37 GiB of KV cache per GPU).
SERVER_TP=${SERVER_TP:-8}
SERVER_EP=${SERVER_EP:-8}
SERVER_MEM_FRACTION=${SERVER_MEM_FRACTION:-0.85}
SERVER_CKPT=${HF_CKPT}
