"""Tokenizers: a transformers tokenizer from a model directory, and chat prompts as token ids."""

from __future__ import annotations

import os
from pathlib import Path


def load_tokenizer(directory: str | os.PathLike):
    """The transformers tokenizer saved in `directory` (offline; never touches the hub).
    It has `apply_chat_template` when the directory has a chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(directory)), local_files_only=True)


def chat_token_ids(tokenizer, messages: str | list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat prompt: `messages` is a list of {"role", "content"} dicts or one user text."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]
