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
# parallel 4 with interleaved 1F1B over 2 model chunks per stage (virtual pipeline 2): 92 layers
# split 22/24/24/22 (each stage's layers must divide by 2, so not 23 per stage; the first stage
# holds the 3 dense layers and the embedding, the last the output layer and the log-probs), in
# chunks of 11/12/12/11. The bubble is (PP-1)/(V M) of the ideal step: 3/64 = 4.7% with the 32
# micro-batches per rank of TRAIN_NODES=8 (DP2, STALENESS=8), 3/128 = 2.3% with the 64 of
# TRAIN_NODES=4 (DP1), against plain 1F1B's 9.4% / 4.7%; the schedule needs >= 4 micro-batches
# per rank (STALENESS <= 64 at DP2). Expert parallel over the data-parallel ranks of a stage, no
# context parallelism (the trainer refuses it). Per GPU, from tools/memory_plan.py of this
# launcher's trainer command (bf16, full recompute, 18,432-token micro-batches, R2 recordings of
# 512 samples, the KL reference on the GPU during its pass: the fullest arm; the numbers are in
# docs/cluster-launch.md):
#   TRAIN_NODES=8 (the 128-GPU job, 64 train): EP16 DP2, Adam on the GPU:
#     120.4 GiB on stage 1 (a recomputed layer's backward), fits 141 (plain 1F1B with 23 per
#     stage: 115.8 on stage 3)
#   TRAIN_NODES=4 (the 64-GPU job, 32 train): EP8 DP1, Adam in host memory:
#     96.6 GiB on stage 1, fits 141; without the offload 228.7 GiB, which does not; 176 GiB of
#     host memory per GPU (1.4 TiB per node)
#   The interleaved schedule holds 11 / 9 / 7 / 5 (chunk, micro-batch) pairs of 11-12 layers in
#   flight on stages 0-3: 2.66 / 2.37 / 1.85 / 1.25 GiB of stored layer inputs at the end of a
#   forward, against 1F1B's 4 / 3 / 2 / 1 micro-batches of 23 layers, 2.02 / 1.52 / 1.01 / 0.55.
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
  --decoder-first-pipeline-num-layers 22
  --decoder-last-pipeline-num-layers 22
  --virtual-pipeline-model-parallel-size 2
  --expert-model-parallel-size "${EXPERT_PARALLEL}"
)
CKPT_FORMAT=torch_dist

# One SGLang server per serving node on HF_CKPT: 355B bf16 parameters are 82 GiB of each GPU's
# 141 at TP 8, so SGLang gets 85% static (about 37 GiB of KV cache per GPU).
SERVER_TP=${SERVER_TP:-8}
SERVER_EP=${SERVER_EP:-8}
SERVER_MEM_FRACTION=${SERVER_MEM_FRACTION:-0.85}
SERVER_CKPT=${HF_CKPT}
