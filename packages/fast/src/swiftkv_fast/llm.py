"""`LLM`: the offline API (vLLM's names).

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    llm = LLM("path/to/checkpoint", num_key_value_layers=15)
    llm = LLM.from_state_dict(config, state_dict) # in memory (tests, conformance)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs = llm.generate([[1, 2, 3]])              # token-id prompts need no tokenizer

`LLM(..., return_logits=True)` keeps the fp32 logits row of every sampled token on
`outputs[0].logits` (num_tokens, vocab): the conformance suite compares them with the reference.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from swiftkv_fast.config import EngineConfig
from swiftkv_fast.engine.llm_engine import LLMEngine
from swiftkv_fast.engine.request import Request
from swiftkv_fast.logger import init_logger
from swiftkv_fast.model.loader import apply_swiftkv_options, load_checkpoint
from swiftkv_fast.outputs import CompletionOutput, RequestOutput
from swiftkv_fast.sampling_params import SamplingParams

logger = init_logger(__name__)

PromptType = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer=None, **kwargs):
        econf = EngineConfig(model=model, **kwargs)
        config, state_dict, model_dir = load_checkpoint(
            econf.model, econf.num_key_value_layers, econf.key_value_group_size
        )
        if tokenizer is None:
            tokenizer = _try_load_tokenizer(model_dir)
        self.llm_engine = LLMEngine(econf, config, state_dict, tokenizer)

    @classmethod
    def from_state_dict(cls, config, state_dict, tokenizer=None, **kwargs) -> LLM:
        """An engine over an in-memory (SwiftKVConfig, state_dict); the state dict is not modified."""
        econf = EngineConfig(**kwargs)
        config, state_dict = apply_swiftkv_options(
            config, state_dict, econf.num_key_value_layers, econf.key_value_group_size
        )
        self = cls.__new__(cls)
        self.llm_engine = LLMEngine(econf, config, state_dict, tokenizer)
        return self

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def config(self):
        return self.llm_engine.config

    def get_stats(self) -> dict[str, int | float | bool | None]:
        """Engine counters: ``cuda_graph_replays``, ``eager_second_half_steps``, ``cuda_graph_enabled``,
        ``cuda_graph_capture_s``, ``num_preemptions`` (see LLMEngine.get_stats)."""
        return self.llm_engine.get_stats()

    # ---- prompts -------------------------------------------------------------------------------

    def _to_token_ids(self, i: int, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"request {i}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"request {i}: prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"request {i}: a text prompt needs a tokenizer; pass token ids instead")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"request {i}: prompt_token_ids must be ints")
        return None, ids

    def _validate(self, i: int, ids: list[int], params: SamplingParams) -> None:
        vocab, max_len = self.config.vocab_size, self.llm_engine.econf.max_model_len
        if not ids:
            raise ValueError(f"request {i}: prompt is empty (0 tokens)")
        if len(ids) > max_len:
            raise ValueError(f"request {i}: prompt has {len(ids)} tokens, more than max_model_len={max_len}")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"request {i}: prompt_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"request {i}: sampling_params must be SamplingParams, got {type(params).__name__}"
            )
        try:
            params.validate()
        except ValueError as e:
            raise ValueError(f"request {i}: sampling_params.{e}") from None
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {i}: sampling_params.stop_token_ids {bad} are outside the vocabulary")

    # ---- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in input order. Every prompt and parameter is checked before any work starts."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling_params")
        inputs = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            text, ids = self._to_token_ids(i, prompt)
            self._validate(i, ids, params)
            inputs.append((text, ids, params))
        reqs = [self.llm_engine.add_request(ids, params, prompt=text) for text, ids, params in inputs]
        self._run(reqs, use_tqdm)
        return [_to_output(r) for r in reqs]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        from swiftkv_reference.tokenizer import chat_token_ids

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": chat_token_ids(self.tokenizer, conv)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

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
    from swiftkv_reference.tokenizer import load_tokenizer

    try:
        return load_tokenizer(model_dir)
    except Exception as e:  # a checkpoint without tokenizer files still serves token-id prompts
        logger.warning("no tokenizer loaded from %s (%s): token-id prompts only", model_dir, e)
        return None
