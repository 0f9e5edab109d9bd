"""A tiny Hugging Face tokenizer built offline (WordLevel over a fixed word list) for data tests."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"]
WORDS = ["what", "is", "one", "plus", "two", "three", "?", "the", "answer", "solve", "x", "="]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tiny_tokenizer(
    folder: Path, *, chat_template: str | None = CHAT_TEMPLATE, words: list[str] = WORDS
) -> Path:
    """Write a ``PreTrainedTokenizerFast`` (vocabulary SPECIALS + ``words``) to ``folder``."""
    vocab = {token: index for index, token in enumerate(SPECIALS + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(folder)
    return folder
