"""One-command GPU smoke run (a few minutes on one GPU): the trainer's CUDA path and real sizes.

    python tools/gpu_smoke.py                 # on a GPU machine (CUDA torch, NCCL)
    python tools/gpu_smoke.py --device cpu --quick   # the same code on a CPU (tests, rehearsal)

(a) The RL trainer on CUDA with NCCL at world size 1, bf16 parameters and megatron's distributed
    optimizer: 4 uninterrupted steps, then 3 steps saved and resumed for a 4th; the resumed
    model must equal the uninterrupted one as closely as two uninterrupted runs equal each other
    (bitwise on CPU; on CUDA with torch's deterministic kernels where it has them, and the
    run-to-run difference reported as the floor).
(b) The trainer's feature paths on ``--device`` (2 steps each, tiny model): every loss, R2 and R3
    routing replay, the KL reference (offloaded to host between steps on CUDA), rollout
    corrections with the engine's log-probs, token-budget balanced micro-batches, asynchronous
    rollouts, and ``torch_dist`` checkpoints saved (also with ``--async-save``: megatron's forked
    writer) and resumed. Each arm must finish with finite metrics; a failing arm is reported
    with its error and the others still run.
(c) The embedded default's throughput, sync vs ``--async-rollout`` (a measurement: samples/s).
(d) A Qwen3-30B-A3B-shaped slice (the real hidden size, heads, 128 experts top-8, vocabulary;
    2 layers) runs the old-logprob pass (forward, log-probs, entropy) and two updates (forward,
    backward, distributed-optimizer step) at ``--tokens`` tokens; the peak GPU memory of the
    second update (Adam's state allocated, as the plan counts it) is printed next to
    ``tools/memory_plan.py``'s prediction for the same layout, with the peaks of the earlier
    phases.
(e) Colocated mode's offload (`megatron_rl.train.offload`) of a megatron model with its
    distributed optimizer: the host copy is one arena (page-locked on CUDA, exactly the bytes
    moved up to alignment), onload restores every byte, and the device's own account after the
    offload (``mem_get_info``, torch's reserved bytes, what neither accounts for) is reported
    next to the bytes moved: the residue colocated servers cannot have.

Needs megatron-core and transformers, not Transformer Engine or SGLang: without TE the local
layer spec is used (``--transformer-impl local``), whose unfused attention keeps
``heads x s x s`` scores per layer that the memory plan (which assumes fused attention) leaves
out; the script prints that term separately. Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch


def _step_file(save_dir: str) -> str:
    with open(os.path.join(save_dir, "latest"), encoding="utf-8") as handle:
        step = int(handle.read())
    return os.path.join(save_dir, f"step_{step:08d}", "model_rank00000.pt")


def trainer_resume_check(device: str, quick: bool, workdir: str) -> dict:
    """(a): 4 steps straight vs 3 + resume 1, on ``device``; returns the comparison."""
    from megatron_rl.train.config import TrainConfig
    from megatron_rl.train.run import run

    def config(name: str, iters: int, **extra) -> TrainConfig:
        folder = os.path.join(workdir, name)
        return TrainConfig.from_flags(
            device=device,
            bf16=True,
            use_distributed_optimizer=True,
            transformer_impl="local",
            train_iters=iters,
            rollout_batch_size=4 if quick else 16,
            n_samples_per_prompt=4 if quick else 8,
            global_batch_size=8 if quick else 64,
            micro_batch_size=4 if quick else 32,
            max_response_length=3,
            run_dir=folder,
            save=os.path.join(folder, "ckpt"),
            no_progress=True,
            seed=7,
            **extra,
        )

    def max_param_diff(a_name: str, b_name: str) -> float:
        a = torch.load(_step_file(os.path.join(workdir, a_name, "ckpt")), weights_only=False)
        b = torch.load(_step_file(os.path.join(workdir, b_name, "ckpt")), weights_only=False)
        worst = 0.0
        for name, tensor in a["model"].items():
            if torch.is_tensor(tensor) and tensor.is_floating_point():
                diff = (tensor.float() - b["model"][name].float()).abs().max()
                worst = max(worst, float(diff))
        return worst

    start = time.perf_counter()
    if device == "cuda":  # deterministic kernels where torch has them (warns where it has none)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        run(config("straight", 4))
        run(config("straight_again", 4))
        run(config("resumed", 3))
        resumed = config("resumed", 4)
        run(resumed.with_flags(load=resumed.checkpoint.save))
    finally:
        torch.use_deterministic_algorithms(False)
    floor = max_param_diff("straight", "straight_again")  # run-to-run noise of this device
    worst = max_param_diff("straight", "resumed")
    return {
        "check": "resume equals uninterrupted (bf16, distributed optimizer, 4 steps)",
        "max_abs_param_diff": worst,
        "run_to_run_diff": floor,
        "resumed_vs_second_straight_diff": max_param_diff("straight_again", "resumed"),
        "passed": worst <= floor,
        "seconds": round(time.perf_counter() - start, 1),
    }


def slice_memory_check(device: str, tokens: int, quick: bool, workdir: str) -> dict:
    """(d): the 30B-shaped slice at ``tokens`` tokens; measured peak vs the memory plan."""
    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
    from megatron_rl.memory_plan import Layout, PlanOptions, plan_memory
    from megatron_rl.model import ModelOptions, build_model, preset_config
    from megatron_rl.train.logprobs import forward_logits, token_entropy, token_logprobs

    if quick:
        hf_config = preset_config("tiny")
    else:
        hf_config = preset_config("qwen3-30b-a3b", num_hidden_layers=2)
    init_distributed(ParallelConfig(), init_method=f"file://{workdir}/slice_rdzv", device=device)
    try:
        compute = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
        if compute is not None:
            torch.cuda.reset_peak_memory_stats()
        model = wrap_for_training(
            build_model(
                hf_config, ModelOptions(dtype="bfloat16", spec="local", local_attention="unfused")
            )
        )
        optimizer = build_optimizer(model, OptimizerConfig(lr=1e-6))
        tokens = torch.randint(0, hf_config.vocab_size, (1, tokens), device=compute or "cpu")
        gib = 2**30
        phases = {}
        if compute is not None:
            phases["allocated_before_passes_gib"] = round(torch.cuda.memory_allocated() / gib, 3)
        start = time.perf_counter()
        model.eval()
        with torch.no_grad():  # the old-logprob pass
            logits = forward_logits(model, tokens)
            old = token_logprobs(logits, tokens)
            entropy = token_entropy(logits)
            del logits
        if compute is not None:
            phases["peak_old_logprob_pass_gib"] = round(torch.cuda.max_memory_allocated() / gib, 3)
        model.train()
        for update in range(2):  # Adam's m and v exist from the first step on: the second
            if compute is not None and update == 1:  # update is the steady state the plan counts
                phases["peak_first_update_gib"] = round(torch.cuda.max_memory_allocated() / gib, 3)
                torch.cuda.reset_peak_memory_stats()
            optimizer.zero_grad()
            logprobs = token_logprobs(forward_logits(model, tokens), tokens)
            loss = -(logprobs * torch.randn_like(logprobs)).mean()
            loss.backward()
            del logprobs, loss
            grad_norm = optimizer.step()
            if update == 0:
                seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() if compute is not None else None
    finally:
        destroy_distributed()
    plan = plan_memory(
        hf_config,
        Layout.from_world_size(ParallelConfig(), world_size=1),
        PlanOptions(
            params_dtype="bfloat16",
            distributed_optimizer=True,
            recompute="none",
            micro_batch_tokens=tokens.numel(),
            reserve_gib=0.0,
            spec="local",  # no TE on the lent GPU: megatron's unfused attention, torch's AdamW
        ),
        gpu_gib=1e6,
    )
    s = tokens.numel()
    return {
        "check": f"{'tiny' if quick else 'Qwen3-30B-A3B-shaped 2-layer'} slice at {s} tokens",
        "finite": bool(torch.isfinite(old).all() and torch.isfinite(entropy).all()),
        "grad_norm": grad_norm,
        "seconds": round(seconds, 2),
        "peak_second_update_gib": None if peak is None else round(peak / 2**30, 3),
        **phases,
        "plan_gib": round(plan.total_bytes / 2**30, 3),
        "plan_terms_gib": {t.name: round(t.gib, 3) for t in plan.peak.terms if t.on_gpu},
        "plan_peak_phase": plan.peak.peak_phase.name,
        "passed": grad_norm is not None and bool(torch.isfinite(old).all()),
    }


FEATURE_ARMS: dict[str, dict] = {
    "vespo+r3+torch_dist": dict(loss="vespo", routing_replay="r3", ckpt_format="torch_dist"),
    "epic+r2+kl": dict(loss="epic", routing_replay="r2", kl_coef=0.01),
    "gspo+engine-logprobs+tis": dict(
        loss="gspo", behavior_logprobs="rollout", rollout_correction="tis-token"
    ),
    "gspo_token+icepop+bf16-rollout": dict(
        loss="gspo_token", rollout_correction="icepop", rollout_dtype="bfloat16"
    ),
    "dapo+token-budget+balance": dict(loss="dapo", max_tokens_per_gpu=64, balance_data=True),
    "grpo+async-save": dict(ckpt_format="torch_dist", async_save=True),
    "cispo+async": dict(loss="cispo", async_rollout=True),
    "sapo": dict(loss="sapo"),
    "topr": dict(loss="topr"),
}


def _finite_metrics(metrics: dict) -> list[str]:
    """Names of the non-finite numbers in ``metrics`` (empty when all are finite)."""
    bad = []
    for name, value in metrics.items():
        if isinstance(value, float) and not (value == value and abs(value) != float("inf")):
            bad.append(name)
    return bad


def feature_matrix_check(device: str, quick: bool, workdir: str) -> dict:
    """(b): each arm of ``FEATURE_ARMS`` trains 2 steps; the torch_dist arm resumes for a 3rd."""
    from megatron_rl.train.config import TrainConfig
    from megatron_rl.train.run import run

    arms = {}
    for name, extra in FEATURE_ARMS.items():
        folder = os.path.join(workdir, "arm_" + "".join(c if c.isalnum() else "_" for c in name))
        config = TrainConfig.from_flags(
            device=device,
            transformer_impl="local",
            train_iters=2,
            rollout_batch_size=4,
            n_samples_per_prompt=4,
            global_batch_size=8,
            micro_batch_size=4,
            max_response_length=4,
            run_dir=folder,
            save=os.path.join(folder, "ckpt"),
            no_progress=True,
            seed=11,
            **extra,
        )
        start = time.perf_counter()
        try:
            metrics = run(config)
            if extra.get("ckpt_format") == "torch_dist":  # resume the saved step for one more
                metrics = run(config.with_flags(train_iters=3, load=config.checkpoint.save))
            bad = _finite_metrics(metrics)
            arms[name] = {"passed": not bad and bool(metrics), "non_finite": bad}
        except Exception as error:  # one arm's failure must not hide the others
            arms[name] = {"passed": False, "error": _error_tail(error)}
        arms[name]["seconds"] = round(time.perf_counter() - start, 1)
    return {
        "check": "feature paths: losses, R2/R3, KL reference, corrections, budgets, async, "
        "torch_dist resume",
        "arms": arms,
        "passed": all(arm["passed"] for arm in arms.values()),
    }


def async_throughput_check(device: str, quick: bool, workdir: str) -> dict:
    """(c): samples/s of the embedded default, sync vs ``--async-rollout``, interleaved pairs.

    A run's step time is the median of its own ``time/step`` metric over every step but the
    first (start-up, and the async run's foreground first rollout, left out); each repeat runs
    sync and async back to back, in alternating order.
    """
    from megatron_rl.train.config import TrainConfig
    from megatron_rl.train.run import run
    from megatron_rl.train.run_logger import METRICS_FILE

    iters = 3 if quick else 13
    repeats = 1 if quick else 2

    def step_seconds(name: str, asynchronous: bool) -> float:
        folder = os.path.join(workdir, f"tp_{name}")
        config = TrainConfig.from_flags(
            device=device,
            transformer_impl="local",
            train_iters=iters,
            async_rollout=asynchronous,
            behavior_logprobs="rollout" if asynchronous else "trainer",
            run_dir=folder,
            no_progress=True,
        )
        run(config)
        with open(os.path.join(folder, METRICS_FILE), encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
        steps = [row["time/step"] for row in rows if "time/step" in row]  # not an eval-only row
        later = sorted(steps[1:])
        return later[len(later) // 2]

    samples = TrainConfig().samples_per_rollout
    rates: dict[str, list[float]] = {"sync": [], "async": []}
    for repeat in range(repeats):
        for arm in ("sync", "async") if repeat % 2 == 0 else ("async", "sync"):
            rates[arm].append(samples / step_seconds(f"{arm}{repeat}", arm == "async"))
    ratios = [a / s for a, s in zip(rates["async"], rates["sync"], strict=True)]
    return {
        "check": "embedded default: samples/s async vs sync (interleaved)",
        "sync_samples_per_s": [round(r, 1) for r in rates["sync"]],
        "async_samples_per_s": [round(r, 1) for r in rates["async"]],
        "async_over_sync": [round(r, 3) for r in ratios],
        "passed": True,  # a measurement, not a check
    }


def offload_check(device: str, quick: bool, workdir: str) -> dict:
    """(e): offload / onload of a megatron model and its distributed Adam; see the docstring."""
    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
    from megatron_rl.model import ModelOptions, build_model, causal_lm_logits, preset_config
    from megatron_rl.train.colocate import device_memory_metrics
    from megatron_rl.train.offload import TrainerOffload

    init_distributed(ParallelConfig(), init_method=f"file://{workdir}/offload_rdzv", device=device)
    try:
        torch.manual_seed(0)
        config = preset_config("tiny" if quick else "tiny-mismatch")
        model = wrap_for_training(build_model(config, ModelOptions(dtype="bfloat16")))
        optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3))
        compute = next(model.parameters()).device
        tokens = torch.randint(0, config.vocab_size, (2, 17), device=compute)
        logits = causal_lm_logits(model, tokens[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].ravel())
        loss.backward()
        assert optimizer.step() is not None  # Adam's state exists
        offload = TrainerOffload(model, optimizer)
        before = [t.detach().clone() for t in model.parameters()]
        account_before = device_memory_metrics(offload.device)
        freed = offload.offload()
        moved = offload.copied_bytes  # the gradient buffers are freed, not copied
        account_after = device_memory_metrics(offload.device)
        pinned = bool(offload._arena.pinned and offload._arena.buffer.is_pinned())
        offload.onload()
        offload.offload()  # the second rollout's copy reuses the arena
        offload.onload()
        exact = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        result = {
            "check": "offload",
            "freed_bytes": freed,
            "moved_bytes": moved,
            "host_arena_bytes": offload.host_bytes,
            "host_allocations": offload.host_allocations,
            "pinned": pinned,
            "exact": exact,
            "device_before": account_before,
            "device_after_offload": account_after,
        }
        offload.close()
    finally:
        destroy_distributed()
    one_arena = result["host_allocations"] == 1 and moved <= result["host_arena_bytes"]
    result["passed"] = exact and one_arena and (device == "cpu" or pinned)
    return result


def _error_tail(error: BaseException) -> str:
    """The last lines of ``error``'s traceback: enough to locate a failure from a remote log."""
    import traceback

    text = "".join(traceback.format_exception(error))
    print(text, file=sys.stderr, flush=True)  # the whole traceback in the log
    return text[-1500:]


def _guarded(check, *args) -> dict:
    """Run one check; an exception becomes a failed result carrying its traceback's tail."""
    try:
        return check(*args)
    except Exception as error:  # report and go on to the next check
        return {"check": check.__name__, "passed": False, "error": _error_tail(error)}


CHECKS = ("resume", "features", "throughput", "slice", "offload")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the slice's batch")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU rehearsal)")
    parser.add_argument("--out", help="also write the results as JSON here")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=CHECKS,
        help="run only these checks (default: all)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available (use --device cpu --quick)")
    from megatron_rl.quiet_imports import quiet_third_party_warnings

    quiet_third_party_warnings()
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        checks = [
            (trainer_resume_check, args.device, args.quick, workdir),
            (feature_matrix_check, args.device, args.quick, workdir),
            (async_throughput_check, args.device, args.quick, workdir),
            (slice_memory_check, args.device, args.tokens, args.quick, workdir),
            (offload_check, args.device, args.quick, workdir),
        ]
        names = dict(zip(CHECKS, checks, strict=True))
        checks = [names[name] for name in args.only] if args.only else checks
        for check, *check_args in checks:
            results.append(_guarded(check, *check_args))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
