"""The pipeline bubble: time per update at PP 2 plain 1F1B against PP 2 x VP 2 interleaved.

    megatron-rl bench pipeline [--repeats 3] [--steps 4] [--layers 8] [--micro-batches 4]
                               [--hidden-size 256]

Each arm is the real CLI under torchrun (``torch.distributed.run --standalone``, two gloo ranks
on the CPU, one torch thread each, so that the two stages each own a core and a stage's idle time
is the bubble). The model is the tiny preset with ``--layers`` layers (seeded weights written
once to a temporary folder); every run draws the same rollouts (same seed), so the arms differ in
their schedule only. Arms alternate within each repeat (plain first in even repeats, interleaved
first in odd ones). Per run: the mean ``time/update`` of steps 2.. (step 1 warms caches); per
repeat the ratio plain / interleaved; printed: the median ratio [min-max] over repeats.

Expected, with ``M`` micro-batches per update: plain 1F1B idles ``(PP - 1)`` micro-batch slots
per stage, interleaving ``(PP - 1) / V`` of them, so the update time is ``(M + PP - 1) t`` against
``(M + (PP - 1) / V) t`` plus ``V`` times the point-to-point messages (`expected_ratio`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def expected_ratio(micro_batches: int, pp: int, vp: int) -> float:
    """Update time of plain 1F1B over interleaved 1F1B when compute is all that costs:
    ``(M + PP - 1) / (M + (PP - 1) / V)``."""
    return (micro_batches + pp - 1) / (micro_batches + (pp - 1) / vp)


def write_model(folder: Path, layers: int, hidden: int, seed: int = 0) -> Path:
    """The tiny preset with ``layers`` layers of width ``hidden`` (its MLP widths scaled with
    it) as an HF checkpoint of seeded weights."""
    from safetensors.torch import save_file

    from megatron_rl.model import preset_config
    from megatron_rl.model.conversion.names import expected_hf_shapes
    from megatron_rl.model.conversion.seeded_init import seeded_hf_tensor

    scale = hidden // 64  # the tiny preset: hidden 64, MLP 128, experts' MLP 32
    config = preset_config(
        "tiny",
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=128 * scale,
        moe_intermediate_size=32 * scale,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(folder)
    tensors = {name: seeded_hf_tensor(name, config, seed) for name in expected_hf_shapes(config)}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def run_arm(model: Path, run_dir: Path, flags: list[str], steps: int, micro: int) -> float:
    """Mean ``time/update`` (seconds) of steps 2.. of one CLI run under torchrun."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr",
        "127.0.0.1", "--nproc-per-node", "2", "-m", "megatron_rl.train",
        "--model", str(model), "--run-dir", str(run_dir), "--device", "cpu", "--no-progress",
        "--torch-threads", "1", "--train-iters", str(steps), "--seed", "3",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", str(4 * micro),
        "--global-batch-size", str(16 * micro), "--micro-batch-size", "16",
        "--max-response-length", "8", "--pipeline-model-parallel-size", "2", *flags,
    ]  # fmt: skip
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:  # a file, not a pipe: torchrun's workers may outlive a pipe
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"arm {flags} failed ({code}):\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    times = [r["time/update"] for r in rows if r.get("step", 0) >= 2 and "time/update" in r]
    if not times:
        raise RuntimeError(f"arm {flags}: no step after the first in {run_dir}")
    return statistics.fmean(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rl bench pipeline", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first: warm-up)")
    parser.add_argument("--layers", type=int, default=8, help="layers (divisible by 4)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per update")
    parser.add_argument(
        "--hidden-size",
        type=int,
        default=256,
        help="model width (a multiple of 64): compute "
        "per micro-batch against the fixed cost of a point-to-point message",
    )
    args = parser.parse_args(argv)
    if args.layers % 4 or args.hidden_size % 64 or args.steps < 2 or args.micro_batches < 2:
        parser.error(
            "--layers must divide by 4 (PP 2 x VP 2), --hidden-size by 64, --steps and "
            "--micro-batches must be >= 2"
        )
    arms = {"plain": [], "interleaved": ["--virtual-pipeline-model-parallel-size", "2"]}
    times: dict[str, list[float]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        model = write_model(Path(tmp) / "model", args.layers, args.hidden_size)
        for repeat in range(args.repeats):
            order = list(arms) if repeat % 2 == 0 else list(reversed(arms))
            for name in order:
                run_dir = Path(tmp) / f"{name}-{repeat}"
                times[name].append(
                    run_arm(model, run_dir, arms[name], args.steps, args.micro_batches)
                )
    ratios = [p / i for p, i in zip(times["plain"], times["interleaved"], strict=True)]
    print(
        f"PP 2, {args.layers} layers of width {args.hidden_size}, {args.micro_batches} "
        "micro-batches of 16 rows per update, "
        f"{args.repeats} repeats x {args.steps - 1} timed steps"
    )
    for name, values in times.items():
        print(f"  {name:>12}: time/update {statistics.median(values) * 1e3:8.1f} ms (median)")
    print(
        f"  plain / interleaved: {statistics.median(ratios):.3f} "
        f"[{min(ratios):.3f}-{max(ratios):.3f}]; compute-only expectation "
        f"{expected_ratio(args.micro_batches, 2, 2):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
