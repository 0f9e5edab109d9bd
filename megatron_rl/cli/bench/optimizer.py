"""One optimizer step of the policy, megatron's per-tensor path against the buffer-level one.

    megatron-rl bench optimizer [--preset tiny] [--dtype float32] [--distributed]
                                [--sequential] [--repeats 40] [--fused]

A step is what `PolicyOptimizer` runs between two backward passes: ``zero_grad()``, then (random
gradients written into megatron's grad buffers, not timed) ``finalize_model_grads``, the grad
norm, clipping (on: ``clip_grad`` 1e-3) and Adam. Arms, on one model and optimizer at world size
1, one torch thread:

- ``old``: the step before the buffer-level path: the chunked finite check of every grad buffer,
  then megatron-core's own ``step()`` (per-tensor norm and scale, torch's per-tensor AdamW loop);
- ``new``: `PolicyOptimizer.step` (one foreach norm over megatron's tensor list with the finite
  check folded in, clipping over the buffers, foreach AdamW; bitwise the old step);
- ``fused`` (``--fused``): ``new`` with torch's fused CPU AdamW instead of foreach (the
  trainer's default, ``--cpu-adam fused``); also prints
  its largest parameter difference from foreach after 5 steps from the same start.

The arms alternate (ABBA) within every repeat; the ratio is old / arm, paired per repeat:
median [min-max]. ``--sequential``: megatron's SequentialMLP (a parameter per expert) instead of
grouped experts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import tempfile
import time

import torch

from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
from megatron_rl.backend.cpu_optimizer import foreach_adam
from megatron_rl.backend.grad_check import all_finite
from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
from megatron_rl.collectives import all_ranks_agree
from megatron_rl.model import PRESET_NAMES, ModelOptions, build_model, preset_config


def build(args, options: ModelOptions):
    model = wrap_for_training(
        build_model(preset_config(args.preset), options),
        use_distributed_optimizer=args.distributed,
    )
    config = OptimizerConfig(  # foreach: the ``new`` arm; ``fused`` switches it per step
        lr=1e-4, clip_grad=1e-3, use_distributed_optimizer=args.distributed, cpu_adam="foreach"
    )
    return build_optimizer(model, config)


def random_grads(optimizer, generator: torch.Generator) -> None:
    for buffer in optimizer.model.buffers + optimizer.model.expert_parallel_buffers:
        buffer.grad_data.normal_(generator=generator)


def old_step(optimizer) -> float | None:
    """`PolicyOptimizer.step` before the buffer-level path (megatron's own step)."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_rl.backend.cpu_optimizer import cuda_type_names

    finalize_model_grads([optimizer.model])
    buffers = optimizer.model.buffers + optimizer.model.expert_parallel_buffers
    if not all_ranks_agree(all_finite(buffer.grad_data for buffer in buffers)):
        return None
    with cuda_type_names():
        _, grad_norm, _ = optimizer.inner.step()
    return grad_norm


def fused_adam(optimizer):
    """torch's fused AdamW for ``optimizer``'s groups within the block."""
    return foreach_adam(optimizer._torch_optimizers, fused=True)


def timed_step(optimizer, arm: str, generator: torch.Generator) -> float:
    """Seconds of ``zero_grad`` + the step of ``arm`` (the gradient fill in between untimed)."""
    start = time.perf_counter()
    optimizer.zero_grad()
    zeroed = time.perf_counter() - start
    random_grads(optimizer, generator)
    start = time.perf_counter()
    if arm == "old":
        norm = old_step(optimizer)
    else:
        with fused_adam(optimizer) if arm == "fused" else contextlib.nullcontext():
            norm = optimizer.step()
    elapsed = zeroed + time.perf_counter() - start
    if norm is None:
        raise RuntimeError(f"the {arm} arm skipped a finite step")
    return elapsed


def fused_difference(args, options: ModelOptions, steps: int = 5) -> float:
    """max |fused - foreach| / max |parameter| over the fp32 parameters Adam updates, after
    ``steps`` steps from the same start."""
    pair = [build(args, options) for _ in range(2)]
    pair[1].model.module.load_state_dict(pair[0].model.module.state_dict())
    with torch.no_grad():  # the same master weights too
        for a, b in zip(pair[0].param_groups, pair[1].param_groups, strict=True):
            for p, q in zip(a["params"], b["params"], strict=True):
                q.copy_(p)
    for step in range(steps):
        for optimizer in pair:
            optimizer.zero_grad()
            random_grads(optimizer, torch.Generator().manual_seed(step))
        pair[0].step()
        with fused_adam(pair[1]):
            pair[1].step()
    worst = 0.0
    for a, b in zip(pair[0].param_groups, pair[1].param_groups, strict=True):
        for p, q in zip(a["params"], b["params"], strict=True):
            p, q = p.detach(), q.detach()
            worst = max(worst, float((p - q).abs().max()) / max(float(p.abs().max()), 1e-30))
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=PRESET_NAMES)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--distributed", action="store_true", help="megatron's distributed Adam")
    parser.add_argument("--sequential", action="store_true", help="one parameter per expert")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--fused", action="store_true", help="also time torch's fused AdamW")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    options = ModelOptions(dtype=args.dtype)
    if args.sequential:
        options = dataclasses.replace(options, moe_grouped_gemm=False)
    arms = ["old", "new"] + (["fused"] if args.fused else [])
    with tempfile.TemporaryDirectory() as tmp:
        init_distributed(ParallelConfig(), init_method=f"file://{tmp}/rdzv", device="cpu")
        try:
            optimizer = build(args, options)
            generator = torch.Generator().manual_seed(0)
            for arm in arms * 2:  # warm-up: Adam's state, the norm plan
                timed_step(optimizer, arm, generator)
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            for repeat in range(args.repeats):
                for arm in arms if repeat % 2 == 0 else arms[::-1]:
                    times[arm].append(timed_step(optimizer, arm, generator))
            difference = fused_difference(args, options) if args.fused else None
            num_tensors = len(list(optimizer.model.parameters()))
        finally:
            destroy_distributed()

    print(
        f"{args.preset} ({num_tensors} parameter tensors{', sequential experts' * args.sequential}"
        f"), {args.dtype}, {'distributed' if args.distributed else 'non-distributed'} Adam; "
        f"{args.repeats} interleaved repeats, 1 thread; ms per step median [min-max]; "
        "ratio = old time / arm time, paired per repeat: median [min-max]"
    )
    for arm in arms:
        ms = [1e3 * t for t in times[arm]]
        line = f"{arm:>6}: {statistics.median(ms):6.2f} ms [{min(ms):.2f}-{max(ms):.2f}]"
        if arm != "old":
            ratios = [o / t for o, t in zip(times["old"], times[arm], strict=True)]
            line += f"  old/{arm} {statistics.median(ratios):.2f}x "
            line += f"[{min(ratios):.2f}-{max(ratios):.2f}]"
        print(line)
    if difference is not None:
        print(f"fused vs foreach after 5 steps: max |diff| / max |param| = {difference:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
