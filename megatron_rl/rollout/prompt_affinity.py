"""Keep every sample of a prompt on one SGLang worker, so they share its prefix cache.

Why: `SGLangEngine` sends each of a prompt's ``n`` samples as its own ``/generate`` request
(``n = 1``, its own seed and retry). SGLang's radix cache is per server: a sample reuses the
prompt's KV only on the server that computed it. Chosen per request (least in flight), the ``n``
samples of a prompt scatter over the workers and each server prefills the prompt again.

Where it applies: generation that goes to the workers directly, i.e. without ``router_url`` and for
R3 (``return_routed_experts``) and sampling supports (``return_sampling_mask``) always, since
sglang-router 0.3.2 drops those fields and the client bypasses it. Generation through the router is
left to the router: sglang-router's default ``cache_aware`` policy keeps an approximate radix tree
of what it sent to each worker and sends a request to the worker with the longest prefix match when
the matched fraction exceeds ``--cache-threshold``, else to the worker with the smallest tree, and
falls back to the least loaded worker once the load is imbalanced (busiest minus idlest above
``--balance-abs-threshold`` and busiest above ``--balance-rel-threshold`` x idlest); 0.3, 64 and
1.5 by default in sglang-router 0.3.2 (its ``RouterArgs``).

Semantics here (one `PromptAffinity` per batch; no prefix tree, since within a batch the shared
prefix that matters is the prompt itself):

- a prompt is pinned to one worker when its first request is sent: among the candidates
  (healthy members, in ``--sglang-url`` order, `HttpPool._pick`) the one with the fewest
  unanswered samples pinned there by this batch, ties to the one with the fewest prompts pinned
  so far, then to the earlier URL. Both servers of a pair get work, whatever the timing;
- every later request of the prompt goes to the pinned worker while it is a candidate;
- when it is not (marked down after a refused or dropped connection or a 5xx, dropped from the
  pool, or avoided by a retry after a read timeout) the prompt is pinned anew by the same rule
  and its remaining samples follow together; samples already answered stay where they were.

Load is counted per batch only (requests of another concurrent batch or of another DP rank's
client are not seen), which is what keeps the choice a function of the batch's own progress.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)


class PromptAffinity:
    """One batch's prompt -> worker pins; thread-safe (the batch's sample threads share it).

    ``samples_per_prompt``: n, the requests each prompt will send (its load once pinned).
    """

    def __init__(self, samples_per_prompt: int) -> None:
        if not isinstance(samples_per_prompt, int) or samples_per_prompt < 1:
            raise ValueError(
                f"PromptAffinity samples_per_prompt={samples_per_prompt!r}: must be an int >= 1"
            )
        self._n = samples_per_prompt
        self._pin: dict[int, str] = {}  # prompt index -> its worker
        self._left: dict[int, int] = {}  # prompt index -> samples not yet answered
        self._load: collections.Counter[str] = collections.Counter()  # unanswered, per worker
        self._pins: collections.Counter[str] = collections.Counter()  # prompts pinned, per worker
        self.moves = 0  # prompts pinned anew after their worker stopped being a candidate
        self._lock = threading.Lock()

    def chooser(self, prompt_index: int) -> Callable[[Sequence[str]], str]:
        """The ``choose`` hook of `HttpPool.post` for one sample of ``prompt_index``."""
        return lambda candidates: self.choose(prompt_index, candidates)

    def choose(self, prompt_index: int, candidates: Sequence[str]) -> str:
        """The worker for the next request of ``prompt_index`` among ``candidates`` (non-empty):
        its pin while that is a candidate, else a new pin (see the module docstring)."""
        if not candidates:
            raise RuntimeError(f"prompt {prompt_index}: no candidate server to choose from")
        with self._lock:
            old = self._pin.get(prompt_index)
            if old in candidates:
                return old
            order = {url: k for k, url in enumerate(candidates)}
            new = min(candidates, key=lambda u: (self._load[u], self._pins[u], order[u]))
            left = self._left.setdefault(prompt_index, self._n)
            if old is not None:
                self._load[old] -= left
                self.moves += 1
                logger.warning(
                    "prompt %d: its %d unanswered samples move from %s to %s",
                    prompt_index,
                    left,
                    old,
                    new,
                )
            self._load[new] += left
            self._pins[new] += 1
            self._pin[prompt_index] = new
            return new

    def answered(self, prompt_index: int) -> None:
        """One sample of ``prompt_index`` is answered: its worker carries one sample less."""
        with self._lock:
            if self._left.get(prompt_index, 0) < 1:
                raise RuntimeError(
                    f"prompt {prompt_index}: more answers than the {self._n} samples it sends, "
                    "or an answer before any request"
                )
            self._left[prompt_index] -= 1
            self._load[self._pin[prompt_index]] -= 1

    def pins(self) -> dict[int, str]:
        """prompt index -> its current worker (for logs and tests)."""
        with self._lock:
            return dict(self._pin)
