"""Model runner: owns the model weights, the KV cache (its block count and tensor) and the second
half's CUDA graphs; builds the flat batch of a step, runs the model over the paged cache, samples.

The first half (layers < L, K/V of every layer written) runs eagerly; the second half goes through
SecondHalfGraphs (worker/cuda_graph.py): a CUDA graph replay on CUDA with a capturable backend
unless enforce_eager, else eager. Sampling masks the token ids the scheduler banned for each sampled
request (`ScheduledRequest.banned_token_ids`: EOS and stop token ids before min_tokens outputs).

Under tensor parallelism every rank has a ModelRunner over its shard (model/tp_sharding.py) and its
own KV cache shard. Rank 0's executor sends the step (`StepInput`) to the workers, every rank runs
`execute_model` (the collectives keep them in step), and rank 0 alone samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swiftkv_fast import envs
from swiftkv_fast.attention import get_attention_backend
from swiftkv_fast.config import EngineConfig
from swiftkv_fast.distributed.parallel_state import SINGLE, TensorParallelGroup
from swiftkv_fast.kernels.plan import plan_kernels
from swiftkv_fast.logger import init_logger
from swiftkv_fast.model.kv_cache_layout import KVCacheLayout
from swiftkv_fast.model.swiftkv_model import RESIDUAL_DTYPE
from swiftkv_fast.model.tp_sharding import TensorParallelShard
from swiftkv_fast.sampler import sample, top_logprobs
from swiftkv_fast.scheduler_output import SchedulerOutput
from swiftkv_fast.worker.cuda_graph import SecondHalfGraphs
from swiftkv_fast.worker.host_allocator import tune_for_inference
from swiftkv_fast.worker.input_batch import StepInput, build_model_input
from swiftkv_fast.worker.kernel_plan import build_model
from swiftkv_fast.worker.kv_cache import allocate_kv_cache, num_blocks_for

logger = init_logger(__name__)


@dataclass
class ModelRunnerOutput:
    """One row per sampled request, in batch order."""

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token (log_softmax of the raw logits)
    top_logprobs: list[dict[int, float] | None]  # {token: logprob} where the request asked for logprobs
    logits: list[torch.Tensor | None]  # (vocab,) fp32 CPU row of each sampled token, with return_logits


class ModelRunner:
    def __init__(
        self,
        config,
        econf: EngineConfig,
        layout: KVCacheLayout,
        state_dict: dict[str, torch.Tensor],
        tp: TensorParallelGroup = SINGLE,
    ):
        """`econf.max_model_len` must be resolved; `layout` is the rank's (its K/V heads). `state_dict`
        is the rank's shard (model/tp_sharding.py shard_state_dict; the whole model when tp.size == 1).
        Raises ValueError when the KV cache cannot hold one request of max_model_len tokens."""
        self.config, self.econf, self.layout, self.tp = config, econf, layout, tp
        self.shard = TensorParallelShard.of(config, tp.rank, tp.size)
        self.device = torch.device(econf.device)
        if self.device.type == "cpu":
            tune_for_inference()  # before the weights and the KV cache are allocated
        self.block_size = econf.block_size
        # blocks one request of max_model_len tokens holds at most, over every kvcache group
        self.blocks_per_request = layout.max_num_held_blocks(
            econf.max_model_len, econf.max_num_batched_tokens
        )
        with envs.kernels_disabled(econf.disabled_kernels):  # the engine's own switches, while it is built
            self.plan = plan_kernels(
                self.device,
                econf.dtype,
                layout.dtype,
                num_heads=self.shard.num_heads,
                num_kv_heads=self.shard.num_kv_heads,
                head_dim=config.head_dim,
                disabled=econf.disabled_kernels,
                tensor_parallel_size=tp.size,
                compute_dtype=econf.compute_dtype,
            )
        self.num_blocks = tp.min_int(  # every rank holds the same block ids
            num_blocks_for(
                layout,
                econf.device,
                econf.num_kv_blocks,
                econf.kv_cache_memory,
                max_blocks_useful=1 + econf.max_num_seqs * self.blocks_per_request,
            )
        )
        if self.num_blocks - 1 < self.blocks_per_request:
            raise ValueError(
                f"the KV cache ({self.num_blocks} blocks of {econf.block_size}) cannot hold one request of "
                f"max_model_len={econf.max_model_len} tokens ({self.blocks_per_request} blocks + the null "
                "block): give it more memory or lower max_model_len"
            )
        self.backend = get_attention_backend(
            econf.attention_backend, self.device, econf.block_size, self.plan
        )
        self.kv_cache = allocate_kv_cache(layout, self.num_blocks, self.device)
        self.model = build_model(
            config, econf, layout, state_dict, tp, self.plan, self.backend, self.kv_cache
        )
        tp.min_int(1)  # every rank built its model: one that failed is reported here, at start-up
        if tp.rank == 0:
            logger.info("%s", self.plan.table())
        self.graphs = self.make_graphs()

    def make_graphs(self, *, emulate: bool = False, sizes: list[int] | None = None) -> SecondHalfGraphs:
        """The second half's graph runner; ``emulate=True`` replays by direct calls (tests, CPU)."""
        econf, model, kv_cache = self.econf, self.model, self.kv_cache

        def second_half(hidden, positions, seq_lens, block_tables):
            return model.second_half(hidden, positions, seq_lens, block_tables, kv_cache)

        return SecondHalfGraphs(
            second_half,
            max_num_seqs=econf.max_num_seqs,
            max_blocks_per_req=-(-econf.max_model_len // econf.block_size),
            num_groups=self.layout.num_groups,
            hidden_size=self.config.hidden_size,
            dtype=RESIDUAL_DTYPE,
            device=self.device,
            enforce_eager=econf.enforce_eager,
            backend=self.backend,
            emulate=emulate,
            sizes=sizes,
        )

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One step in one process (tensor parallelism: executor/multiproc_executor.py sends the step to
        the workers between prepare_step and execute_model)."""
        step = self.prepare_step(out)
        return self.sample(out, self.execute_model(step))

    def prepare_step(self, out: SchedulerOutput) -> StepInput:
        token_ids: list[int] = []
        for s in out.scheduled:
            token_ids.extend(s.request.all_token_ids[s.start : s.start + s.num_tokens])
        return StepInput(
            token_ids,
            [s.start for s in out.scheduled],
            [s.num_tokens for s in out.scheduled],
            [s.sampled for s in out.scheduled],
            [[s.block_ids[g] for s in out.scheduled] for g in range(self.layout.num_groups)],
        )

    def execute_model(self, step: StepInput) -> torch.Tensor | None:
        """The model over one step on this rank: fp32 CPU logits (S, vocab) of the sampled tokens, None
        when none is sampled. Every rank runs it on the same step (its collectives pair them up)."""
        inp = build_model_input(step, self.block_size, self.device)
        h = self.model.first_half(inp, self.kv_cache)
        if h is None:
            return None
        logits = self.graphs.run(h, inp.sampled_positions, inp.sampled_seq_lens, inp.sampled_block_tables)
        return logits.cpu()  # on CUDA a copy: a replay's output buffer is reused by the next step

    def sample(self, out: SchedulerOutput, logits: torch.Tensor | None) -> ModelRunnerOutput:
        if logits is None:
            return ModelRunnerOutput([], [], [], [], [])
        sampled = [s.request for s in out.scheduled if s.sampled]
        banned = [s.banned_token_ids for s in out.scheduled if s.sampled]
        params = [r.sampling_params for r in sampled]
        nums = [p.logprobs for p in params]
        full = any(n is not None for n in nums)  # a row's top-n needs the whole log_softmax
        result = sample(
            logits,
            params,
            [r.generator for r in sampled],
            banned,
            full_logprobs=full,
            row_ops=self.plan.sampler_ops,
            sample_kernels=self.plan.sample,
        )
        tops = top_logprobs(result.logprobs, result.token_ids, nums)
        rows = [row.clone() for row in logits] if self.econf.return_logits else [None] * len(sampled)
        ids = [r.request_id for r in sampled]
        return ModelRunnerOutput(ids, result.token_ids, result.chosen_logprobs, tops, rows)
