"""Peak extra memory and time of ``token_logprobs`` / ``token_entropy``: chunked vs the old code.

    megatron-rl bench logprobs [--sizes 2048x8192,4096x32768] [--batch 1] [--chunk 4096]
                               [--repeats 5] [--dtype float32|bfloat16] [--temperature 1.0]

TP=1 on CPU (a world-size-1 gloo group), one intra-op thread. "old" is the implementation before
issue 10 (a float32 copy of the whole logits shard for log-probs; a full-vocabulary gather,
``log_softmax`` and ``exp`` for entropy), kept verbatim below. Four passes are measured:
``logprobs`` and ``entropy`` under ``no_grad`` (the old-logprob pass), and ``logprobs+backward``
(the update pass: forward, then backward of a weighted sum).

Peak extra memory: every CPU allocation and free reported to ``torch.profiler`` (with
``profile_memory=True``) while the pass runs, summed in time order; the peak of that running sum
is what the pass needs on top of its inputs (for ``logprobs+backward`` it includes the gradient,
which has the logits' shape). Time: the arms run interleaved (old, new, old, new, ...) after one
warm-up each (the profiled run); the table gives the medians and the median of the per-repeat
ratios new / old.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
from megatron_rl.train.logprobs import token_entropy, token_logprobs


def old_token_logprobs(logits_BSv, tokens_BS, temperature=1.0):
    """``token_logprobs`` before issue 10 (one float32 copy of the whole shard)."""
    logits_TBv = logits_BSv[:, :-1].transpose(0, 1).float()
    if temperature not in (0.0, 1.0):
        logits_TBv = logits_TBv / temperature
    elif logits_TBv.untyped_storage().data_ptr() == logits_BSv.untyped_storage().data_ptr():
        logits_TBv = logits_TBv.clone(memory_format=torch.contiguous_format)
    target_TB = tokens_BS[:, 1:].transpose(0, 1).contiguous()
    nll_TB = tensor_parallel.vocab_parallel_cross_entropy(logits_TBv.contiguous(), target_TB)
    return -nll_TB.transpose(0, 1)


@torch.no_grad()
def old_token_entropy(logits_BSv, temperature=1.0):
    """``token_entropy`` before issue 10 (full-vocabulary gather, log_softmax, exp)."""
    logits = gather_from_tensor_model_parallel_region(logits_BSv[:, :-1].float())
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def peak_extra_bytes(fn) -> tuple[int, object]:
    """``(peak of live bytes allocated by fn above the start, fn's result)`` on CPU."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):  # stable: ties keep record order
        live += event.nbytes()
        peak = max(peak, live)
    return peak, result


def passes(logits, tokens, weights, temperature, chunk_tokens):
    """``{pass: (old, new)}`` callables, each returning the tensor compared between the arms."""

    def backward(fn, **kwargs):
        def run():
            leaf = logits.detach().requires_grad_()
            (fn(leaf, tokens, temperature, **kwargs) * weights).sum().backward()
            return leaf.grad

        return run

    def no_grad(fn, *args, **kwargs):
        def run():
            with torch.no_grad():
                return fn(logits, *args, **kwargs)

        return run

    new = {"chunk_tokens": chunk_tokens}
    return {
        "logprobs": (
            no_grad(old_token_logprobs, tokens, temperature),
            no_grad(token_logprobs, tokens, temperature, **new),
        ),
        "entropy": (
            no_grad(old_token_entropy, temperature),
            no_grad(token_entropy, temperature, **new),
        ),
        "logprobs+backward": (backward(old_token_logprobs), backward(token_logprobs, **new)),
    }


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2048x8192,4096x32768", help="SEQxVOCAB,...")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=4096, help="chunk_tokens of the new code")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)

    with tempfile.TemporaryDirectory() as tmp:
        init_distributed(ParallelConfig(), init_method=f"file://{tmp}/rdzv", device="cpu")
        try:
            rows = [run_size(args, dtype, size) for size in args.sizes.split(",")]
        finally:
            destroy_distributed()

    table = Table(
        title=f"token log-probs / entropy, TP=1 CPU, batch {args.batch}, {args.dtype}, "
        f"T={args.temperature}, chunk_tokens={args.chunk}, 1 thread, {args.repeats} repeats"
    )
    columns = ["seq x vocab", "pass", "peak old MiB", "peak new MiB", "old ms", "new ms"]
    for column in [*columns, "new/old time", "max |diff|"]:
        table.add_column(column, justify="left" if column in ("seq x vocab", "pass") else "right")
    for row in (r for size_rows in rows for r in size_rows):
        table.add_row(*row)
    Console(width=140).print(table)
    return 0


def run_size(args, dtype, size: str) -> list[tuple[str, ...]]:
    seq, vocab = (int(n) for n in size.split("x"))
    gen = torch.Generator().manual_seed(0)
    logits = (3.0 * torch.randn(args.batch, seq, vocab, generator=gen)).to(dtype)
    tokens = torch.randint(0, vocab, (args.batch, seq), generator=gen)
    weights = torch.randn(args.batch, seq - 1, generator=gen)
    rows = []
    for name, (old, new) in passes(logits, tokens, weights, args.temperature, args.chunk).items():
        peak_old, out_old = peak_extra_bytes(old)
        peak_new, out_new = peak_extra_bytes(new)
        diff = (out_old.float() - out_new.float()).abs().max().item()
        del out_old, out_new
        old_s, new_s = [], []
        for _ in range(args.repeats):  # interleaved: the arms see the same machine load
            old_s.append(timed(old))
            new_s.append(timed(new))
        ratio = statistics.median(n / o for n, o in zip(new_s, old_s, strict=True))
        rows.append(
            (
                f"{seq} x {vocab}",
                name,
                f"{peak_old / 2**20:.1f}",
                f"{peak_new / 2**20:.1f}",
                f"{statistics.median(old_s) * 1e3:.1f}",
                f"{statistics.median(new_s) * 1e3:.1f}",
                f"{ratio:.2f}",
                f"{diff:.2e}",
            )
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
