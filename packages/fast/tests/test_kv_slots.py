"""Physical KV slots: the kvcache groups of a hybrid model share one KV tensor slot per cache layer
(block ids never collide across groups), so a block costs max(group size) layers, not all of them."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS, random_prompts, reference_greedy
from kvcache import FullAttentionSpec, SlidingWindowSpec
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.model.kv_cache_layout import KVCacheLayout
from swiftkv_reference.testing import fp32_atol

HYBRID = TINY_MODELS["hybrid"]
HYBRID_SWIFTKV = TINY_MODELS["hybrid_swiftkv_g1"]
HYBRID_ACROSSKV = TINY_MODELS["hybrid_swiftkv"]
NON_HYBRID = {name: TINY_MODELS[name] for name in ("full", "swiftkv_g2", "mistral_swiftkv_g2")}


def _layout(groups: list[int]) -> KVCacheLayout:
    specs = (FullAttentionSpec(16), SlidingWindowSpec(16, 8))[: len(set(groups))]
    return KVCacheLayout(specs, tuple(groups), num_kv_heads=2, head_dim=4, dtype=torch.float32)


def test_kv_slots_mapping():
    for groups, slots in [
        ([0, 0, 0], [0, 1, 2]),
        ([0, 1, 0, 1], [0, 0, 1, 1]),
        ([0, 0, 0, 1, 1], [0, 1, 2, 0, 1]),
        ([0, 1, 0], [0, 0, 1]),
        ([1, 0, 1, 1], [0, 0, 1, 2]),
    ]:
        layout = _layout(groups)
        assert layout.kv_slot == tuple(slots) and layout.num_kv_slots == max(slots) + 1
        assert layout.kv_cache_shape(7) == (max(slots) + 1, 2, 7, 16, 2, 4)
        assert layout.bytes_per_block == (max(slots) + 1) * 2 * 16 * 2 * 4 * 4


def test_layout_refuses_groups_without_layers_and_mixed_block_sizes():
    with pytest.raises(ValueError, match="each of the 2 kvcache groups"):
        KVCacheLayout((FullAttentionSpec(16), SlidingWindowSpec(16, 8)), (0, 0), 2, 4, torch.float32)
    with pytest.raises(ValueError, match="one block_size"):
        KVCacheLayout((FullAttentionSpec(16), SlidingWindowSpec(8, 8)), (0, 1), 2, 4, torch.float32)


@pytest.mark.parametrize("name", list(NON_HYBRID))
def test_non_hybrid_slot_is_cache_layer(tiny, name):
    cfg, state, _ = tiny(**NON_HYBRID[name])
    llm = LLM.from_state_dict(cfg, state, kv_cache_memory=1 << 20, block_size=16, max_model_len=128)
    runner = llm.llm_engine.runner
    n = cfg.num_cache_layers
    assert list(runner.model.kv_slot) == list(range(n)) and runner.kv_cache.shape[0] == n
    per_block = n * 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert runner.kv_cache.shape[2] == (1 << 20) // per_block


@pytest.mark.parametrize(
    "overrides,slots,ratio",
    [
        (HYBRID, [0, 0, 1, 1], 2),
        (HYBRID_SWIFTKV, [0, 1, 2, 0, 1], 5 / 3),
        (HYBRID_ACROSSKV, [0, 0, 1], 3 / 2),
    ],
    ids=["hybrid", "hybrid_swiftkv", "hybrid_acrosskv"],
)
def test_hybrid_blocks_per_byte(tiny, overrides, slots, ratio):
    """Same kv_cache_memory: the tensor holds max(group size) slots, and the pool gets
    num_cache_layers / max(group size) times the blocks of a tensor with one slot per cache layer."""
    cfg, state, _ = tiny(**overrides)
    mem, bs = 4 << 20, 16
    llm = LLM.from_state_dict(cfg, state, kv_cache_memory=mem, block_size=bs, max_model_len=256)
    runner = llm.llm_engine.runner
    layout = runner.layout
    groups = list(layout.group_of_cache_layer)
    assert len(set(groups)) == 2
    kv = runner.kv_cache
    per_slot = 2 * bs * cfg.num_key_value_heads * cfg.head_dim * kv.element_size()
    assert kv.shape[0] == max(slots) + 1 == max(groups.count(g) for g in set(groups))
    num_blocks = mem // (kv.shape[0] * per_slot)
    assert kv.shape[2] == num_blocks == llm.llm_engine.kv_manager.num_blocks
    assert kv.nbytes <= mem
    unshared = mem // (cfg.num_cache_layers * per_slot)  # one slot per cache layer (the old layout)
    assert num_blocks / unshared == pytest.approx(ratio, rel=0.01)
    assert layout.bytes_per_block == kv.shape[0] * per_slot and kv.shape == layout.kv_cache_shape(num_blocks)
    assert list(runner.model.kv_slot) == slots == list(layout.kv_slot)
    torch.testing.assert_close(kv, torch.zeros_like(kv))
    # every second-half write run is a plain slice: consecutive in cache layer and in slot
    for a, b, g in runner.model.swiftkv_write_runs:
        assert {groups[c] for c in range(a, b)} == {g}
        assert list(runner.model.kv_slot[a:b]) == list(range(slots[a], slots[a] + b - a))


@pytest.mark.parametrize(
    "overrides,num_kv_blocks", [(HYBRID, 110), (HYBRID_SWIFTKV, 110)], ids=["hybrid", "hybrid_swiftkv"]
)
def test_hybrid_shared_slots_do_not_clobber(tiny, overrides, num_kv_blocks):
    """Both groups write into the same slots: with a small pool (preemption), sliding-window blocks
    recycled into the full-attention group and prefix hits, the outputs still equal the reference."""
    cfg, state, model = tiny(**overrides)
    llm = LLM.from_state_dict(
        cfg,
        state,
        return_logits=True,
        block_size=4,
        num_kv_blocks=num_kv_blocks,
        max_model_len=320,
        max_num_batched_tokens=64,
    )
    eng = llm.llm_engine
    assert eng.runner.kv_cache.shape[0] < cfg.num_cache_layers  # the groups really share slots
    used: list[set[int]] = [set(), set()]
    allocate = eng.kv_manager.allocate_slots

    def recording(*args, **kwargs):
        new = allocate(*args, **kwargs)
        for g, ids in enumerate(new or ()):
            used[g].update(ids)
        return new

    eng.kv_manager.allocate_slots = recording
    prompts = random_prompts(6, cfg.vocab_size, [300, 17, 250, 129, 64, 2], seed=7)
    prompts.append(list(prompts[0]))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert eng.scheduler.num_preemptions > 0, "the case should preempt"
    assert used[0] & used[1], "some block id should have served both groups"
    # prefix hits on blocks that may have served the other group in between
    again = [prompts[0], prompts[0], prompts[2]]
    outs2 = llm.generate(again[:1], params, use_tqdm=False) + llm.generate(again[1:], params, use_tqdm=False)
    assert outs2[0].num_cached_tokens > 0 and outs2[1].num_cached_tokens > 0
    for prompt, out in zip(prompts + again, outs + outs2):
        tokens, logits = reference_greedy(model, prompt, 5)
        assert out.outputs[0].token_ids == tokens, f"prompt of length {len(prompt)}"
        err = (out.outputs[0].logits - logits).abs().max().item()
        atol = fp32_atol(logits, model.config.num_hidden_layers)
        assert err <= atol, f"prompt of length {len(prompt)}: max |logits diff| {err} > {atol}"
    assert eng.kv_manager.num_requests == 0
