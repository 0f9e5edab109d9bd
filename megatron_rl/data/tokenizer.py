"""The tokenizer interface the trainer needs, and an adapter over Hugging Face tokenizers.

Conventions shared by every implementation:
- ``encode(text)`` adds no special tokens of its own (no BOS/EOS): a chat template already writes
  them into the text, and the built-in task puts its BOS into ``prompt_ids`` itself.
- ``decode(ids)`` skips special tokens (EOS, padding, ...), so a response decodes to the text a
  reward function should see.
- ``vocab_size`` counts every id the tokenizer can produce (added tokens included); the policy's
  vocabulary must be at least this large.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer."""

    vocab_size: int
    eos_token_id: int
    pad_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """A Hugging Face tokenizer behind the `Tokenizer` protocol.

    ``pad_token_id`` falls back to ``eos_token_id`` when the tokenizer has no pad token (Qwen3
    has one; many base models do not). A tokenizer without an EOS token is refused: generation
    could never stop.
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        eos = hf_tokenizer.eos_token_id
        if eos is None:
            raise ValueError(
                f"tokenizer {type(hf_tokenizer).__name__} has no eos_token_id: set eos_token in "
                "its tokenizer_config.json (or special_tokens_map.json)"
            )
        self.hf = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        self.eos_token_id = int(eos)
        pad = hf_tokenizer.pad_token_id
        self.pad_token_id = int(eos if pad is None else pad)

    @property
    def has_chat_template(self) -> bool:
        """True when the wrapped tokenizer carries a chat template."""
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt text for ``messages`` with the assistant turn opened (generation prompt)."""
        return self.hf.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False
        )

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str | os.PathLike[str]) -> HFTokenizer:
    """``transformers.AutoTokenizer`` from a local folder (never downloads), wrapped.

    Raises ValueError when ``path`` is not a folder holding a tokenizer.
    """
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise ValueError(
            f"tokenizer path {str(path)!r} is not a folder: pass a local folder holding "
            "tokenizer.json / tokenizer_config.json (download it first, e.g. with "
            "`huggingface-cli download <repo> --local-dir <folder>`)"
        )
    try:
        hf = AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"could not load a tokenizer from {str(path)!r} ({err}): the folder must hold "
            "tokenizer.json or the slow tokenizer's vocabulary files"
        ) from err
    tokenizer = HFTokenizer(hf)
    logger.info("loaded tokenizer from %s: %r", path, tokenizer)
    return tokenizer
