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
# all-to-all never leaves NVLink), data parallel 2 (expert data parallel 1). 94 layers split
# 23/24/24/23: the first and last stages carry the embedding / the output layer and its logits.
# No context parallelism: the trainer refuses it (its attention needs Transformer Engine), and at
# 18k-token micro-batches the activations are small next to the expert weights and gradients.
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PARALLEL_ARGS=(
  --tensor-model-parallel-size 4
  --sequence-parallel
  --pipeline-model-parallel-size 4
  --decoder-first-pipeline-num-layers 23
  --decoder-last-pipeline-num-layers 23
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
#   chosen: TP4+SP PP4 (23/24/24/23) EP8 DP2, EDP1, stage 1 (the fullest), GiB:
#     parameters, bf16 (dense + experts) 14.32; fp32 gradient buffers 28.64; optimizer on GPU 0
#     (all offloaded); routing state + targets (R2) 0.22; reference model (KL arms) 14.32;
#     reserve 4.00; static 61.50, then the largest phase of a step: a recomputed layer's
#     backward 3.93 (the last layer's attention 3.06, the chunked gradient check 0.44)
#     total 65.43 GiB at "backward: a recomputed layer"  FITS 80 (stages 0-3: 64.9-65.4)
#     host memory: Adam master/m/v + grad copy 111.28 per GPU
#   i.e. about 0.9 TiB of host memory per training node (+ 14 GiB per GPU for the offloaded KL
#   reference between its passes): the training nodes need 2 TiB-class hosts. Keeping part of the
#   state on the GPU: OPTIMIZER_OFFLOAD_FRACTION=0.9 plans 73.8 GiB (fits), 0.8 does not (82.1).
#   The same without offload: 148.9 GiB on stage 1 (the expert Adam state, 12 B per parameter
#   with no expert data parallelism to shard it over, is 81 GiB alone). The trainer checks the
#   gradients for NaN/Inf in chunks (backend/grad_check.py): over a whole buffer at once that
#   check alone held 47 GiB and this layout planned 108.8 GiB.
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
#   32 micro-batches per rank and step at STALENESS=8, (4-1)/(32+4-1) = 9%.
