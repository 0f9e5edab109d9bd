# Qwen3-235B-A22B: model arguments only (sourced by the run scripts).
# The architecture comes from the HF checkpoint's config.json (94 layers, hidden 4096, 64 query /
# 4 KV heads of 128, 128 experts top-8 of moe_intermediate 1536, vocabulary 151,936, untied
# embeddings); these are the training choices.
HF_CKPT=${HF_CKPT:?set HF_CKPT to the Qwen3-235B-A22B HF checkpoint folder (shared filesystem)}

MODEL_ARGS=(
  --model "${HF_CKPT}"
  --bf16
  --recompute-granularity full
)

# 32 training GPUs (4 nodes x 8): tensor parallel 4 (+ sequence parallel; 4 KV heads cap TP at
# 4), pipeline parallel 4 with one node per stage, expert parallel 8 inside each node (the
# all-to-all never leaves NVLink), data parallel 2 (expert data parallel 1). 94 layers split
# 23/24/24/23: the first and last stages carry the embedding / the output layer and its logits.
# No context parallelism: the trainer refuses it (its attention needs Transformer Engine), and at
# 18k-token micro-batches the activations are small next to the expert weights and gradients.
# See the memory plan in run_qwen3_235b_a22b.sh.
PARALLEL_ARGS=(
  --tensor-model-parallel-size 4
  --sequence-parallel
  --pipeline-model-parallel-size 4
  --decoder-first-pipeline-num-layers 23
  --decoder-last-pipeline-num-layers 23
  --expert-model-parallel-size 8
)
