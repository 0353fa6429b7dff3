"""`LLM`: the offline API (vLLM's names).

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    llm = LLM("path/to/checkpoint", num_key_value_layers=15)
    llm = LLM.from_state_dict(config, state_dict) # in memory (tests, conformance)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs = llm.generate([[1, 2, 3]])              # token-id prompts need no tokenizer
    llm = LLM(tensor_parallel_size=2)             # the model split over 2 processes (2 GPUs on CUDA)

`LLM(..., return_logits=True)` keeps the fp32 logits row of every sampled token on
`outputs[0].logits` (num_tokens, vocab): the conformance suite compares them with the reference.

One call at a time: an `LLM` serves one `generate`/`chat` call at a time. A second call while one
runs (from another thread, or re-entered from inside one) raises RuntimeError at once and changes
nothing; use one `LLM` per thread.

Every prompt and parameter of a call is checked (swiftkv_fast.inputs) before any request is added:
a call with one bad request raises (naming the request and field) and adds nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from swiftkv_fast.config import EngineConfig
from swiftkv_fast.engine.llm_engine import LLMEngine
from swiftkv_fast.engine.request import Request
from swiftkv_fast.inputs import (
    PromptType,
    is_single_prompt,
    parse_conversations,
    parse_prompt,
    validate_request,
)
from swiftkv_fast.logger import init_logger
from swiftkv_fast.model.loader import (
    apply_swiftkv_options,
    chat_token_ids,
    checkpoint_dtype,
    load_checkpoint,
    load_tokenizer,
)
from swiftkv_fast.outputs import CompletionOutput, RequestOutput
from swiftkv_fast.sampling_params import SamplingParams, describe

logger = init_logger(__name__)


def _follow(econf: EngineConfig, stored: torch.dtype) -> None:
    """dtype="auto" resolved by the checkpoint's stored dtype (EngineConfig.follow_checkpoint)."""
    note = econf.follow_checkpoint(stored)
    if note:
        logger.info("%s", note)


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer=None, **kwargs):
        econf = EngineConfig(model=model, **kwargs)
        config, state_dict, model_dir = load_checkpoint(
            econf.model, econf.num_key_value_layers, econf.key_value_group_size
        )
        _follow(econf, checkpoint_dtype(model_dir))
        if tokenizer is None:
            tokenizer = _try_load_tokenizer(model_dir)
        self._start(econf, config, state_dict, tokenizer, str(model_dir))

    @classmethod
    def from_state_dict(cls, config, state_dict, tokenizer=None, **kwargs) -> LLM:
        """An engine over an in-memory (SwiftKVConfig, state_dict); the state dict is not modified."""
        econf = EngineConfig(**kwargs)
        _follow(econf, checkpoint_dtype(state_dict))
        config, state_dict = apply_swiftkv_options(
            config, state_dict, econf.num_key_value_layers, econf.key_value_group_size
        )
        self = cls.__new__(cls)
        self._start(econf, config, state_dict, tokenizer)
        return self

    def _start(self, econf: EngineConfig, config, state_dict, tokenizer, checkpoint_dir=None) -> None:
        self.llm_engine = LLMEngine(econf, config, state_dict, tokenizer, checkpoint_dir)
        self._busy = threading.Lock()  # held by the one generate/chat call in progress

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def config(self):
        return self.llm_engine.config

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes now (also done when the LLM is collected or the
        interpreter exits). The LLM cannot generate afterwards."""
        self.llm_engine.shutdown()

    def get_stats(self) -> dict[str, object]:
        """Engine counters: ``cuda_graph_replays``, ``eager_second_half_steps``, ``cuda_graph_enabled``,
        ``cuda_graph_capture_s``, ``num_preemptions``, and the ``kernel_plan`` (see LLMEngine.get_stats)."""
        return self.llm_engine.get_stats()

    def get_kernel_plan(self) -> dict[str, object]:
        """Which implementation serves each op on this engine, chosen once when it was built (the table
        the engine logs at start-up): {"device", "dtype", "kv_cache_dtype", "isa", "disabled_kernels",
        "ops": {op: {"implementation", "note"}}}."""
        return self.llm_engine.get_kernel_plan()

    # ---- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in input order. Every prompt and parameter is checked before any work starts."""
        with self._one_call():
            return self._generate(prompts, sampling_params, use_tqdm)

    def chat(
        self,
        messages: str | list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template.
        A str is one conversation of one user message. Request i is conversation i."""
        with self._one_call():
            if self.tokenizer is None:
                raise ValueError("chat needs a tokenizer")
            prompts = []
            for i, conv in enumerate(parse_conversations(messages)):
                try:
                    prompts.append({"prompt_token_ids": chat_token_ids(self.tokenizer, conv)})
                except Exception as e:  # the template's own checks (roles, order): name the conversation
                    raise ValueError(f"conversation {i}: applying the chat template failed: {e}") from e
            return self._generate(prompts, sampling_params, use_tqdm)

    @contextmanager
    def _one_call(self) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                "this LLM is already running a generate/chat call (in another thread, or re-entered "
                "from inside one): an LLM serves one call at a time; use one LLM per thread"
            )
        try:
            yield
        finally:
            self._busy.release()

    def _generate(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        inputs = self._check_inputs(prompts, sampling_params)
        reqs: list[Request] = []
        try:
            for text, ids, params in inputs:
                reqs.append(self.llm_engine.add_request(ids, params, prompt=text))
        except BaseException:  # (a Ctrl-C) the call adds nothing
            self.llm_engine.abort_all()
            raise
        self._run(reqs, use_tqdm)
        return [_to_output(r) for r in reqs]

    def _check_inputs(self, prompts, sampling_params) -> list[tuple[str | None, list[int], SamplingParams]]:
        """Every request of the call, parsed and validated: -> [(text, token ids, params)]."""
        prompts = [prompts] if is_single_prompt(prompts) else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            sampling_params = list(sampling_params)
        else:
            raise TypeError(
                "sampling_params must be a SamplingParams, a list of them (one per prompt) or None, got "
                f"{describe(sampling_params)}"
            )
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling_params")
        vocab, max_len = self.config.vocab_size, self.llm_engine.econf.max_model_len
        inputs = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            text, ids = parse_prompt(i, prompt, self.tokenizer)
            validate_request(i, ids, params, vocab, max_len, self.tokenizer is not None)
            inputs.append((text, ids, params))
        return inputs

    def _run(self, reqs: list[Request], use_tqdm: bool) -> None:
        engine = self.llm_engine
        bar = tqdm(total=len(reqs), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, n_in, n_out = time.perf_counter(), 0, 0
        try:
            while engine.has_unfinished_requests():
                for req in engine.step():
                    n_in += req.num_prompt_tokens
                    n_out += req.num_output_tokens
                    bar.update(1)
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(
                    f"est. speed input: {n_in / elapsed:.1f} toks/s, output: {n_out / elapsed:.1f} toks/s"
                )
        except BaseException:
            engine.abort_all()  # the engine stays usable for the next call
            raise
        finally:
            bar.close()


def _to_output(req: Request) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text=req.output_text,
        token_ids=list(req.output_token_ids),
        cumulative_logprob=req.cumulative_logprob,
        logprobs=req.logprobs,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        logits=torch.stack(req.logits) if req.logits else None,
    )
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=list(req.prompt_token_ids),
        outputs=[completion],
        finished=req.is_finished,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        metrics=req.metrics,
    )


def _try_load_tokenizer(model_dir):
    try:
        return load_tokenizer(model_dir)
    except Exception as e:  # a checkpoint without tokenizer files still serves token-id prompts
        logger.warning("no tokenizer loaded from %s (%s): token-id prompts only", model_dir, e)
        return None
