# Qwen3-30B-A3B: model arguments only (sourced by the run scripts).
# The architecture comes from the HF checkpoint's config.json; these are the training choices.
HF_CKPT=${HF_CKPT:?set HF_CKPT to the Qwen3-30B-A3B HF checkpoint folder (shared filesystem)}

MODEL_ARGS=(
  --model "${HF_CKPT}"
  --bf16
  --recompute-granularity full
)

# 16 training GPUs: tensor parallel 2 (+ sequence parallel), expert parallel 8, data parallel 8.
PARALLEL_ARGS=(
  --tensor-model-parallel-size 2
  --sequence-parallel
  --expert-model-parallel-size 8
)
