"""AcrossKV's saving is real in vLLM's accounting, and fast prefill really skips the prompt tokens.

For a fixed KV cache space, vLLM's token capacity is inversely proportional to the number of caches it
allocates: N for the plain model, L + (N - L) / G for SwiftKV."""

from __future__ import annotations

import pytest
from helpers import engine, write_checkpoint

N, L = 6, 2


def _kv_caches(worker):
    """(attention layers bound to a cache, distinct cache tensors) as vLLM's runner holds them."""
    caches = worker.model_runner.kv_caches
    return len(caches), len({t.data_ptr() for t in caches})


def _capacity(llm) -> int:
    cache = llm.llm_engine.vllm_config.cache_config
    return cache.num_gpu_blocks * cache.block_size


@pytest.fixture(scope="module")
def plain_capacity(tmp_path_factory):
    path, _, _ = write_checkpoint(tmp_path_factory.mktemp("plain"), num_hidden_layers=N)
    with engine(path) as llm:
        assert llm.collective_rpc(_kv_caches) == [(N, N)]
        return _capacity(llm)


@pytest.mark.parametrize("group_size", [1, 2])
def test_kv_caches_and_token_capacity_follow_the_formula(tmp_path, plain_capacity, group_size):
    path, config, _ = write_checkpoint(
        tmp_path,
        model_type="llama_swiftkv",
        num_hidden_layers=N,
        num_key_value_layers=L,
        key_value_group_size=group_size,
    )
    caches = L + (N - L) // group_size
    with engine(path) as llm:
        # L own caches + one owner per group, and N - L readers aliasing their owner's tensor
        assert llm.collective_rpc(_kv_caches) == [(caches + N - L, caches)]
        ratio = _capacity(llm) / plain_capacity
    assert ratio == pytest.approx(N / caches, rel=0.02), f"capacity x{ratio:.3f}, formula x{N / caches:.3f}"


def test_layers_from_L_run_only_the_sampled_rows_with_fast_prefill(tmp_path):
    path, _, _ = write_checkpoint(
        tmp_path,
        model_type="llama_swiftkv",
        num_hidden_layers=N,
        num_key_value_layers=L,
        key_value_group_size=2,
    )

    def count_rows(model):
        model.rows_seen = {"first": [], "second": []}
        for layer, key in ((model.model.layers[0], "first"), (model.model.layers[L], "second")):
            layer.register_forward_pre_hook(
                lambda m, args, key=key: model.rows_seen[key].append(args[1].shape[0])
            )

    from vllm import SamplingParams

    with engine(path, kv_sharing_fast_prefill=True) as llm:
        llm.apply_model(count_rows)
        prompts = [list(range(3, 43)), [5, 6]]
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, detokenize=False),
            use_tqdm=False,
        )
        (rows,) = llm.apply_model(lambda model: model.rows_seen)
    # step 1 prefills 42 tokens through layers < L, but only the 2 sampled rows reach layer L; decode: 2 and 2
    assert rows == {"first": [42, 2, 2], "second": [2, 2, 2]}
