"""Per-GPU memory of a Qwen3-MoE, DeepSeek-V3 or GLM-4.5 training layout; does it fit a GPU.

    # the 32-GPU launcher's training half (examples/qwen3_moe): TP2+SP, EP8, DP8, bf16, full
    # recompute, one 2,048 + 16,384-token sample per micro-batch, R2 replay, KL reference on GPU
    megatron-rl plan --model qwen3-30b-a3b --tp 2 --ep 8 --world-size 16 \
        --micro-batch-tokens 18432 --routing-replay r2 --routing-responses 512 \
        --routing-response-tokens 18432 --reference gpu --gpu-gib 80 [--json]

    # Qwen3-235B-A22B on 32 GPUs with plain 1F1B: TP4+SP, PP4 (stages 23/24/24/23, the
    # trainer's flags), EP8, DP2, all of the Adam state in host memory
    megatron-rl plan --model qwen3-235b-a22b --tp 4 --pp 4 --ep 8 --world-size 32 \
        --decoder-first-pipeline-num-layers 23 --decoder-last-pipeline-num-layers 23 \
        --optimizer-offload-fraction 1 --micro-batch-tokens 18432 --reference gpu

    # the same with megatron's interleaved 1F1B, as its launcher runs it: 2 model chunks per
    # pipeline rank (stages 24/24/24/22 split 12+12 / ... / 11+11), 32 micro-batches per update
    # on each data-parallel rank; the plan adds the warm-up's extra micro-batches in flight and
    # prints the bubble, (PP-1)/(V M) = 3/64 against 1F1B's 3/32
    megatron-rl plan --model qwen3-235b-a22b --tp 4 --pp 4 --ep 8 --world-size 32 \
        --decoder-first-pipeline-num-layers 24 --decoder-last-pipeline-num-layers 22 \
        --virtual-pipeline-model-parallel-size 2 --micro-batches 32 \
        --optimizer-offload-fraction 1 --micro-batch-tokens 18432 --reference gpu

    # the colocated launcher (run_qwen3_30b_a3b_colocated.sh): the trainer and one TP-8 SGLang
    # server per node on the same 32 GPUs; its --mem-fraction-static (0.76; 0.86 at 141 GiB)
    megatron-rl plan --model qwen3-30b-a3b --tp 2 --ep 8 --world-size 32 \
        --micro-batch-tokens 18432 --gpu-gib 80 --colocated --server-tp 8

    # the plan of a launcher's own trainer command: everything after `--` is the trainer's command
    # line, parsed by the trainer's parser (megatron_rl.train.config), optionally as torchrun
    # prints it (its --nnodes x --nproc-per-node is the world size); --model names the preset
    # when the command's --model is a checkpoint folder this machine does not have
    megatron-rl plan --model qwen3-235b-a22b --gpu-gib 80 -- \
        $(DRY_RUN=1 NODE_RANK=0 ... bash examples/qwen3_moe/run_qwen3_235b_a22b.sh | grep ^torchrun)

    # DeepSeek-V3 (671B, MLA) on 128 training H200s of the 256-GPU launcher
    # (examples/deepseek_v3/run_deepseek_v3.sh): TP8+SP PP8 (7/8x6/6) EP16 DP2
    megatron-rl plan --model deepseek-v3 --gpu-gib 141 -- \
        $(DRY_RUN=1 NODE_RANK=0 ... bash examples/deepseek_v3/run_deepseek_v3.sh | grep ^torchrun)

    # the GPU smoke's slice (tools/gpu_smoke.py): Qwen3-30B-A3B's shape with 2 layers on one GPU,
    # local spec (unfused attention), no recompute, no reserve; the H200 measured 44.6 / 81.4 GiB
    megatron-rl plan --model qwen3-30b-a3b --num-layers 2 --spec local \
        --recompute none --micro-batch-tokens 8192 --reserve-gib 0 --gpu-gib 141

Parameters, gradient buffers, optimizer state, routing state and the reference model are counted
exactly; activations, the attention core, logits, log-prob tiles, the optimizer step's temporaries
and the reserve are estimates (see `megatron_rl.memory_plan`). The peak is the static terms plus
the largest phase of the step (printed with the others); with pipeline parallelism the fullest
stage decides the verdict, and the plan prints the schedule's bubble ((PP-1)/M of the ideal time
with 1F1B, (PP-1)/(V M) interleaved; `megatron_rl.memory_plan.schedule`) when it knows M.

With `--`, the layout (the virtual pipeline included), precision, recompute, micro-batch
(``--micro-batch-size`` x the prompt and response lengths) and micro-batches per update
(``--global-batch-size`` / (data parallel x ``--micro-batch-size``)), routing replay (its codec,
and every sample of a rollout recorded), the KL reference (on the GPU during its pass when
``--kl-coef`` > 0), the optimizer offload and the colocated view (``--colocate``, its servers'
``--sglang-engine-ranks``) all come from the trainer's flags, so a launcher and its plan cannot
disagree; giving one of those as this tool's own flag as well is an error. The GPU's size, the
reserve and the other estimates stay this tool's flags (the trainer's command is read by
megatron_rl/cli/plan_command.py; the tables are
megatron_rl/cli/plan_tables.py). ``python tools/memory_plan.py`` is the same command.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from megatron_rl.backend.grad_check import GRAD_CHECK_CHUNK_ELEMENTS
from megatron_rl.cli.plan_command import apply_trainer_command
from megatron_rl.cli.plan_tables import render, render_colocated
from megatron_rl.memory_plan import (
    DTYPE_BYTES,
    RECOMPUTE,
    REFERENCE,
    REPLAY,
    SPECS,
    SYNC_SENDERS,
    Layout,
    MemoryPlan,
    PlanOptions,
    load_model_config,
    plan_memory,
)
from megatron_rl.memory_plan.colocate import ColocatedPlan, ServerOptions, plan_colocated
from megatron_rl.model.stages import megatron_stage_layers, virtual_stage_size
from megatron_rl.parallel import ParallelConfig
from megatron_rl.routing.codec import CODECS

DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", **{name: name for name in DTYPE_BYTES}}


def _stage_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated layer counts") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This tool's flags; with ``-- TRAINER_COMMAND``, those the trainer's command decides
    (`plan_command.FROM_TRAINER`, the world size and GPUs per node under torchrun) come from it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return build_parser().parse_args(argv)
    split = argv.index("--")
    own, command = argv[:split], argv[split + 1 :]
    args = build_parser().parse_args(own)
    given = _given_flags(own)
    return apply_trainer_command(args, given, command)


def _given_flags(argv: list[str]) -> set[str]:
    """The destinations of the flags ``argv`` gives (not those left at their defaults)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        default="qwen3-30b-a3b",
        help="a preset (e.g. qwen3-235b-a22b) or a HF checkpoint folder",
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        help="override the model's num_hidden_layers (e.g. 2: the GPU smoke's slice)",
    )
    parser.add_argument(
        "--spec",
        choices=SPECS,
        default="te",
        help="layer spec: te (fused attention, TE's FusedAdam) or local (megatron's unfused "
        "attention with [heads, s, s] tensors, torch's AdamW), as --transformer-impl",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor parallel")
    parser.add_argument("--cp", type=int, default=1, help="context parallel")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--dp", type=int, help="data parallel (default 1)")
    size.add_argument("--world-size", type=int, help="training GPUs (data parallel = the rest)")
    parser.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence parallel (default: on when TP > 1)",
    )
    parser.add_argument(
        "--pipeline-layers",
        type=_stage_layers,
        help="layers per pipeline stage, e.g. 23,24,24,23 (default: an even split)",
    )
    for stage in ("first", "last"):
        parser.add_argument(
            f"--decoder-{stage}-pipeline-num-layers",
            type=int,
            help=f"layers of the {stage} pipeline stage, as the trainer's (megatron's) flag; the "
            "stages in between share the rest evenly",
        )
    parser.add_argument(
        "--virtual-pipeline-model-parallel-size",
        type=int,
        help="model chunks per pipeline rank (megatron's interleaved 1F1B), as the trainer's "
        "flag: each stage's layers split evenly over them; more micro-batches in flight, a "
        "bubble of (PP-1)/(V M) instead of (PP-1)/M",
    )
    parser.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        help="layers per model chunk (Megatron-LM's flag, as the trainer's): the virtual "
        "pipeline size is num_layers / PP / this",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        help="micro-batches per optimizer step on a data-parallel rank (the pipeline schedule's "
        "M: the bubble and the micro-batches in flight; from a trainer command: --global-batch-"
        "size / (data parallel x --micro-batch-size); default: not known)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), default="bf16")
    parser.add_argument(
        "--distributed-optimizer", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--optimizer-offload-fraction",
        type=float,
        default=0.0,
        help="share of each rank's optimizer state in host memory (the trainer's "
        "--optimizer-cpu-offload --optimizer-offload-fraction F); 0: none",
    )
    parser.add_argument("--recompute", choices=RECOMPUTE, default="full")
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=4096,
        help="tokens (b*s) of one micro-batch on one data-parallel rank",
    )
    parser.add_argument(
        "--micro-batch-sequences",
        type=int,
        default=1,
        help="sequences in a micro-batch (the local spec's attention is quadratic per sequence)",
    )
    parser.add_argument("--logprob-chunk-tokens", type=int, default=4096)
    parser.add_argument(
        "--grad-check-chunk-elements",
        type=int,
        default=GRAD_CHECK_CHUNK_ELEMENTS,
        help="grad-buffer elements the trainer's finiteness check takes at once (default: the "
        "trainer's chunk, backend/grad_check.py; 0: a whole buffer at once)",
    )
    parser.add_argument("--routing-replay", choices=REPLAY, default="off")
    parser.add_argument("--routing-codec", choices=CODECS, default="auto")
    parser.add_argument("--routing-tokens", type=int, help="tokens of routing state per rank")
    parser.add_argument("--routing-responses", type=int, help="responses per RL step (all ranks)")
    parser.add_argument("--routing-response-tokens", type=int, help="tokens of each response")
    parser.add_argument("--reference", choices=REFERENCE, default="off", help="KL reference model")
    parser.add_argument("--moe-imbalance", type=float, default=1.0)
    parser.add_argument("--reserve-gib", type=float, default=4.0)
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory in GiB")
    parser.add_argument(
        "--sync-staging-buffers",
        type=int,
        default=0,
        help="weight-sync staging buffers of 512 MiB kept on a sending GPU (the distributed "
        "transport: 2; tensor: 1; from a trainer command: what it configures)",
    )
    parser.add_argument("--sync-senders", choices=SYNC_SENDERS, default="every-stage")
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="LoRA's rank (0: full fine-tuning; the trainer's)"
    )
    parser.add_argument("--lora-targets", default="attention", help="as the trainer's")
    parser.add_argument(
        "--lora-experts",
        choices=("per-expert", "shared"),
        default="per-expert",
        help="as the trainer's",
    )
    colocated = parser.add_argument_group("colocated (megatron_rl.memory_plan.colocate)")
    colocated.add_argument(
        "--colocated",
        action="store_true",
        help="SGLang servers on the trainer's GPUs (the trainer's --colocate): each phase per "
        "GPU, the KV-cache budget and the --mem-fraction-static to pass to SGLang",
    )
    colocated.add_argument("--server-tp", type=int, default=8, help="TP of each SGLang server")
    colocated.add_argument("--gpus-per-node", type=int, default=8)
    colocated.add_argument(
        "--server-residue-gib",
        type=float,
        default=3.0,
        help="what a released server still holds per GPU (context, NCCL, allocator cache)",
    )
    colocated.add_argument(
        "--sglang-reserve-gib",
        type=float,
        help="SGLang's non-static share per GPU (default: SGLang's own heuristic, 14.5 at TP 8)",
    )
    colocated.add_argument("--host-gib", type=float, default=2048.0, help="host memory per node")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def build_plan(args: argparse.Namespace) -> MemoryPlan:
    overrides = {} if args.num_layers is None else {"num_hidden_layers": args.num_layers}
    config = load_model_config(args.model, **overrides)
    pipeline_layers = args.pipeline_layers
    uneven = (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
    if uneven != (None, None):
        if pipeline_layers is not None:
            raise ValueError(
                "give --pipeline-layers or --decoder-first/last-pipeline-num-layers, not both"
            )
        pipeline_layers = megatron_stage_layers(config.num_hidden_layers, args.pp, *uneven)
    virtual = virtual_stage_size(
        config.num_hidden_layers,
        args.pp,
        args.virtual_pipeline_model_parallel_size,
        args.num_layers_per_virtual_pipeline_stage,
        uneven=uneven != (None, None) or pipeline_layers is not None,
    )
    parallel = ParallelConfig(
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        expert_parallel=args.ep,
        expert_tensor_parallel=args.etp,
        context_parallel=args.cp,
        sequence_parallel=args.sp,
    )
    if args.world_size is not None:
        layout = Layout.from_world_size(parallel, args.world_size, pipeline_layers, virtual or 1)
    else:
        layout = Layout(
            parallel=parallel,
            data_parallel=args.dp or 1,
            pipeline_layers=pipeline_layers,
            virtual_pipeline=virtual or 1,
        )
    options = PlanOptions(
        params_dtype=DTYPE_ALIASES[args.dtype],
        distributed_optimizer=args.distributed_optimizer,
        recompute=args.recompute,
        micro_batch_tokens=args.micro_batch_tokens,
        logprob_chunk_tokens=args.logprob_chunk_tokens,
        routing_replay=args.routing_replay,
        routing_codec=args.routing_codec,
        routing_tokens=args.routing_tokens,
        routing_responses=args.routing_responses,
        routing_response_tokens=args.routing_response_tokens,
        reference=args.reference,
        moe_imbalance=args.moe_imbalance,
        reserve_gib=args.reserve_gib,
        optimizer_offload_fraction=args.optimizer_offload_fraction,
        spec=args.spec,
        micro_batch_sequences=args.micro_batch_sequences,
        micro_batches=args.micro_batches,
        grad_check_chunk_elements=args.grad_check_chunk_elements or None,
        sync_staging_buffers=args.sync_staging_buffers,
        sync_senders=args.sync_senders,
        lora_rank=args.lora_rank,
        lora_targets=args.lora_targets,
        lora_experts=args.lora_experts,
    )
    return plan_memory(config, layout, options, gpu_gib=args.gpu_gib)


def build_colocated(args: argparse.Namespace, plan: MemoryPlan) -> ColocatedPlan:
    server = ServerOptions(
        tp=args.server_tp,
        gpus_per_node=args.gpus_per_node,
        residue_gib=args.server_residue_gib,
        reserve_gib=args.sglang_reserve_gib,
        host_gib=args.host_gib,
    )
    return plan_colocated(plan, server)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        plan = build_plan(args)
        colocated = build_colocated(args, plan) if args.colocated else None
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        extra = {"colocated": colocated.to_dict()} if colocated else {}
        print(json.dumps({"model_name": args.model, **plan.to_dict(), **extra}, indent=2))
    else:
        console = Console(width=160)
        render(plan, args.model, console)
        if colocated:
            render_colocated(colocated, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
