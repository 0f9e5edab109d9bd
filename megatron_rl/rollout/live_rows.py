"""The rows of a batched generation that are still decoding.

A batch decodes until its longest row ends. Without this, a row that finished is fed on (its
extra tokens dropped) until then: on long responses of uneven length about a third of the
decoding row-steps. `LiveRows.unfinished` takes finished rows out of the batch at a step
boundary, together with everything that follows a row: its KV cache (transformers'
``DynamicCache.batch_select_indices``), its sampling generator, its router-noise identity
(`RouterNoise.keep_rows`) and its captured routes (`RouteCapture.keep_rows`). Each row keeps its
own state, so leaving changes no row's draws or noise; what can move is BLAS's rounding, which
depends on a product's row count (fp32 log-probs by ~2e-7, as with another batch size).
"""

from __future__ import annotations

import torch

# finished rows leave once they are this share of the live rows: each leave copies the KV
# cache, so a straggler or two are fed on until enough of them pile up
LEAVE_AT = 0.25


class LiveRows:
    """``rows``: the batch rows (indices into the first batch of ``batch`` rows) still decoding,
    in order; row ``i`` of every later forward is batch row ``rows[i]``."""

    def __init__(self, batch: int, cache, generators, capture=None, router_noise=None) -> None:
        self.rows = torch.arange(batch)
        self.batch = batch
        self.cache = cache
        self.generators = generators  # one per live row, or None (the global RNG)
        self.capture = capture
        self.router_noise = router_noise

    def scatter(self, values_rX: torch.Tensor, fill: int) -> torch.Tensor:
        """``[batch, X]``: the live rows' ``values_rX`` at their batch rows, ``fill`` elsewhere."""
        out = torch.full(
            (self.batch, *values_rX.shape[1:]), fill, dtype=values_rX.dtype, device=values_rX.device
        )
        out[self.rows.to(values_rX.device)] = values_rX
        return out

    def unfinished(self, reasons: list[str | None]) -> torch.Tensor | None:
        """Drop the live rows whose ``reasons[row]`` is set; the kept positions (an index into
        the live rows before the call, to apply to the caller's own per-row tensors), or None
        when every live row goes on."""
        keep = [i for i, row in enumerate(self.rows.tolist()) if reasons[row] is None]
        if len(keep) > (1 - LEAVE_AT) * self.rows.numel():
            return None
        keep_K = torch.tensor(keep, dtype=torch.long)
        self.rows = self.rows[keep_K]
        self.cache.batch_select_indices(keep_K)
        if self.generators is not None:
            self.generators = [self.generators[i] for i in keep]
        if self.capture is not None:
            self.capture.keep_rows(keep_K)
        if self.router_noise is not None:
            self.router_noise.keep_rows(keep_K)
        return keep_K
