"""The colocated view (`plan_colocated`): each phase is the sum of its terms, the start-up phase
holds the servers' weights only (the trainer releases their KV cache and CUDA graphs before it
builds), the KV budget and ``--mem-fraction-static`` follow by hand, and a layout that cannot run
is reported (no KV cache, a phase over the GPU, the host), never a negative budget."""

from __future__ import annotations

import json

import pytest
from memory_plan_testing import load_tool, make_layout

from megatron_rl.memory_plan import (
    GIB,
    PlanOptions,
    ServerOptions,
    kv_bytes_per_token,
    load_model_config,
    plan_colocated,
    plan_memory,
)
from megatron_rl.memory_plan.colocate import (
    OFFLOADED,
    PHASE_ROLLOUT,
    PHASE_STARTUP,
    PHASE_SYNC,
    PHASE_TRAIN,
)

TINY_PARAMS = 189_824  # the tiny preset's parameter count (bf16: 2 bytes each)
MIB = 1024**2


def _tiny(gpu_gib: float, **server):
    options = PlanOptions(reserve_gib=0.125, micro_batch_tokens=64, logprob_chunk_tokens=64)
    plan = plan_memory(load_model_config("tiny"), make_layout(), options, gpu_gib=gpu_gib)
    defaults = dict(tp=2, gpus_per_node=8, residue_gib=0.05, reserve_gib=0.2, bucket_bytes=MIB)
    return plan, plan_colocated(plan, ServerOptions(**{**defaults, **server}))


def test_tiny_model_kv_budget_and_mem_fraction_match_the_hand_count():
    _, colocated = _tiny(1.0)
    weights = TINY_PARAMS * 2 // 2  # bf16 over server TP 2
    resident = GIB // 8  # the trainer's 0.125 GiB reserve: all it keeps on the GPU
    reserve = int(0.2 * GIB)
    # (weights + largest KV) / GPU = (1 GiB - 0.125 GiB - 0.2 GiB) / 1 GiB = 0.675 -> 0.67
    assert (GIB - resident - reserve) / GIB == pytest.approx(0.675, abs=1e-9)
    assert colocated.mem_fraction_static == 0.67
    assert colocated.weights_bytes == weights
    assert colocated.kv_bytes == int(0.67 * GIB) - weights
    # 2 layers x K and V x 1 KV head per GPU (2 heads over TP 2) x head_dim 16 x 2 bytes
    assert colocated.kv_bytes_per_token == 2 * 2 * 1 * 16 * 2 == 128
    assert colocated.kv_tokens == (int(0.67 * GIB) - weights) // 128
    rollout = colocated.phase(PHASE_ROLLOUT)
    assert rollout.nbytes == resident + weights + colocated.kv_bytes + reserve <= GIB
    assert colocated.fits and not colocated.problems


def test_tiny_model_phases_are_the_sums_of_their_terms():
    plan, colocated = _tiny(1.0)
    stage = plan.peak
    static = sum(t.nbytes for t in stage.static if t.on_gpu)
    moved = sum(t.nbytes for t in stage.static if t.on_gpu and t.name in OFFLOADED)
    residue, weights = int(0.05 * GIB), colocated.weights_bytes
    assert colocated.phase(PHASE_TRAIN).nbytes == plan.total_bytes + residue
    assert colocated.phase(PHASE_SYNC).nbytes == static + weights + residue + MIB
    # the servers released their KV cache and CUDA graphs before the trainer built
    assert colocated.phase(PHASE_STARTUP).nbytes == static + weights + residue
    assert colocated.host_bytes_per_node == 8 * moved  # 8 ranks' offloaded copies
    assert moved == static - GIB // 8  # everything but the reserve is offloaded


def test_sglang_reserve_is_sglangs_own_heuristic():
    """``arg_groups/memory_hook.py``: 512 MB + 1.5 MB x chunked prefill + 1 GB x TP / 8 + 2 MB x
    decode max batch, at least 10 GB on GPUs over 60 GB."""
    assert ServerOptions(tp=8).reserve_bytes == (512 + 12288 + 1024 + 1024) * MIB  # 14.5 GiB
    small = ServerOptions(tp=1, gpus_per_node=8, chunked_prefill_tokens=2048, decode_max_bs=32)
    assert small.reserve_bytes == 10 * 1024 * MIB  # 3,776 MB: SGLang's 10 GB floor
    assert ServerOptions(reserve_gib=3.0).reserve_bytes == 3 * GIB


def test_kv_bytes_per_token_replicates_kv_heads_beyond_the_server_tp():
    shape = plan_memory(load_model_config("qwen3-30b-a3b"), make_layout(2, tensor_parallel=2))
    qwen3 = shape.shape  # 48 layers, 4 KV heads, head_dim 128
    assert kv_bytes_per_token(qwen3, ServerOptions(tp=8)) == 48 * 2 * 1 * 128 * 2  # replicated
    assert kv_bytes_per_token(qwen3, ServerOptions(tp=2)) == 48 * 2 * 2 * 128 * 2


def test_no_room_for_a_kv_cache_is_reported_not_negative():
    _, colocated = _tiny(0.3)  # 0.3 GiB < the trainer's 0.125 + SGLang's 0.2
    assert colocated.kv_bytes == 0 and colocated.kv_tokens == 0
    assert colocated.mem_fraction_static == 0.0 and not colocated.fits
    (problem,) = colocated.problems
    assert problem.startswith("no KV cache:") and "leave -0.03 GiB of 0.3" in problem
    assert all(term.nbytes >= 0 for phase in colocated.phases for term in phase.terms)


def test_a_phase_over_the_gpu_and_a_host_too_small_are_reported():
    config = load_model_config("qwen3-30b-a3b")
    layout = make_layout(8, tensor_parallel=2, expert_parallel=8, sequence_parallel=True)
    plan = plan_memory(config, layout, PlanOptions(micro_batch_tokens=18432), gpu_gib=80)
    colocated = plan_colocated(plan, ServerOptions(host_gib=256))
    problems = "\n".join(colocated.problems)
    assert colocated.kv_bytes > 0 and not colocated.fits
    assert f"{PHASE_TRAIN}: 82.40 > 80 GiB" in problems  # one node: expert state unsharded
    assert f"{PHASE_STARTUP}: 81.37 > 80 GiB" in problems  # checked like the others
    assert "host: 538.1 GiB per node > 256 GiB" in problems


def test_startup_holds_no_kv_so_the_rollout_fraction_is_safe_from_the_start():
    """The launcher's layout at 80 and 141 GiB: start-up is the sync phase less its bucket, with
    no KV cache or CUDA graphs, far below the GPU at the rollout-optimal fraction."""
    config = load_model_config("qwen3-30b-a3b")
    layout = make_layout(32, tensor_parallel=2, expert_parallel=8, sequence_parallel=True)
    options = PlanOptions(micro_batch_tokens=18432)
    for gpu_gib, fraction in ((80, 0.76), (141, 0.86)):
        plan = plan_memory(config, layout, options, gpu_gib=gpu_gib)
        colocated = plan_colocated(plan)
        startup = colocated.phase(PHASE_STARTUP)
        names = [term.name for term in startup.terms]
        assert names == ["trainer static", "server weights", "server residue"]
        assert startup.nbytes == colocated.phase(PHASE_SYNC).nbytes - 512 * MIB
        assert round(startup.nbytes / GIB, 2) == 49.37 < gpu_gib
        assert colocated.mem_fraction_static == fraction and colocated.fits


def test_server_options_refuse_a_tp_that_does_not_tile_the_node():
    with pytest.raises(ValueError, match="tp=3 must divide gpus_per_node=8"):
        ServerOptions(tp=3)


def test_cli_colocated_json_and_table(capsys):
    tool = load_tool()
    argv = ["--model", "qwen3-30b-a3b", "--tp", "2", "--ep", "8", "--world-size", "32"]
    argv += ["--micro-batch-tokens", "18432", "--colocated", "--server-tp", "8"]
    assert tool.main([*argv, "--json"]) == 0
    colocated = json.loads(capsys.readouterr().out)["colocated"]
    assert colocated["mem_fraction_static"] == 0.76 and colocated["kv_tokens"] == 2_345_803
    assert colocated["kv_cache_gib"] == pytest.approx(53.69, abs=0.01) and colocated["fits"]
    assert colocated["phases"][PHASE_STARTUP]["gib"] == pytest.approx(49.37, abs=0.01)
    assert tool.main([*argv, "--gpu-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "--mem-fraction-static 0.86" in out and "4,987,341 tokens" in out
    assert "KV cache 114.15 GiB per GPU" in out and "warning" not in out
    assert "colocated: FITS in 141 GiB" in out
