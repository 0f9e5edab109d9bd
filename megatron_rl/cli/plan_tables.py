"""The memory plan as rich tables: the terms at the peak, the phases of a step, the pipeline
stages, the attention core and the colocated view (``megatron-rl plan``; megatron_rl/cli/plan.py).
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from megatron_rl.memory_plan import GIB, MemoryPlan, StagePlan
from megatron_rl.memory_plan.colocate import ColocatedPlan


def render(plan: MemoryPlan, model: str, console: Console) -> None:
    layout, shape, peak = plan.layout, plan.shape, plan.peak
    p = layout.parallel
    console.print(
        f"[bold]{model}[/bold]: {shape.total_params() / 1e9:.2f}B params, "
        f"{shape.total_params(active=True) / 1e9:.2f}B active; {layout.world_size} GPUs = "
        f"TP{p.tensor_parallel}{'+SP' if p.sequence_parallel else ''} PP{p.pipeline_parallel}"
        f"{f'xVP{layout.virtual_pipeline}' if layout.virtual_pipeline > 1 else ''} "
        f"CP{p.context_parallel} DP{layout.data_parallel}; experts EP{p.expert_parallel} "
        f"ETP{p.expert_tensor_parallel} EDP{layout.expert_data_parallel}; "
        f"{plan.options.params_dtype}, recompute {plan.options.recompute}, "
        f"{plan.options.micro_batch_tokens:,} tokens / micro-batch"
    )
    if len(plan.stages) > 1:
        stages = Table(title="pipeline stages")
        columns = ("stage", "layers", "MoE layers", "dense params", "expert params")
        for column in (*columns, "in flight", "GiB"):
            stages.add_column(column, justify="right")
        chunks = layout.chunk_layers(shape.num_layers)
        for stage in plan.stages:
            sp = stage.params
            layers = "+".join(str(count) for _, count in chunks[sp.stage])
            stages.add_row(
                str(sp.stage),
                layers if len(chunks[sp.stage]) > 1 else str(sp.layers),
                str(sp.moe_layers),
                f"{sp.dense:,}",
                f"{sp.expert:,}",
                str(stage.stored.in_flight),
                f"{stage.gpu_bytes / GIB:.2f}",
            )
        console.print(stages)
        console.print(escape(pipeline_line(plan)))
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


def pipeline_line(plan: MemoryPlan) -> str:
    """The pipeline schedule (`MemoryPlan.pipeline`) in words: warm-up, in flight, bubble."""
    pipe = plan.pipeline
    pp, v, m = pipe.pipeline_parallel, pipe.virtual_pipeline, pipe.micro_batches
    warmup = "/".join(map(str, pipe.warmup))
    in_flight = "/".join(map(str, pipe.in_flight))
    what = "(chunk, micro-batch) pairs" if v > 1 else "micro-batches"
    text = f"pipeline: {pipe.schedule}, PP{pp}" + (f" x VP{v}" if v > 1 else "")
    if m is None:
        text += ", micro-batches per update not known (--micro-batches)"
    else:
        text += f", {m} micro-batches per update" + (
            f" in groups of {pipe.group_size}" if v > 1 else ""
        )
    text += f"; warm-up forwards per stage {warmup}, at most {in_flight} {what} in flight"
    if pipe.bubble is not None:
        formula = f"(PP-1)/(V M) = {pp - 1}/{v * m}" if v > 1 else f"(PP-1)/M = {pp - 1}/{m}"
        text += (
            f"; bubble {formula} = {pipe.bubble:.1%} of the ideal time "
            f"({pipe.bubble_share:.1%} of the step)"
        )
        if v > 1:
            text += f", 1F1B's (PP-1)/M {pipe.bubble_1f1b:.1%}"
    return text


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
