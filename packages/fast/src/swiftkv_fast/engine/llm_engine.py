"""The engine: scheduler + cache manager + executor, one `step()` at a time. The executor runs the model
(one ModelRunner here, or one per tensor-parallel rank: executor/); the runner owns the weights, the KV
cache and the CUDA graphs; the engine wires it to the scheduler and the cache manager."""

from __future__ import annotations

import random
import time
from contextlib import nullcontext

import torch
from kvcache import KVCacheManager

from swiftkv_fast.config import EngineConfig
from swiftkv_fast.engine.interrupts import deferred_interrupts
from swiftkv_fast.engine.request import Request
from swiftkv_fast.engine.scheduler import Scheduler
from swiftkv_fast.engine.stats import SchedulerStats
from swiftkv_fast.executor.executor import make_executor
from swiftkv_fast.logger import init_logger
from swiftkv_fast.model.kv_cache_layout import KVCacheLayout
from swiftkv_fast.model.tp_sharding import TensorParallelShard
from swiftkv_fast.sampling_params import SamplingParams
from swiftkv_fast.scheduler_output import SchedulerOutput
from swiftkv_fast.worker.kv_cache import log_kv_cache
from swiftkv_fast.worker.model_runner import ModelRunnerOutput

logger = init_logger(__name__)


class LLMEngine:
    def __init__(
        self,
        econf: EngineConfig,
        config,
        state_dict: dict[str, torch.Tensor],
        tokenizer=None,
        checkpoint_dir: str | None = None,
    ):
        """`checkpoint_dir`: the directory `state_dict` was read from; tensor-parallel workers read
        their shards there (None: rank 0 sends them their shards)."""
        # refuses a tensor_parallel_size the model's dimensions cannot be split by, naming them
        shard = TensorParallelShard.of(config, 0, econf.tensor_parallel_size)
        layout = KVCacheLayout.from_config(config, econf.block_size, econf.kv_cache_dtype, shard.num_kv_heads)
        if econf.num_kv_blocks is not None:  # the model fixes a block's size: checked before allocating
            what = f"num_kv_blocks={econf.num_kv_blocks} ({layout.bytes_per_block} bytes each)"
            econf.check_kv_cache_fits(econf.num_kv_blocks * layout.bytes_per_block, what)
        if econf.max_model_len is None:
            econf.max_model_len = config.max_position_embeddings
        elif econf.max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={econf.max_model_len} exceeds the model's max_position_embeddings="
                f"{config.max_position_embeddings}"
            )
        self.econf, self.config, self.tokenizer = econf, config, tokenizer
        self.executor = make_executor(config, econf, layout, state_dict, checkpoint_dir)
        self.runner = self.executor.runner  # rank 0's
        self.kv_manager = KVCacheManager(
            groups=layout.specs,
            num_blocks=self.runner.num_blocks,
            max_model_len=econf.max_model_len,
            enable_caching=econf.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self.kv_manager,
            econf.max_num_seqs,
            econf.max_num_batched_tokens,
            econf.max_model_len,
            config.eos_token_id,
            self.detokenize if tokenizer is not None else None,
        )
        self._rng = random.Random(econf.seed)
        self._counter = 0
        self._reported_preemptions = 0  # num_preemptions at the previous make_scheduler_stats
        logger.info(
            "engine: %s, N=%d, L=%d, G=%d, %s on %s, attention backend %s, %d kvcache group(s), "
            "tensor parallel size %d",
            config.model_type,
            config.num_hidden_layers,
            config.num_key_value_layers,
            config.key_value_group_size,
            str(econf.dtype).removeprefix("torch."),
            econf.device,
            self.runner.backend.name,
            layout.num_groups,
            econf.tensor_parallel_size,
        )
        log_kv_cache(
            config,
            layout,
            self.runner.num_blocks,
            econf.max_model_len,
            self.runner.blocks_per_request,
            econf.tensor_parallel_size,
        )

    @property
    def dead_error(self) -> Exception | None:
        """Why the engine cannot run another step (a tensor-parallel rank died); None while it can."""
        return self.executor.dead_error

    def register_failure_callback(self, callback) -> None:
        """`callback()` is called from another thread once a tensor-parallel worker dies, even while no
        step runs (then `dead_error` is set)."""
        self.executor.register_failure_callback(callback)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (idempotent; also done when the engine is collected)."""
        self.executor.shutdown()

    def detokenize(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """A checked request (swiftkv_fast.inputs) into the waiting queue. `request_id` (default: a
        counter) must differ from every unfinished request's: the caller keeps them unique (AsyncLLM)."""
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        generator = None if params.greedy else torch.Generator().manual_seed(seed)
        if request_id is None:
            request_id = str(self._counter)
            self._counter += 1
        req = Request(
            request_id, prompt_token_ids, params, generator, prompt=prompt, arrival_time=arrival_time
        )
        self.scheduler.add_request(req)
        return req

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One scheduling step; returns the requests that finished in it.

        If it raises (any exception, or Ctrl-C anywhere in it), the requests it scheduled are
        aborted and the blocks it registered in the prefix cache are uncached first (their K/V may
        not be written): later requests only ever hit K/V that a completed step wrote. Requests it
        did not schedule are untouched. See docs/failure-model.md.

        Under tensor parallelism a Ctrl-C is held until the step's model run ends (every rank finishes
        the step; then it is raised and undoes the step as above). A rank that dies ends the engine:
        this and every later step raise WorkerDiedError (`dead_error`)."""
        if self.dead_error is not None:
            raise self.dead_error
        out = self.scheduler.schedule()
        if out.is_empty:
            raise RuntimeError(
                "no request could be scheduled: the KV cache is too small for the waiting request"
            )
        try:
            with deferred_interrupts() if self.econf.tensor_parallel_size > 1 else nullcontext():
                res = self.executor.execute(out)
            return self._process_output(out, res)
        except BaseException:
            # an exception or Ctrl-C in the model, the sampler or the output processing: the step's
            # requests are aborted and its unwritten blocks uncached (Scheduler.fail_step)
            failed = self.scheduler.fail_step(out)
            logger.debug("step failed: aborted %d request(s)", len(failed))
            raise

    def _process_output(self, out: SchedulerOutput, res: ModelRunnerOutput) -> list[Request]:
        now = time.time()
        by_id = {s.request.request_id: s.request for s in out.scheduled}
        for j, rid in enumerate(res.request_ids):
            req = by_id[rid]
            req.cumulative_logprob += res.logprobs[j]
            if req.logprobs is not None:
                req.logprobs.append(res.top_logprobs[j])
            if res.logits[j] is not None:
                req.logits.append(res.logits[j])
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.num_generated_tokens += 1
        finished = self.scheduler.update_from_output(out, dict(zip(res.request_ids, res.token_ids)))
        for req in finished:
            if not isinstance(req.stop_reason, str):
                req.output_text = self.detokenize(req.output_token_ids)
        return finished

    def get_stats(self) -> dict[str, object]:
        """Counters since the engine was built: ``cuda_graph_replays`` (second-half steps replayed from a
        CUDA graph), ``eager_second_half_steps`` (second-half steps run eagerly), ``cuda_graph_enabled``,
        ``cuda_graph_capture_s`` (None before capture), ``num_preemptions``; and ``kernel_plan``
        (`get_kernel_plan`)."""
        return {
            **self.runner.graphs.stats(),
            "num_preemptions": self.scheduler.num_preemptions,
            "kernel_plan": self.get_kernel_plan(),
        }

    def get_kernel_plan(self) -> dict[str, object]:
        """Which kernel serves each op (kernels/plan.py), chosen when the engine was built (rank 0's)."""
        return self.runner.plan.as_dict()

    def abort_request(self, request_id: str) -> Request | None:
        """Abort one unfinished request between steps and free its blocks; returns it, or None when no
        unfinished request has this id."""
        return self.scheduler.abort_request(request_id)

    def make_scheduler_stats(self) -> SchedulerStats:
        """Running / waiting requests and KV usage now; preemptions and prefix-cache lookups since the
        previous call (the one caller is AsyncLLM's stat logging)."""
        preemptions = self.scheduler.num_preemptions - self._reported_preemptions
        self._reported_preemptions = self.scheduler.num_preemptions
        return SchedulerStats(
            num_running_reqs=len(self.scheduler.running),
            num_waiting_reqs=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_manager.usage,
            num_preemptions=preemptions,
            prefix_cache_stats=self.kv_manager.make_prefix_cache_stats(),
        )

    def abort_all(self) -> list[Request]:
        """Abort every unfinished request (the caller's call failed); returns them."""
        return self.scheduler.abort_all()
