"""The plan's pipeline schedule: megatron-core's warm-up counts and schedule table (plain and
interleaved 1F1B), the (chunk, micro-batch) pairs each rank holds, the stored activations and
logits they keep, the virtual pipeline in the layout and the CLI, and the bubble."""

from __future__ import annotations

import json
import types

import pytest
from memory_plan_testing import load_tool

from megatron_rl.memory_plan import (
    PHASE_LOGPROBS,
    Layout,
    ModelShape,
    PlanOptions,
    bubble_fraction,
    bubble_share,
    layer_activation_bytes,
    load_model_config,
    logits_bytes,
    plan_memory,
    rank_schedule,
    stage_params,
    stored_activations,
    warmup_micro_batches,
)
from megatron_rl.memory_plan.schedule import schedule_table
from megatron_rl.model.stages import interleaved_group_size, megatron_stage_layers
from megatron_rl.parallel import ParallelConfig

# (PP, V, M): plain 1F1B (V 1), interleaved with M a multiple of PP (N = PP), with a last group
# of >= PP (N > PP: M = 9 at PP 4 runs groups of 5 and 4), all forwards in the warm-up (M = PP)
CASES = [
    (2, 1, 1), (2, 1, 8), (4, 1, 2), (4, 1, 32), (8, 1, 64),
    (2, 2, 2), (2, 2, 3), (2, 3, 4), (4, 2, 4), (4, 2, 8), (4, 2, 9), (4, 2, 32), (4, 3, 6),
    (4, 4, 13), (8, 2, 8), (8, 2, 32), (8, 4, 17),
]  # fmt: skip


def _megatron_pp_rank_microbatches(pp: int, rank: int, virtual: int, m: int, n: int):
    """megatron-core's own ``get_pp_rank_microbatches`` for pipeline rank ``rank`` of ``pp``
    (its process group and virtual size given through a stand-in communicator)."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    group = types.SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    communicator = types.SimpleNamespace(
        pp_group=group, virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None
    )
    return get_pp_rank_microbatches(m, virtual, n, p2p_communicator=communicator)


@pytest.mark.parametrize(("pp", "virtual", "m"), CASES)
def test_warmup_and_table_are_megatrons(pp, virtual, m):
    """`warmup_micro_batches` is megatron's ``num_warmup_microbatches`` on every rank, the
    table is its ``get_schedule_table``, and a rank holds at most ``min(W + 1, V M)`` pairs:
    ``PP - r`` micro-batches with 1F1B."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    n = interleaved_group_size(m, pp) if virtual > 1 else m
    if virtual > 1:
        assert schedule_table(m, virtual, n) == get_schedule_table(m, virtual, n)
    for rank in range(pp):
        total, all_warmup, warmup, remaining = _megatron_pp_rank_microbatches(
            pp, rank, virtual, m, n
        )
        assert warmup_micro_batches(pp, rank, virtual, m, n) == warmup
        schedule = rank_schedule(pp, rank, virtual, m)
        assert (schedule.warmup, schedule.group, len(schedule.steps)) == (warmup, n, total)
        assert schedule.max_in_flight == (total if all_warmup else warmup + 1)
        if virtual == 1:
            assert schedule.max_in_flight == min(pp - rank, m)
        else:  # the formula of the brief: 2 (PP - r - 1) + (V - 1) N, capped at V M
            expected = 2 * (pp - rank - 1) + (virtual - 1) * n
            assert warmup == min(expected, virtual * m) and remaining == total - warmup
        # every step's backward runs a held pair, each pair exactly once, the chunks reversed
        assert sorted(step.backward for step in schedule.steps) == sorted(
            (mb, c) for c in range(virtual) for mb in range(m)
        )
        assert all(step.backward in step.held for step in schedule.steps)


def test_the_group_size_refuses_fewer_micro_batches_than_stages():
    with pytest.raises(ValueError, match="needs >= PP=4"):
        interleaved_group_size(3, 4)


def test_bubble_formulas():
    assert bubble_fraction(4, 1, 32) == 3 / 32  # 1F1B: (PP - 1) / M of the ideal time
    assert bubble_fraction(4, 2, 32) == 3 / 64  # interleaved: (PP - 1) / (V M)
    assert bubble_share(4, 1, 32) == 3 / 35  # of the step: (PP - 1) / (M + PP - 1)
    assert bubble_share(4, 2, 32) == 3 / 67


def _layout(model: str, tp: int, pp: int, ep: int, world: int, first, last, virtual: int):
    n = load_model_config(model).num_hidden_layers
    parallel = ParallelConfig(
        tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, sequence_parallel=True
    )
    stages = megatron_stage_layers(n, pp, first, last)
    return Layout.from_world_size(parallel, world, stages, virtual)


def test_interleaving_holds_more_layers_in_flight_than_1f1b():
    """Full recompute, Qwen3-235B at PP 4: each held (chunk, micro-batch) pair keeps its chunk's
    layer inputs ``t h a`` (+ the final norm on the last chunk of the last rank). 1F1B (23 / 24 /
    24 / 23) holds ``PP - r`` micro-batches of the stage's layers; interleaved (VP 2, 24 / 24 / 24
    / 22 in chunks of 12 / 12 / 12 / 11, M 32: N = 4) ``2 (PP - r - 1) + (V - 1) N + 1``
    pairs of ``layers / V``: on rank 0 11 x 12 = 132 layer inputs against 4 x 23 = 92."""
    shape = ModelShape.from_hf(load_model_config("qwen3-235b-a22b"))
    options = PlanOptions(micro_batch_tokens=18432, micro_batches=32)
    tha = (18432 // 4) * shape.hidden_size * 2  # t = s / TP with SP
    final_norm = 2 * tha
    plain = _layout("qwen3-235b-a22b", 4, 4, 8, 32, 23, 23, 1)
    interleaved = _layout("qwen3-235b-a22b", 4, 4, 8, 32, 24, 22, 2)
    for rank, (layers, chunk) in enumerate(zip((23, 24, 24, 23), (12, 12, 12, 11), strict=True)):
        last = final_norm if rank == 3 else 0
        one = stored_activations(shape, plain, options, stage_params(shape, plain, rank))
        assert (one.in_flight, one.warmup) == (4 - rank, 3 - rank)
        assert one.end == (4 - rank) * layers * tha + last
        two = stored_activations(
            shape, interleaved, options, stage_params(shape, interleaved, rank)
        )
        pairs = 2 * (4 - rank - 1) + (2 - 1) * 4 + 1
        assert (two.in_flight, two.warmup) == (pairs, pairs - 1)
        # the last rank holds one pair of its last chunk at a time (at N = PP)
        assert two.end == pairs * chunk * tha + last
        assert two.end > one.end
        assert two.logprobs_logits == 0


def test_which_chunks_are_held_follows_the_schedule_table():
    """No recompute, GLM-4.5 PP 4 x VP 2 (22 / 24 / 24 / 22): rank 0's chunk 0 holds layers 0-10
    (the 3 dense ones), chunk 1 layers 46-56 (MoE, heavier). Its 11 held pairs are 7 of chunk 0
    and 4 of chunk 1 at the first step, 8 and 3 after it: the plan takes the heavier mix."""
    shape = ModelShape.from_hf(load_model_config("glm-4.5"))
    layout = _layout("glm-4.5", 8, 4, 16, 64, 22, 22, 2)
    assert layout.chunk_layers(92)[0] == ((0, 11), (46, 11))
    options = PlanOptions(micro_batch_tokens=18432, recompute="none", micro_batches=32)
    steps = rank_schedule(4, 0, 2, 32).steps
    assert [sum(c == 0 for _, c in step.held) for step in steps[:2]] == [7, 8]

    def chunk(first: int) -> int:
        pattern = shape.moe_pattern[first : first + 11]
        return sum(
            sum(layer_activation_bytes(shape, layout, options, moe=bool(moe)).values())
            for moe in pattern
        )

    dense_chunk, moe_chunk = chunk(0), chunk(46)
    assert moe_chunk > dense_chunk and shape.moe_pattern[:4] == (0, 0, 0, 1)
    stored = stored_activations(shape, layout, options, stage_params(shape, layout, 0))
    assert stored.end == 7 * dense_chunk + 4 * moe_chunk


def test_the_last_rank_keeps_the_logits_of_its_waiting_micro_batches():
    """M = 9 at PP 4 x VP 2 runs groups of 5 and 4 micro-batches: the last rank then holds two
    micro-batches of its last chunk at once, and the one waiting keeps its logits (the loss is
    computed in the forward) while the other runs its log-probs backward."""
    shape = ModelShape.from_hf(load_model_config("qwen3-235b-a22b"))
    layout = _layout("qwen3-235b-a22b", 4, 4, 8, 32, 24, 22, 2)
    options = PlanOptions(micro_batch_tokens=18432, micro_batches=9)
    assert rank_schedule(4, 3, 2, 9).group == 5
    held = [sum(c == 1 for _, c in step.held) for step in rank_schedule(4, 3, 2, 9).steps]
    assert max(held) == 2
    logits = logits_bytes(shape, layout, options)
    assert logits == 18432 * (shape.vocab_size // 4) * 2
    stored = stored_activations(shape, layout, options, stage_params(shape, layout, 3))
    assert stored.logprobs_logits == logits
    plan = plan_memory(shape, layout, options)
    phase = next(p for p in plan.stages[3].phases if p.name == PHASE_LOGPROBS)
    names = [term.name for term in phase.terms]
    assert names[:3] == ["activations", "logits of in-flight micro-batches", "logits"]
    # at M = 32 (groups of 4) only the micro-batch in its log-probs backward has logits
    at_32 = plan_memory(shape, layout, PlanOptions(micro_batch_tokens=18432, micro_batches=32))
    phase = next(p for p in at_32.stages[3].phases if p.name == PHASE_LOGPROBS)
    assert "logits of in-flight micro-batches" not in [term.name for term in phase.terms]


def test_the_layout_splits_each_rank_into_chunks():
    """Chunk ``c`` of rank ``r`` is virtual stage ``c PP + r`` (`virtual_chunk_layers`): the
    parameters and MoE layers of a rank follow its chunks, and over all ranks they are those
    of plain 1F1B."""
    shape = ModelShape.from_hf(load_model_config("glm-4.5"))
    plain = _layout("glm-4.5", 8, 4, 16, 64, 22, 22, 1)
    interleaved = _layout("glm-4.5", 8, 4, 16, 64, 22, 22, 2)
    assert interleaved.rank_layers(92, 1) == (*range(11, 23), *range(57, 69))
    assert plain.rank_layers(92, 1) == tuple(range(22, 46))
    one = [stage_params(shape, plain, r) for r in range(4)]
    two = [stage_params(shape, interleaved, r) for r in range(4)]
    assert [p.moe_layers for p in one] == [19, 24, 24, 22]
    assert [p.moe_layers for p in two] == [19, 24, 24, 22]  # layers 0-2 stay on rank 0
    assert sum(p.total for p in one) == sum(p.total for p in two)
    assert [p.layers for p in two] == [22, 24, 24, 22]
    # a rank's tensors are its chunks' (megatron_rl.model.chunks: "chunks.{c}." names)
    from megatron_rl.memory_plan import stage_tensors

    names = [t.name for t in stage_tensors(shape, interleaved, 0)]
    assert names[0] == "embedding.word_embeddings.weight"
    assert "chunks.1.decoder.layers.10.input_layernorm.weight" in names


@pytest.mark.parametrize(
    ("virtual", "layers", "message"),
    [
        (0, (22, 24, 24, 22), "virtual_pipeline=0: must be an integer >= 1"),
        (2, (23, 23, 23, 23), "pipeline stage 0 holds 23 layers, not divisible by the virtual"),
        (3, (22, 24, 24, 22), "not divisible by the virtual pipeline size 3"),
    ],
)
def test_the_layout_refuses_what_megatron_refuses(virtual, layers, message):
    shape = ModelShape.from_hf(load_model_config("glm-4.5"))
    parallel = ParallelConfig(tensor_parallel=8, pipeline_parallel=4, expert_parallel=16)
    with pytest.raises(ValueError, match=message):
        Layout.from_world_size(parallel, 64, layers, virtual).validate(shape)


def test_the_plan_refuses_too_few_micro_batches_lora_and_vp_without_a_pipeline():
    shape = ModelShape.from_hf(load_model_config("glm-4.5"))
    layout = _layout("glm-4.5", 8, 4, 16, 64, 22, 22, 2)
    with pytest.raises(ValueError, match="needs >= PP=4"):
        plan_memory(shape, layout, PlanOptions(micro_batches=3))
    with pytest.raises(ValueError, match="LoRA with a virtual pipeline"):
        plan_memory(shape, layout, PlanOptions(lora_rank=8))
    single = Layout(
        parallel=ParallelConfig(tensor_parallel=8, expert_parallel=8), virtual_pipeline=2
    )
    with pytest.raises(ValueError, match="needs pipeline parallel size > 1"):
        single.validate(shape)


def test_cli_virtual_pipeline_flags_and_bubble(capsys):
    """``--virtual-pipeline-model-parallel-size`` (or Megatron-LM's per-chunk layer count) and
    ``--micro-batches``: the JSON's layout and pipeline, and the table's bubble line."""
    tool = load_tool()
    argv = "--model glm-4.5 --tp 8 --pp 4 --ep 16 --world-size 64 --micro-batch-tokens 18432 "
    argv += "--gpu-gib 141 --pipeline-layers 22,24,24,22 --micro-batches 32"
    vp = ["--virtual-pipeline-model-parallel-size", "2"]
    assert tool.main([*argv.split(), *vp, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["virtual_pipeline"] == 2
    assert plan["layout"]["chunk_layers"][3] == [[35, 11], [81, 11]]
    pipeline = plan["pipeline"]
    assert pipeline["warmup"] == [10, 8, 6, 4] and pipeline["in_flight"] == [11, 9, 7, 5]
    assert pipeline["group_size"] == 4 and pipeline["bubble"] == 3 / 64
    assert pipeline["bubble_1f1b"] == 3 / 32 and pipeline["bubble_share"] == 3 / 67
    assert [stage["in_flight"] for stage in plan["stages"]] == [11, 9, 7, 5]
    assert plan["fits"] and plan["total_gib"] < 141
    assert tool.main([*argv.split(), *vp]) == 0
    out = capsys.readouterr().out
    assert "PP4xVP2" in out and "(PP-1)/(V M) = 3/64 = 4.7% of the ideal time" in out
    assert "1F1B's (PP-1)/M 9.4%" in out
    # Megatron-LM's per-chunk flag: 92 / 4 / 23 = 1 chunk, plain 1F1B at an even split
    even = argv.replace("--pipeline-layers 22,24,24,22 ", "").split()
    assert tool.main([*even, "--num-layers-per-virtual-pipeline-stage", "23", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["virtual_pipeline"] == 1
    assert tool.main([*argv.split(), "--num-layers-per-virtual-pipeline-stage", "11"]) == 2
    assert "Megatron-LM refuses it" in capsys.readouterr().err
    assert tool.main([*argv.split(), "--virtual-pipeline-model-parallel-size", "3"]) == 2
    assert "not divisible by the virtual pipeline size 3" in capsys.readouterr().err
    # without M the bubble is not known; 1F1B without a pipeline has none
    assert tool.main([*argv.split()[:-2], *vp, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pipeline"]["bubble"] is None
    assert tool.main(["--model", "tiny", "--micro-batches", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pipeline"]["bubble"] == 0.0


def test_a_trainer_commands_virtual_pipeline_and_micro_batches_reach_the_plan(capsys):
    """The trainer's ``--virtual-pipeline-model-parallel-size`` and its batch geometry
    (``--global-batch-size`` / (DP x ``--micro-batch-size``)) decide the plan's; given both
    ways they are refused."""
    tool = load_tool()
    flags = "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 "
    flags += "--expert-model-parallel-size 2 --bf16 --micro-batch-size 2 --max-prompt-length 512 "
    flags += "--max-response-length 512 --global-batch-size 32 --rollout-batch-size 4"
    rest = ["--world-size", "4", "--json", "--", *flags.split()]
    assert tool.main(["--model", "qwen3-30b-a3b", *rest]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["virtual_pipeline"] == 2 and plan["layout"]["data_parallel"] == 2
    assert plan["options"]["micro_batches"] == 32 // (2 * 2)
    assert plan["pipeline"]["bubble"] == 1 / 16 and plan["pipeline"]["in_flight"] == [
        2 * (2 - 0 - 1) + 2 + 1,
        2 + 1,
    ]
    own = ["--model", "qwen3-30b-a3b", "--virtual-pipeline-model-parallel-size", "2"]
    assert tool.main([*own, "--world-size", "4", "--", *flags.split()]) == 2
    err = capsys.readouterr().err
    assert "--virtual-pipeline-model-parallel-size: the trainer's command after -- decides" in err
    assert tool.main(["--model", "qwen3-30b-a3b", "--micro-batches", "4", *rest]) == 2
    assert "--micro-batches: the trainer's command" in capsys.readouterr().err
