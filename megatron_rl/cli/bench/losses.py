"""Forward + backward time of every registered loss relative to GRPO on the same inputs.

    megatron-rl bench losses [--batch 64] [--seq-len 4096] [--repeats 15] [--threads N]

Inputs are float32 ``[batch, seq_len]`` log-probs with realistic drift and response lengths
between seq_len/4 and seq_len; each timing is the median over ``--repeats`` runs after two
warm-up runs, measured with ``time.perf_counter`` around ``compute_policy_loss`` + ``backward``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from megatron_rl.losses import available_losses, compute_policy_loss

TARGETS = {"vespo": 1.2, "epic": 2.0}


def make_inputs(batch: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, seq_len, generator=gen) * 2
    new = (old + 0.02 * torch.randn(batch, seq_len, generator=gen)).clamp(max=0)
    lengths = torch.randint(seq_len // 4, seq_len + 1, (batch,), generator=gen)
    mask = torch.arange(seq_len)[None] < lengths[:, None]
    adv = torch.randn(batch, generator=gen)
    return dict(logprobs=new, old_logprobs=old, advantages=adv, loss_mask=mask)


def time_loss(name: str, inputs: dict[str, torch.Tensor], repeats: int) -> float:
    samples = []
    for i in range(repeats + 2):
        lp = inputs["logprobs"].clone().requires_grad_()
        start = time.perf_counter()
        out = compute_policy_loss(name, **(inputs | {"logprobs": lp}))
        out.loss.backward()
        elapsed = time.perf_counter() - start
        if i >= 2:
            samples.append(elapsed)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    inputs = make_inputs(args.batch, args.seq_len)
    names = ["grpo"] + [n for n in available_losses() if n != "grpo"]
    times = {name: time_loss(name, inputs, args.repeats) for name in names}

    table = Table(
        title=f"policy losses, forward+backward, [{args.batch}, {args.seq_len}] float32, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    for column in ("loss", "ms", "x grpo", "target"):
        table.add_column(column, justify="right" if column != "loss" else "left")
    failed = []
    for name in names:
        ratio = times[name] / times["grpo"]
        target = TARGETS.get(name)
        verdict = ""
        if target is not None:
            verdict = f"<= {target:.1f}x " + ("ok" if ratio <= target else "MISSED")
            if ratio > target:
                failed.append(name)
        table.add_row(name, f"{times[name] * 1e3:.2f}", f"{ratio:.2f}", verdict)
    Console().print(table)
    if failed:
        Console().print(f"[red]targets missed: {', '.join(failed)}[/red]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
