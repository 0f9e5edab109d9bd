"""Export one step of a trainer's ``--save`` folder as an HF checkpoint (safetensors + config).

    python tools/export_trainer_checkpoint.py --step-dir SAVE/step_00000030 \
        --config runs/warm/s1-560 --out runs/calib/step30-hf

For a run saved in the ``torch`` format by one rank (the study's runs: world size 1). The model
is built as the trainer builds it (megatron-core, fp32, gloo world size 1) from ``--config``'s
``config.json`` (the checkpoint the run started from), loaded with ``strict=True`` from the
step's ``model_rank00000.pt``, and written with `megatron_rl.model.conversion.save_checkpoint`
into ``OUT.tmp``, then renamed to ``OUT``: a reader never sees a half-written folder. What is
written loads anywhere an HF checkpoint does (the in-process engine, SGLang,
``tools/measure_mismatch.py``). Sharded or ``torch_dist`` saves: resume them at one rank, or use
``megatron-rl convert`` on a canonical checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DDP_PREFIX = "module."  # megatron's DistributedDataParallel names its module's tensors so


def model_state(step_dir: Path) -> dict:
    """The step's model tensors in the unwrapped model's names; ValueError naming what is wrong
    when the step is not a one-rank ``torch`` save."""
    import torch

    meta_path = step_dir / "checkpoint.json"
    if not meta_path.is_file():
        raise ValueError(f"--step-dir {step_dir}: no checkpoint.json (not a step_<n> folder?)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format", "torch") != "torch":
        raise ValueError(f"--step-dir {step_dir}: format {meta['format']!r}; only 'torch' saves")
    shards = sorted(step_dir.glob("model_rank*.pt"))
    if [p.name for p in shards] != ["model_rank00000.pt"]:
        names = [p.name for p in shards]
        raise ValueError(f"--step-dir {step_dir}: model shards {names}; only a one-rank save")
    saved = torch.load(shards[0], map_location="cpu", weights_only=True)["model"]
    return {k.removeprefix(DDP_PREFIX): v for k, v in saved.items()}


def export(step_dir: Path, config_dir: Path, out: Path) -> None:
    """Write ``step_dir``'s model as an HF checkpoint at ``out`` (atomically, see above)."""
    from megatron_rl.backend import destroy_distributed, init_distributed
    from megatron_rl.model import build_model, load_hf_config
    from megatron_rl.model.conversion import save_checkpoint
    from megatron_rl.model.options import ModelOptions
    from megatron_rl.parallel import ParallelConfig

    state = model_state(step_dir)
    hf_config = load_hf_config(str(config_dir))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    init_distributed(ParallelConfig(), rank=0, world_size=1, device="cpu")
    try:
        model = build_model(hf_config, ModelOptions())
        model.load_state_dict(state, strict=True)
        save_checkpoint(model, hf_config, tmp)
    finally:
        destroy_distributed()
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--step-dir", type=Path, required=True, help="SAVE/step_<n> of a torch save")
    p.add_argument("--config", type=Path, required=True, help="HF folder with the config.json")
    p.add_argument("--out", type=Path, required=True, help="the HF checkpoint folder to write")
    args = p.parse_args(argv)
    try:
        export(args.step_dir, args.config, args.out)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
