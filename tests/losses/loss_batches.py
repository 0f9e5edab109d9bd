"""Random loss-test batches (padded layout) and a loss-and-gradient helper."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.losses import compute_policy_loss

SEQUENCE_ADVANTAGE_LOSSES = ("gspo", "vespo", "topr")


@dataclass
class Batch:
    logprobs: torch.Tensor  # [B, T] float64 leaf
    old_logprobs: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B]
    loss_mask: torch.Tensor  # [B, T] bool, each row a contiguous response of length lengths[i]
    lengths: list[int]

    def kwargs(self) -> dict:
        return dict(
            logprobs=self.logprobs,
            old_logprobs=self.old_logprobs,
            advantages=self.advantages,
            loss_mask=self.loss_mask,
        )


def make_batch(
    num_seqs: int = 6,
    max_len: int = 9,
    seed: int = 0,
    drift: float = 0.3,
    dtype: torch.dtype = torch.float64,
) -> Batch:
    """Random sequences of varied lengths; policy and behaviour log-probs differ by ``drift``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (num_seqs,), generator=gen).tolist()
    lengths[0] = max_len
    old = -torch.rand(num_seqs, max_len, generator=gen, dtype=dtype) * 2 - 0.05
    new = old + drift * torch.randn(num_seqs, max_len, generator=gen, dtype=dtype)
    new = new.clamp(max=0.0)
    mask = torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None]
    adv = torch.randn(num_seqs, generator=gen, dtype=dtype)
    return Batch(new.requires_grad_(), old, adv, mask, lengths)


def loss_and_grad(name: str, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss value and d loss / d logprobs."""
    out = compute_policy_loss(name, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, kwargs["logprobs"])
    return out.loss.detach(), grad


def float64_batch(seed: int, scale: float):
    """``(logprobs [4, 6] requiring grad, old_logprobs, advantages [4], all-true mask)`` in
    float64: log-ratios of size ``scale`` around behaviour log-probs in [-1.1, -0.1]."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=gen, dtype=torch.float64) - 0.1
    lp = (old + scale * torch.randn(4, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, -0.7, 0.4, -1.3], dtype=torch.float64)
    return lp, old, adv, torch.ones(4, 6, dtype=torch.bool)
