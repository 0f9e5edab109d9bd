"""Per-GPU memory of a Qwen3-MoE, DeepSeek-V3 or GLM-4.5 training layout; does it fit a GPU.

    # the 32-GPU launcher's training half (examples/qwen3_moe): TP2+SP, EP8, DP8, bf16, full
    # recompute, one 2,048 + 16,384-token sample per micro-batch, R2 replay, KL reference on GPU
    python tools/memory_plan.py --model qwen3-30b-a3b --tp 2 --ep 8 --world-size 16 \
        --micro-batch-tokens 18432 --routing-replay r2 --routing-responses 512 \
        --routing-response-tokens 18432 --reference gpu --gpu-gib 80 [--json]

    # the Qwen3-235B-A22B launcher's training half: TP4+SP, PP4 (stages 23/24/24/23, the
    # trainer's flags), EP8, DP2, all of the Adam state in host memory
    python tools/memory_plan.py --model qwen3-235b-a22b --tp 4 --pp 4 --ep 8 --world-size 32 \
        --decoder-first-pipeline-num-layers 23 --decoder-last-pipeline-num-layers 23 \
        --optimizer-offload-fraction 1 --micro-batch-tokens 18432 --reference gpu

    # the colocated launcher (run_qwen3_30b_a3b_colocated.sh): the trainer and one TP-8 SGLang
    # server per node on the same 32 GPUs; its --mem-fraction-static (0.76; 0.86 at 141 GiB)
    python tools/memory_plan.py --model qwen3-30b-a3b --tp 2 --ep 8 --world-size 32 \
        --micro-batch-tokens 18432 --gpu-gib 80 --colocated --server-tp 8

    # the plan of a launcher's own trainer command: everything after `--` is the trainer's command
    # line, parsed by the trainer's parser (megatron_rl.train.config), optionally as torchrun
    # prints it (its --nnodes x --nproc-per-node is the world size); --model names the preset
    # when the command's --model is a checkpoint folder this machine does not have
    python tools/memory_plan.py --model qwen3-235b-a22b --gpu-gib 80 -- \
        $(DRY_RUN=1 NODE_RANK=0 ... bash examples/qwen3_moe/run_qwen3_235b_a22b.sh | grep ^torchrun)

    # DeepSeek-V3 (671B, MLA) on 128 training H200s of the 256-GPU launcher
    # (examples/deepseek_v3/run_deepseek_v3.sh): TP8+SP PP8 (7/8x6/6) EP16 DP2
    python tools/memory_plan.py --model deepseek-v3 --gpu-gib 141 -- \
        $(DRY_RUN=1 NODE_RANK=0 ... bash examples/deepseek_v3/run_deepseek_v3.sh | grep ^torchrun)

    # the GPU smoke's slice (tools/gpu_smoke.py): Qwen3-30B-A3B's shape with 2 layers on one GPU,
    # local spec (unfused attention), no recompute, no reserve; the H200 measured 44.6 / 81.4 GiB
    python tools/memory_plan.py --model qwen3-30b-a3b --num-layers 2 --spec local \
        --recompute none --micro-batch-tokens 8192 --reserve-gib 0 --gpu-gib 141

Parameters, gradient buffers, optimizer state, routing state and the reference model are counted
exactly; activations, the attention core, logits, log-prob tiles, the optimizer step's temporaries
and the reserve are estimates (see `megatron_rl.memory_plan`). The peak is the static terms plus
the largest phase of the step (printed with the others); with pipeline parallelism the fullest
stage decides the verdict.

With `--`, the layout, precision, recompute, micro-batch (``--micro-batch-size`` x the prompt and
response lengths), routing replay (its codec, and every sample of a rollout recorded), the KL
reference (on the GPU during its pass when ``--kl-coef`` > 0), the optimizer offload and the
colocated view (``--colocate``, its servers' ``--sglang-engine-ranks``) all come from the
trainer's flags, so a launcher and its plan cannot disagree; giving one of those as this tool's
own flag as well is an error. The GPU's size, the reserve and the other estimates stay this
tool's flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from megatron_rl.backend.grad_check import GRAD_CHECK_CHUNK_ELEMENTS
from megatron_rl.memory_plan import (
    DTYPE_BYTES,
    GIB,
    RECOMPUTE,
    REFERENCE,
    REPLAY,
    SPECS,
    SYNC_SENDERS,
    Layout,
    MemoryPlan,
    PlanOptions,
    StagePlan,
    load_model_config,
    plan_memory,
)
from megatron_rl.memory_plan.colocate import ColocatedPlan, ServerOptions, plan_colocated
from megatron_rl.model.stages import megatron_stage_layers
from megatron_rl.parallel import ParallelConfig
from megatron_rl.routing.codec import CODECS

DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", **{name: name for name in DTYPE_BYTES}}


def _stage_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated layer counts") from None


# this tool's flags that the trainer's command line decides (with `--`)
FROM_TRAINER = (
    "tp", "pp", "ep", "etp", "cp", "sp", "pipeline_layers", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "dtype", "distributed_optimizer",
    "optimizer_offload_fraction", "recompute", "micro_batch_tokens", "micro_batch_sequences",
    "routing_replay", "routing_codec", "routing_tokens", "routing_responses",
    "routing_response_tokens", "reference", "spec", "colocated", "server_tp",
    "sync_staging_buffers", "sync_senders",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This tool's flags; with ``-- TRAINER_COMMAND``, those the trainer's command decides
    (`FROM_TRAINER`, the world size and GPUs per node under torchrun) come from it."""
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


def apply_trainer_command(
    args: argparse.Namespace, given: set[str], command: list[str]
) -> argparse.Namespace:
    """``args`` with what the trainer's ``command`` decides: its flags (the trainer's own
    parser, ``megatron_rl.train.config.parse_args``), or ``torchrun ... -m megatron_rl.train
    FLAGS`` (world size ``--nnodes`` x ``--nproc-per-node``)."""
    from megatron_rl.train.config import parse_args as parse_trainer_args

    both = sorted(given & set(FROM_TRAINER))
    flags, world_size, gpus_per_node = _split_launcher(command)
    if world_size is not None:
        both += sorted(given & {"world_size", "dp", "gpus_per_node"})
    if both:
        names = ", ".join("--" + name.replace("_", "-") for name in both)
        raise ValueError(f"{names}: the trainer's command after -- decides this; drop it")
    config = parse_trainer_args(flags)
    if config.task.max_prompt_length is None:
        raise ValueError(
            "the trainer's command gives no --max-prompt-length: a micro-batch's tokens are "
            "--micro-batch-size x (--max-prompt-length + --max-response-length)"
        )
    length = config.task.max_prompt_length + config.rollout.max_response_length
    replay = config.replay.mode
    micro = config.schedule.micro_batch_size
    values = {
        "tp": config.parallel.tensor_parallel,
        "pp": config.parallel.pipeline_parallel,
        "ep": config.parallel.expert_parallel,
        "etp": config.parallel.expert_tensor_parallel,
        "cp": config.parallel.context_parallel,
        "sp": config.parallel.sequence_parallel,
        "pipeline_layers": None,
        "decoder_first_pipeline_num_layers": config.model.first_stage_layers,
        "decoder_last_pipeline_num_layers": config.model.last_stage_layers,
        "dtype": config.model.dtype,
        "distributed_optimizer": config.optimizer.use_distributed_optimizer,
        "optimizer_offload_fraction": (
            config.optimizer.offload_fraction if config.optimizer.cpu_offload else 0.0
        ),
        "recompute": "full" if config.model.recompute else "none",
        "micro_batch_tokens": micro * length,
        "micro_batch_sequences": micro,
        "routing_replay": replay,
        "routing_codec": config.replay.dtype,
        "routing_tokens": None,
        "routing_responses": config.samples_per_rollout if replay != "off" else None,
        "routing_response_tokens": length if replay != "off" else None,
        "reference": "gpu" if config.objective.kl_coef > 0 else "off",
        "spec": "local" if config.model.spec == "local" else "te",
        "colocated": config.engine.colocate,
        "server_tp": config.engine.sglang_engine_ranks,
        **_sync_staging(config.engine),
    }
    if "model" not in given:
        values["model"] = config.task.model
    if world_size is not None:
        values.update(world_size=world_size, dp=None, gpus_per_node=gpus_per_node)
    return argparse.Namespace(**{**vars(args), **values})


def _sync_staging(engine) -> dict:
    """What the trainer's weight sync keeps allocated (`PlanOptions.sync_staging_buffers`):
    SGLang servers fed by the distributed transport, 2 buckets on each sender (every stage's
    first rank, or rank 0 with --weight-sync-from-rank-0); by CUDA IPC (tensor), 1 on every rank;
    the disk transport, the in-process engine and colocated mode (its bucket is a phase of the
    colocated plan), none."""
    transport = engine.weight_sync_transport
    if engine.kind != "sglang" or engine.colocate or transport == "disk":
        return {"sync_staging_buffers": 0, "sync_senders": "every-stage"}
    if transport == "tensor":
        return {"sync_staging_buffers": 1, "sync_senders": "every-rank"}
    senders = "every-stage" if engine.per_stage_senders else "first-stage"
    return {"sync_staging_buffers": 2, "sync_senders": senders}


def _split_launcher(command: list[str]) -> tuple[list[str], int | None, int | None]:
    """``(trainer flags, world size, GPUs per node)`` of ``command``: the flags themselves
    (no world size), or a command that runs ``-m megatron_rl.train`` (torchrun's
    ``--nnodes`` x ``--nproc-per-node``; 1 x 1 where it gives none)."""
    if "megatron_rl.train" not in command:
        return command, None, None
    at = command.index("megatron_rl.train")
    launcher = command[:at]
    if not launcher or Path(launcher[0]).name != "torchrun":
        return command[at + 1 :], None, None

    def value(flag: str) -> int:
        for i, word in enumerate(launcher):
            if word == flag and i + 1 < len(launcher):
                return int(launcher[i + 1])
            if word.startswith(flag + "="):
                return int(word.split("=", 1)[1])
        return 1

    nodes, per_node = value("--nnodes"), value("--nproc-per-node")
    return command[at + 1 :], nodes * per_node, per_node


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
    parallel = ParallelConfig(
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        expert_parallel=args.ep,
        expert_tensor_parallel=args.etp,
        context_parallel=args.cp,
        sequence_parallel=args.sp,
    )
    if args.world_size is not None:
        layout = Layout.from_world_size(parallel, args.world_size, pipeline_layers)
    else:
        layout = Layout(
            parallel=parallel, data_parallel=args.dp or 1, pipeline_layers=pipeline_layers
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
        grad_check_chunk_elements=args.grad_check_chunk_elements or None,
        sync_staging_buffers=args.sync_staging_buffers,
        sync_senders=args.sync_senders,
    )
    return plan_memory(config, layout, options, gpu_gib=args.gpu_gib)


def render(plan: MemoryPlan, model: str, console: Console) -> None:
    layout, shape, peak = plan.layout, plan.shape, plan.peak
    p = layout.parallel
    console.print(
        f"[bold]{model}[/bold]: {shape.total_params() / 1e9:.2f}B params, "
        f"{shape.total_params(active=True) / 1e9:.2f}B active; {layout.world_size} GPUs = "
        f"TP{p.tensor_parallel}{'+SP' if p.sequence_parallel else ''} PP{p.pipeline_parallel} "
        f"CP{p.context_parallel} DP{layout.data_parallel}; experts EP{p.expert_parallel} "
        f"ETP{p.expert_tensor_parallel} EDP{layout.expert_data_parallel}; "
        f"{plan.options.params_dtype}, recompute {plan.options.recompute}, "
        f"{plan.options.micro_batch_tokens:,} tokens / micro-batch"
    )
    if len(plan.stages) > 1:
        stages = Table(title="pipeline stages")
        for column in ("stage", "layers", "MoE layers", "dense params", "expert params", "GiB"):
            stages.add_column(column, justify="right")
        for stage in plan.stages:
            sp = stage.params
            stages.add_row(
                str(sp.stage),
                str(sp.layers),
                str(sp.moe_layers),
                f"{sp.dense:,}",
                f"{sp.expert:,}",
                f"{stage.gpu_bytes / GIB:.2f}",
            )
        console.print(stages)
    phase = peak.peak_phase
    table = Table(title=f"per GPU of pipeline stage {peak.params.stage} (the fullest)")
    table.add_column("term")
    table.add_column("GiB", justify="right")
    table.add_column("kind")
    table.add_column("detail")
    for term in peak.static:
        add_term(table, term)
    table.add_section()
    table.add_row(f"[bold]at the peak: {escape(phase.name)}[/bold]", "", "", "")
    for term in phase.terms:
        add_term(table, term)
    table.add_section()
    total = plan.total_bytes / GIB
    table.add_row("[bold]total[/bold]", f"[bold]{total:.2f}[/bold]", "", "")
    console.print(table)
    console.print(phase_table(peak))
    console.print(escape(attention_line(plan)))
    host = sum(term.nbytes for term in peak.terms if not term.on_gpu) / GIB
    if host:
        console.print(f"host memory per GPU of this stage (not counted above): {host:.2f} GiB")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    console.print(
        f"[bold]{verdict}[/bold] in {plan.gpu_gib:g} GiB: {total:.2f} GiB needed at "
        f"{phase.name} (stage {peak.params.stage}), {plan.gpu_gib - total:+.2f} GiB headroom"
    )


def add_term(table: Table, term) -> None:
    name = term.name if term.on_gpu else f"({term.name}: not on GPU)"
    kind = "exact" if term.exact else "estimate"
    table.add_row(escape(name), f"{term.gib:.2f}", kind, escape(term.note))


def phase_table(stage: StagePlan) -> Table:
    """Each phase of the step: its own bytes and the GPU's total then; the peak marked."""
    static = sum(term.nbytes for term in stage.static if term.on_gpu) / GIB
    table = Table(title=f"phases of a step (stage {stage.params.stage}; static terms {static:.2f})")
    for column in ("phase", "phase GiB", "total GiB"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase in stage.phases:
        mark = " [bold]<- peak[/bold]" if phase is stage.peak_phase else ""
        gib = phase.nbytes / GIB
        table.add_row(escape(phase.name) + mark, f"{gib:.2f}", f"{static + gib:.2f}")
    return table


def attention_line(plan: MemoryPlan) -> str:
    """The attention core's terms (`attention_bytes`) in words."""
    att, options = plan.attention, plan.options
    if options.spec == "te":
        return (
            f"attention (te, fused): no [s, s] tensors; backward dq/dk/dv {att.backward / GIB:.2f} "
            "GiB (the fp32 softmax statistics are in the layers' activations)"
        )
    return (
        f"attention (local, unfused): {att.elements:,} elements per [heads/TP x s x s] matrix; "
        f"per layer {att.saved / GIB:.2f} GiB kept (fp32 + {options.params_dtype} probabilities, "
        f"mask), {att.persistent / GIB:.2f} GiB scores buffer, +{att.forward / GIB:.2f} / "
        f"+{att.backward / GIB:.2f} GiB at the last layer's forward / backward softmax, "
        f"+{att.excess / GIB:.2f} GiB measured excess (H200)"
    )


def build_colocated(args: argparse.Namespace, plan: MemoryPlan) -> ColocatedPlan:
    server = ServerOptions(
        tp=args.server_tp,
        gpus_per_node=args.gpus_per_node,
        residue_gib=args.server_residue_gib,
        reserve_gib=args.sglang_reserve_gib,
        host_gib=args.host_gib,
    )
    return plan_colocated(plan, server)


def render_colocated(colocated: ColocatedPlan, console: Console) -> None:
    """Each colocated phase per GPU, its terms, the KV budget and the verdict."""
    plan, server = colocated.plan, colocated.server
    table = Table(title=f"colocated: per GPU, one SGLang server (TP {server.tp}) per node")
    for column in ("phase", "GiB", "terms (GiB)"):
        table.add_column(column, justify="left" if column != "GiB" else "right")
    for phase in colocated.phases:
        terms = ", ".join(f"{t.name} {t.gib:.2f}" for t in phase.terms if t.on_gpu)
        table.add_row(escape(phase.name), f"{phase.nbytes / GIB:.2f}", escape(terms))
    console.print(table)
    console.print(
        f"KV cache {colocated.kv_bytes / GIB:.2f} GiB per GPU = {colocated.kv_tokens:,} tokens "
        f"({colocated.kv_bytes_per_token:,} B per token per GPU); SGLang "
        f"--mem-fraction-static {colocated.mem_fraction_static}; host "
        f"{colocated.host_bytes_per_node / GIB:.1f} GiB per node of {server.host_gib:g}"
    )
    verdict = "FITS" if colocated.fits else "DOES NOT FIT"
    console.print(f"[bold]colocated: {verdict}[/bold] in {plan.gpu_gib:g} GiB")
    for problem in colocated.problems:
        console.print(f"  {escape(problem)}")


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
