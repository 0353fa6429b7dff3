"""Model runner: builds the flat batch of a step, runs the model over the paged cache, samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swiftkv_fast.attention import get_attention_backend
from swiftkv_fast.config import EngineConfig
from swiftkv_fast.engine.scheduler import SchedulerOutput
from swiftkv_fast.model.layers import RotaryTable
from swiftkv_fast.model.swiftkv_model import ModelWeights, SwiftKVModel
from swiftkv_fast.sampler import sample
from swiftkv_fast.worker.input_batch import build_model_input
from swiftkv_fast.worker.kv_cache import allocate_kv_cache


@dataclass
class ModelRunnerOutput:
    request_ids: list[str]  # the sampled requests, in batch order
    token_ids: list[int]
    logprobs: torch.Tensor  # (S, vocab) fp32 CPU
    logits: torch.Tensor  # (S, vocab) fp32 CPU


class ModelRunner:
    def __init__(
        self,
        config,
        weights: ModelWeights,
        econf: EngineConfig,
        num_blocks: int,
        group_of_cache_layer: list[int],
        num_groups: int,
    ):
        from swiftkv_reference.rope import rope_inv_freq

        self.config = config
        self.device = torch.device(econf.device)
        self.block_size = econf.block_size
        self.num_groups = num_groups
        self.backend = get_attention_backend(econf.attention_backend, self.device)
        self.model = SwiftKVModel(
            weights,
            num_key_value_layers=config.num_key_value_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            eps=config.rms_norm_eps,
            rotary=RotaryTable(rope_inv_freq(config), econf.max_model_len, self.device),
            cache_layer_groups=group_of_cache_layer,
            backend=self.backend,
        )
        self.kv_cache = allocate_kv_cache(config, num_blocks, econf.block_size, econf.dtype, self.device)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        token_ids: list[int] = []
        for s in out.scheduled:
            token_ids.extend(s.request.all_token_ids[s.start : s.start + s.num_tokens])
        inp = build_model_input(
            token_ids,
            [s.start for s in out.scheduled],
            [s.num_tokens for s in out.scheduled],
            [s.sampled for s in out.scheduled],
            [[s.block_ids[g] for s in out.scheduled] for g in range(self.num_groups)],
            self.block_size,
            self.device,
        )
        logits = self.model.forward(inp, self.kv_cache)
        sampled = [s.request for s in out.scheduled if s.sampled]
        if logits is None:
            empty = torch.empty(0, self.config.vocab_size)
            return ModelRunnerOutput([], [], empty, empty)
        logits = logits.cpu()
        result = sample(logits, [r.sampling_params for r in sampled], [r.generator for r in sampled])
        return ModelRunnerOutput([r.request_id for r in sampled], result.token_ids, result.logprobs, logits)
