"""Shared helpers: tiny random models, a greedy reference run, random prompts."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton decides interpret-or-compile when a kernel module is imported: without CUDA, switch the
# interpreter on before any test module imports swiftkv_fast.kernels (or the triton backend).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def reference_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and fp32 logits rows of the reference model (incremental, naive cache)."""
    cache = model.new_cache()
    ids = torch.tensor(prompt)
    logits = model.step(ids, torch.arange(len(prompt)), cache, [len(prompt) - 1])[0]
    tokens, rows = [], []
    for _ in range(max_tokens):
        rows.append(logits)
        tok = int(logits.argmax())
        tokens.append(tok)
        pos = torch.tensor([len(prompt) + len(tokens) - 1])
        logits = model.step(torch.tensor([tok]), pos, cache, [0])[0]
    return tokens, torch.stack(rows)


def random_prompts(n: int, vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="session")
def tiny():
    """(config, state_dict, reference model) builders cached per config kwargs."""
    from swiftkv_reference.testing import random_state_dict, tiny_config, tiny_model

    cache = {}

    def build(**overrides):
        key = repr(sorted(overrides.items()))
        if key not in cache:
            cfg = tiny_config(**overrides)
            cache[key] = (cfg, random_state_dict(cfg, seed=0), tiny_model(cfg, seed=0))
        return cache[key]

    return build
