"""Silence third-party import-time warnings that tell a user of this package nothing.

megatron-core warns at import that Transformer Engine / Apex are absent and falls back to torch
(always the case on CPU, and a deliberate choice on GPU without them); it also warns about its own
deprecated defaults. Entry points (``python -m megatron_rl.train``, tools) call
`quiet_third_party_warnings` before importing megatron; the library never filters warnings
itself, so users embedding it keep every warning.
"""

from __future__ import annotations

import warnings

_SILENCED = (
    r"Transformer Engine and Apex are not installed\..*",
    r"Apex is not installed\..*",
    r"Transformer Engine is not installed\..*",
    r"full scope is deprecated\..*",
)


def quiet_third_party_warnings() -> None:
    """Ignore the known uninformative warnings of megatron-core (this process only)."""
    for pattern in _SILENCED:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
