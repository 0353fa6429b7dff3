"""Shared helpers: tiny random models, a greedy reference run, random prompts."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton decides interpret-or-compile when a kernel module is imported: without CUDA, switch the
# interpreter on before any test module imports swiftkv_fast.kernels (or the triton backend).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


FULL, SLIDE = "full_attention", "sliding_attention"
# the tiny models the engine is tested on (swiftkv_reference.testing.tiny_config overrides)
TINY_MODELS = {
    "full": dict(num_hidden_layers=4),
    "swiftkv_g1": dict(model_type="llama_swiftkv", num_hidden_layers=4, num_key_value_layers=2),
    "swiftkv_g2": dict(
        model_type="llama_swiftkv", num_hidden_layers=4, num_key_value_layers=2, key_value_group_size=2
    ),
    "mistral_window": dict(model_type="mistral", num_hidden_layers=3, sliding_window=24),
    "mistral_swiftkv_g2": dict(
        model_type="mistral_swiftkv",
        num_hidden_layers=4,
        sliding_window=20,
        num_key_value_layers=2,
        key_value_group_size=2,
    ),
    # two kvcache groups (sliding window + full)
    "hybrid": dict(
        model_type="qwen2", num_hidden_layers=4, sliding_window=16, layer_types=[SLIDE, FULL, SLIDE, FULL]
    ),
    # two kvcache groups, AcrossKV, L < N
    "hybrid_swiftkv": dict(
        model_type="qwen2_swiftkv",
        num_hidden_layers=5,
        sliding_window=16,
        num_key_value_layers=1,
        key_value_group_size=2,
        layer_types=[FULL, SLIDE, SLIDE, FULL, FULL],
    ),
    # cache layers of groups [0, 0, 0, 1, 1] -> KV slots [0, 1, 2, 0, 1]: the second-half write runs
    # (cache layers 1..2 and 3..4) sit at slots 1..2 and 0..1, not at their cache-layer indices
    "hybrid_swiftkv_g1": dict(
        model_type="qwen2_swiftkv",
        num_hidden_layers=5,
        sliding_window=16,
        num_key_value_layers=1,
        key_value_group_size=1,
        layer_types=[FULL, FULL, FULL, SLIDE, SLIDE],
    ),
}


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


def scattered_paged_cache(gen, *, kv_heads, dim, block_size, kv_lens, spare_blocks=2):
    """Random K/V caches (num_blocks, block_size, kv_heads, dim) and int32 block tables (R, width) with
    every request's blocks scattered over the cache (block 0 is the null block, never read: a table's
    unused tail points at it)."""
    width = max(-(-n // block_size) for n in kv_lens) + spare_blocks
    num_reqs = len(kv_lens)
    num_blocks = 1 + num_reqs * width
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: num_reqs * width].view(num_reqs, width)
    block_tables = torch.zeros(num_reqs, width, dtype=torch.int32)
    for r, n in enumerate(kv_lens):
        used = -(-n // block_size)
        block_tables[r, :used] = ids[r, :used].to(torch.int32)
    return k_cache, v_cache, block_tables


def naive_decode(q, k_cache, v_cache, seq_lens, block_tables, window, scale):
    # q: (R, H, D); one query per request at position seq_lens[r] - 1
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = []
    for r, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        slots = block_tables[r].long()[pos // block_size] * block_size + pos % block_size
        k = k_cache.flatten(0, 1)[slots].repeat_interleave(group, 1).transpose(0, 1)  # (H, n, D)
        v = v_cache.flatten(0, 1)[slots].repeat_interleave(group, 1).transpose(0, 1)
        seen = pos > n - 1 - window if window is not None else torch.ones(n, dtype=torch.bool)
        s = (q[r][:, None] @ k.transpose(1, 2))[:, 0] * scale  # (H, n)
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
        out.append(torch.einsum("hn,hnd->hd", p, v))  # (H, D)
    return torch.stack(out)


def naive_prefill(q, k_cache, v_cache, q_lens, kv_lens, block_tables, window, scale):
    # q: (T, H, D): request r's q_lens[r] queries at positions kv_lens[r] - q_lens[r], ..., kv_lens[r] - 1
    out, start = [], 0
    for r, (n, s) in enumerate(zip(q_lens, kv_lens)):
        for i in range(n):
            pos = s - n + i
            out.append(
                naive_decode(
                    q[start + i][None],
                    k_cache,
                    v_cache,
                    torch.tensor([pos + 1]),
                    block_tables[r : r + 1],
                    window,
                    scale,
                )[0]
            )
        start += n
    return torch.stack(out)


def at_thread_counts(fn, counts=(1, 2)) -> list:
    """fn() run under each torch thread count in `counts` (the count restored after)."""
    threads = torch.get_num_threads()
    try:
        results = []
        for n in counts:
            torch.set_num_threads(n)
            results.append(fn())
        return results
    finally:
        torch.set_num_threads(threads)


def random_prompts(n: int, vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in this test, as in a terminal: a shell without job control starts
    background commands (and so pytest) with SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


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


async def wait_until(timeout: float, predicate) -> None:
    """Poll `predicate` every 10 ms on the running event loop; AssertionError after `timeout` s."""
    for _ in range(int(timeout * 100)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")
