# shellcheck shell=bash
# Qwen3-235B-A22B: the model's arguments and topology (sourced by the run script; common.sh's
# rl_job_args reads them). The architecture comes from the HF checkpoint's config.json (94
# layers, hidden 4096, 64 query / 4 KV heads of 128, 128 experts top-8 of moe_intermediate 1536,
# vocabulary 151,936, untied embeddings); these are the training and serving choices.
HF_CKPT=${HF_CKPT:?set HF_CKPT to the Qwen3-235B-A22B HF checkpoint folder (shared filesystem)}
MODEL_NAME=qwen3-235b-a22b

MODEL_ARGS=(
  --model "${HF_CKPT}"
  --bf16
  --recompute-granularity full
)

# 32 training GPUs (4 nodes x 8): tensor parallel 4 (+ sequence parallel; 4 KV heads cap TP at
# 4), pipeline parallel 4 with one node per stage, expert parallel 8 inside each node (the
# all-to-all never leaves NVLink), data parallel 2 (expert data parallel 1). Interleaved 1F1B
# with 2 model chunks per stage (virtual pipeline 2): 94 layers split 24/24/24/22, each stage's
# layers in two chunks of 12 (11 on the last stage, which also runs the output layer and the
# log-probs: its 22 layers + the 0.6B-parameter output layer are about the work of 24.8 layers).
# 32 micro-batches per rank and update at STALENESS=8: the bubble is (PP-1)/(V M) = 3/64 = 4.7%
# of the ideal step instead of 1F1B's 3/32 = 9.4% (23/24/24/23 without chunks), for twice the
# stage-to-stage messages and 11 / 9 / 7 / 5 (chunk, micro-batch) pairs of 12 layers (11 on stage
# 3) in flight on stages 0-3 instead of 4 / 3 / 2 / 1 micro-batches of 23-24 (the memory plan
# below). The schedule
# needs >= 4 micro-batches per rank (STALENESS <= 64); TRAIN_PARALLEL replaces these flags.
# No context parallelism: the trainer refuses it (its attention needs Transformer Engine), and at
# 18k-token micro-batches the activations are small next to the expert weights and gradients.
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PARALLEL_ARGS=(
  --tensor-model-parallel-size 4
  --sequence-parallel
  --pipeline-model-parallel-size 4
  --decoder-first-pipeline-num-layers 24
  --decoder-last-pipeline-num-layers 22
  --virtual-pipeline-model-parallel-size 2
  --expert-model-parallel-size 8
)
# The Adam state always lives in host memory (OPTIMIZER_OFFLOAD_FRACTION, default 1.0, of it):
# the model does not fit 32 80-GB GPUs without it (the memory plan below). Checkpoints are
# megatron dist-checkpointing (torch_dist), so a rerun may change the layout, and ASYNC_SAVE=1
# writes them in the background.
OPTIMIZER_OFFLOAD=always
CKPT_FORMAT=torch_dist

# One SGLang server per serving node holds the whole model: 235B bf16 parameters are 54.7 GiB of
# each GPU's 80 at TP 8, so SGLang gets 85% static (about 12 GiB of KV cache per GPU).
SERVER_TP=${SERVER_TP:-8}
SERVER_EP=${SERVER_EP:-8}
SERVER_MEM_FRACTION=${SERVER_MEM_FRACTION:-0.85}

# ---------------------------------------------------------------------------- memory plan
# Per GPU, from tools/memory_plan.py (bf16, full recompute, micro-batches of one 2,048 + 16,384
# token sample, R2 recordings on the GPU, the KL reference's weights on the GPU during its pass:
# the worst arm). Parameters, gradient buffers, optimizer state, routing state and the reference
# are counted exactly; activations, logits and the 4 GiB reserve are estimates. The plan of the
# launcher's own trainer command (DRY_RUN=1 NODE_RANK=0 LOSS=epic REPLAY=r2, its torchrun line):
#
#   python tools/memory_plan.py --model qwen3-235b-a22b --gpu-gib 80 -- torchrun ... \
#       -m megatron_rl.train ...
#
#   chosen: TP4+SP PP4 x VP2 (24/24/24/22 in chunks of 12/12/12/11) EP8 DP2, EDP1, stage 0
#   (the fullest), GiB:
#     parameters, bf16 (dense + experts) 14.61; fp32 gradient buffers 29.22; optimizer on GPU 0
#     (all offloaded); routing state + targets (R2) 0.22; reference model (KL arms) 14.61;
#     weight-sync staging 1.00; reserve 4.00; static 63.66, then the largest phase of a step: a
#     recomputed layer's backward 6.04 (the last layer's attention 5.16, the chunked gradient
#     check 0.44)
#     total 69.70 GiB at "backward: a recomputed layer"  FITS 80 (stages 0-3: 69.7 / 67.7 / 66.9
#     / 64.1)
#     host memory: Adam master/m/v + grad copy 112.44 per GPU
#   i.e. about 0.9 TiB of host memory per training node (+ 15 GiB per GPU for the offloaded KL
#   reference between its passes): the training nodes need 2 TiB-class hosts. Keeping part of the
#   state on the GPU: OPTIMIZER_OFFLOAD_FRACTION=0.9 plans 78.1 GiB (fits), 0.8 does not (86.6).
#   The stored layer inputs at the end of a forward (full recompute, 36 MiB per layer and
#   micro-batch): 4.64 / 3.80 / 2.95 / 2.00 GiB on stages 0-3 (11 / 9 / 7 / 5 chunks of 12 / 12 /
#   12 / 11 layers in flight) against plain 1F1B's 3.23 / 2.53 / 1.69 / 0.88 (4 / 3 / 2 / 1
#   micro-batches of 23 / 24 / 24 / 23 layers), which planned 66.4 GiB on stage 1.
#   The same without offload: 154.0 GiB on stage 0 (the expert Adam state, 12 B per parameter
#   with no expert data parallelism to shard it over, is 81 GiB alone). The trainer checks the
#   gradients for NaN/Inf in chunks (backend/grad_check.py): over a whole buffer at once that
#   check alone held 47 GiB and this layout planned 110.9 GiB.
#
#   without pipeline parallelism (same 32 GPUs, TP4+SP, full offload, same options):
#     EP8  DP8 (EDP4):  237.5 GiB  DOES NOT FIT (56.7 GiB of bf16 params, 113.3 GiB of fp32 grads)
#     EP16 DP8 (EDP2):  131.7 GiB  DOES NOT FIT (params + grads alone 90.7 GiB)
#     EP32 DP8 (EDP1):   78.9 GiB  fits with 1.1 GiB to spare (61.8 GiB without the KL
#                                  reference), with an all-to-all across all 4 nodes in every
#                                  one of the 94 MoE layers
#   16 GPUs (TP4 PP4 EP4 DP1) do not fit either: 91.8 GiB without the reference (the params and
#   fp32 grads of 1/16 of the 227B expert parameters and of a stage's attention: 83.5 GiB).
#   PP4 EP8 keeps each pipeline stage on one node, so the expert all-to-all stays on NVLink and
#   only the stage-to-stage activations and the DP2 gradient reduction cross nodes. The bubble:
#   32 micro-batches per rank and step at STALENESS=8, (PP-1)/(V M) = 3/64 = 4.7% of the ideal
#   time with the two chunks (4.5% of the step), 1F1B's (PP-1)/M = 3/32 = 9.4% without; the plan
#   prints it (docs/cluster-launch.md, "Interleaved pipeline").
