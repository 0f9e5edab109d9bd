# shellcheck shell=bash
# Qwen3-30B-A3B: the model's arguments and topology (sourced by the run scripts; common.sh's
# rl_job_args reads them). The architecture comes from the HF checkpoint's config.json (48
# layers, 128 experts top-8, 4 KV heads); these are the training and serving choices.
HF_CKPT=${HF_CKPT:?set HF_CKPT to the Qwen3-30B-A3B HF checkpoint folder (shared filesystem)}
MODEL_NAME=qwen3-30b-a3b

MODEL_ARGS=(
  --model "${HF_CKPT}"
  --bf16
  --recompute-granularity full
)

# 8 GPUs per node; per trainer node: tensor parallel 2 (+ sequence parallel), expert parallel 8
# (data parallel: the rest, 8 on the disaggregated launcher's 16 GPUs).
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PARALLEL_ARGS=(
  --tensor-model-parallel-size 2
  --sequence-parallel
  --expert-model-parallel-size 8
)
# The Adam state stays on the GPU unless OPTIMIZER_CPU_OFFLOAD=1; checkpoints in the default format.
OPTIMIZER_OFFLOAD=opt-in
CKPT_FORMAT=

# one SGLang server per serving node: TP 8 / EP 8, 70% of each GPU static (weights + KV cache)
SERVER_TP=${SERVER_TP:-8}
SERVER_EP=${SERVER_EP:-8}
SERVER_MEM_FRACTION=${SERVER_MEM_FRACTION:-0.7}
