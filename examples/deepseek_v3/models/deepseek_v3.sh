# shellcheck shell=bash
# DeepSeek-V3 (671B): the model's arguments and topology (sourced by the run script after it set
# TRAIN_NODES; ../qwen3_moe/common.sh's rl_job_args reads them). The architecture comes from the
# HF checkpoint's config.json (61 layers, the first 3 dense; hidden 7168; multi-latent attention,
# 128 heads, q / kv LoRA ranks 1536 / 512, nope 128 + rope 64, values 128; 256 routed experts
# top-8 in 8 groups, the best 4; one shared expert; vocabulary 129,280). The preset deepseek-v3
# (megatron_rl/model/presets.py) has the same shape, for the memory plan.
#
# Two things the checkpoints must give, both checked when the trainer starts, not here:
# - HF_CKPT, the trainer's, is a bf16 copy of the weights with the release's config.json: its
#   YaRN rope_scaling (factor 40) is mapped by megatron_rl.model.deepseek_v3.yarn_fields; the
#   multi-token-prediction layer is skipped on load.
# - SERVE_CKPT, the servers', is the block-FP8 release (quantization_config fp8, 128x128 blocks):
#   671B in bf16 is 1.25 TiB, more than one 8 x 141-GiB node holds, so each server node serves
#   FP8 (78 GiB of weights per GPU at TP 8) and every weight sync sends the linear weights
#   block-FP8 quantised (--weight-sync-fp8-blocks, docs/rollout-and-sglang.md).
HF_CKPT=${HF_CKPT:?set HF_CKPT to a bf16 DeepSeek-V3 HF checkpoint folder (shared filesystem)}
SERVER_CKPT=${SERVE_CKPT:?set SERVE_CKPT to the block-FP8 DeepSeek-V3 release (the servers load it)}
MODEL_NAME=deepseek-v3

MODEL_ARGS=(
  --model "${HF_CKPT}"
  --bf16
  --recompute-granularity full
  --weight-sync-fp8-blocks
)

# Tensor parallel 8 (+ sequence parallel) inside a node, pipeline parallel 8: 61 layers as
# 7 / 8 x 6 / 6 (the first stage holds the 3 dense layers and the embedding, the last the output
# layer and its logits), expert parallel over the data-parallel ranks of a stage, no context
# parallelism (the trainer refuses it). Per GPU, from tools/memory_plan.py of this launcher's
# trainer command (bf16, full recompute, 18,432-token micro-batches, R2 recordings of 512
# samples, the KL reference on the GPU during its pass: the fullest arm; the numbers are in
# docs/cluster-launch.md):
#   TRAIN_NODES=16 (the 256-GPU job, 128 train): EP16 DP2, Adam on the GPU:
#     117.9 GiB on stage 1 (a recomputed layer's backward), fits 141
#   TRAIN_NODES=8 (the 128-GPU job, 64 train): EP8 DP1, Adam in host memory:
#     95.0 GiB on stage 1, fits 141; without the offload 224.9 GiB, which does not; 173 GiB of
#     host memory per GPU (1.4 TiB per node)
# Plain 1F1B, no interleaving: megatron splits each stage's layers evenly over its model chunks,
# so a virtual pipeline of V needs every stage's layer count divisible by V, and 61 layers (a
# prime) have no such split for any V > 1 (the layers would sum to a multiple of V). The bubble
# stays (PP-1)/M of the ideal step: 7/32 = 21.9% with the 32 micro-batches per rank of
# TRAIN_NODES=16 (DP2, STALENESS=8), 7/64 = 10.9% with the 64 of TRAIN_NODES=8 (DP1); fewer
# pipeline stages or more micro-batches per rank (a lower STALENESS) are what shrink it here.
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
case "${TRAIN_NODES}" in
  16) EXPERT_PARALLEL=16 OPTIMIZER_OFFLOAD=opt-in ;;
  8) EXPERT_PARALLEL=8 OPTIMIZER_OFFLOAD=always ;;
  *) echo "error: TRAIN_NODES=${TRAIN_NODES}: DeepSeek-V3 has layouts for 16 or 8 training" \
       "nodes" >&2
     exit 2 ;;
esac
PARALLEL_ARGS=(
  --tensor-model-parallel-size 8
  --sequence-parallel
  --pipeline-model-parallel-size 8
  --decoder-first-pipeline-num-layers 7
  --decoder-last-pipeline-num-layers 6
  --expert-model-parallel-size "${EXPERT_PARALLEL}"
)
CKPT_FORMAT=torch_dist

# One SGLang server per serving node on the FP8 release: TP 8 / EP 8, 85% static.
SERVER_TP=${SERVER_TP:-8}
SERVER_EP=${SERVER_EP:-8}
SERVER_MEM_FRACTION=${SERVER_MEM_FRACTION:-0.85}
