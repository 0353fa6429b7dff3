"""The model runner on its own: built from (config, engine config, KV cache layout, weights), it owns
the block count, the KV cache tensor and the second half's graphs, and a step's output carries what the
engine records per sampled token (logprob, top logprobs, logits rows)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS
from swiftkv_fast.config import EngineConfig
from swiftkv_fast.engine.request import Request
from swiftkv_fast.model.kv_cache_layout import KVCacheLayout
from swiftkv_fast.sampler import top_logprobs
from swiftkv_fast.sampling_params import SamplingParams
from swiftkv_fast.scheduler_output import ScheduledRequest, SchedulerOutput
from swiftkv_fast.worker.model_runner import ModelRunner


def _runner(tiny, **kwargs) -> ModelRunner:
    cfg, state, _ = tiny(**TINY_MODELS["hybrid_swiftkv"])
    econf = EngineConfig(block_size=4, max_model_len=64, max_num_batched_tokens=32, **kwargs)
    return ModelRunner(cfg, econf, KVCacheLayout.from_config(cfg, 4, econf.dtype), state)


def test_runner_owns_blocks_and_kv_cache(tiny):
    runner = _runner(tiny, kv_cache_memory=1 << 20)
    assert runner.kv_cache.shape == runner.layout.kv_cache_shape(runner.num_blocks)
    assert runner.num_blocks == (1 << 20) // runner.layout.bytes_per_block
    assert runner.blocks_per_request == runner.layout.max_num_held_blocks(64, 32)
    assert not runner.graphs.enabled  # CPU


def test_runner_refuses_a_cache_too_small_for_one_request(tiny):
    with pytest.raises(ValueError, match=r"cannot hold one request of max_model_len=64"):
        _runner(tiny, num_kv_blocks=4)


def test_step_output_carries_logprobs_top_logprobs_and_logits(tiny):
    runner = _runner(tiny, num_kv_blocks=64, return_logits=True)
    reqs = [
        Request("a", [5, 6, 7], SamplingParams(temperature=0, logprobs=3), None),
        Request("b", [8, 9], SamplingParams(temperature=0), None),
    ]
    blocks = {"a": ([1], [2]), "b": ([3], [4])}
    out = SchedulerOutput([ScheduledRequest(r, 0, r.num_tokens, blocks[r.request_id], True) for r in reqs])
    res = runner.execute(out)
    assert res.request_ids == ["a", "b"]
    rows = torch.stack(res.logits)  # (2, vocab) fp32
    assert rows.dtype == torch.float32 and res.token_ids == rows.argmax(-1).tolist()
    logprobs = torch.log_softmax(rows, -1)
    assert res.logprobs == [float(logprobs[i, t]) for i, t in enumerate(res.token_ids)]
    assert res.top_logprobs == top_logprobs(logprobs, res.token_ids, [3, None])
    assert res.top_logprobs[1] is None and len(res.top_logprobs[0]) >= 3
