"""A tokenizer for the tiny models (no files, no transformers): token id t is one character,
`ALPHABET[t % 64]` unless `chars` says otherwise, so a test can decide which ids spell a stop string.
It has what the engine uses: `__call__` (text prompts), `decode` and `apply_chat_template`."""

from __future__ import annotations

import string

ALPHABET = string.ascii_lowercase + string.ascii_uppercase + string.digits + " ."  # 64 characters
ROLES = ("system", "user", "assistant")


class CharTokenizer:
    def __init__(self, chars: dict[int, str] | None = None):
        self.chars = dict(chars or {})

    def char(self, t: int) -> str:
        return self.chars.get(t, ALPHABET[t % len(ALPHABET)])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.char(t) for t in ids)

    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) if c in ALPHABET else ALPHABET.index(" ") for c in text]

    def __call__(self, text: str) -> dict:
        return {"input_ids": self.encode(text)}

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True):
        """<role id> content per message, then 'A' when add_generation_prompt; refuses unknown roles (as
        real templates refuse, e.g., roles that do not alternate)."""
        ids = []
        for m in messages:
            if m["role"] not in ROLES:
                raise ValueError(f"unknown role {m['role']!r}")
            ids += [60 + ROLES.index(m["role"])] + self.encode(m["content"])
        return ids + (self.encode("A") if add_generation_prompt else [])
