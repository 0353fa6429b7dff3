"""`swiftkv_fast` adapters: one small class per attention backend / execution mode.

fast-torch      attention_backend="torch", eager (the portable backend; CPU or CUDA)
fast-triton     attention_backend="triton", eager (CUDA, or CPU under TRITON_INTERPRET=1)
fast-flash      attention_backend="flash_attn", eager (CUDA + flash-attn; block size % 256 == 0)
fast-cudagraph  attention_backend="triton" with the second half replayed from CUDA graphs (CUDA);
                every generate() call must replay at least one graph (LLM.get_stats()["cuda_graph_replays"])
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import inspect
import os
from typing import Any

import torch

from .base import (
    CharTokenizer,
    EngineOptions,
    Implementation,
    Output,
    Runner,
    Sampling,
    dataclass_kwargs,
    top_logprobs_from_logits,
)

DEFAULT_POOL_TOKENS = 4096  # per cache group, when a case does not size the pool itself


def _cuda() -> bool:
    return torch.cuda.is_available()


def _logprob_value(x: Any) -> float:
    return float(getattr(x, "logprob", x))


def _to_top(entry: Any) -> dict[int, float] | None:
    if entry is None:
        return None
    if isinstance(entry, dict):
        return {int(k): _logprob_value(v) for k, v in entry.items()}
    return None


def _completion(out: Any) -> Any:
    """vLLM's RequestOutput has `.outputs[0]`; a flat output is its own completion."""
    outputs = getattr(out, "outputs", None)
    return outputs[0] if outputs else out


def _logits_of(out: Any, comp: Any) -> torch.Tensor | None:
    for obj in (comp, out):
        logits = getattr(obj, "logits", None)
        if logits is not None:
            if isinstance(logits, (list, tuple)):
                logits = torch.stack([torch.as_tensor(r) for r in logits])
            return logits.detach().float().cpu()
    return None


def convert_output(out: Any, sampling: Sampling) -> Output:
    comp = _completion(out)
    token_ids = [int(t) for t in comp.token_ids]
    logits = _logits_of(out, comp)
    if logits is not None:
        logits = logits.reshape(len(token_ids), -1)
    chosen: list[float] = []
    top: list[dict[int, float]] | None = None
    raw = getattr(comp, "logprobs", None)
    if raw:
        if all(isinstance(e, dict) for e in raw):  # vLLM: one {token: Logprob} per position
            top = [_to_top(e) for e in raw]
            chosen = [top[i].get(t, float("nan")) for i, t in enumerate(token_ids)]
        else:  # log-prob of each chosen token
            chosen = [_logprob_value(x) for x in raw]
    top_lp = getattr(comp, "top_logprobs", None)
    if top_lp and all(isinstance(e, dict) for e in top_lp):
        top = [_to_top(e) for e in top_lp]
    if (top is None or any(len(t) < sampling.logprobs for t in top)) and logits is not None:
        top = top_logprobs_from_logits(logits, sampling.logprobs)
    cached = getattr(out, "num_cached_tokens", None)
    return Output(
        token_ids=token_ids,
        logprobs=chosen,
        top_logprobs=top,
        logits=logits,
        num_cached_tokens=None if cached is None else int(cached),
        text=getattr(comp, "text", None),
        finish_reason=getattr(comp, "finish_reason", None),
    )


def _stats(llm: Any) -> dict[str, Any]:
    get_stats = getattr(llm, "get_stats", None)
    return dict(get_stats()) if callable(get_stats) else {}


class _FastRunner(Runner):
    def __init__(self, llm: Any, expect_graph_replays: bool = False):
        self.llm = llm
        self.expect_graph_replays = expect_graph_replays

    def generate(self, prompts: list[list[int]], sampling: list[Sampling]) -> list[Output]:
        from swiftkv_fast import SamplingParams

        params = []
        for s in sampling:
            kwargs = dataclass_kwargs(
                SamplingParams,
                {
                    "max_tokens": s.max_tokens,
                    "temperature": s.temperature,
                    "top_p": s.top_p,
                    "top_k": s.top_k,
                    "seed": s.seed,
                    "ignore_eos": s.ignore_eos,
                    "logprobs": s.logprobs,
                    "min_tokens": s.min_tokens,
                    "stop": list(s.stop),
                    "return_logits": True,
                },
            )
            if s.min_tokens and "min_tokens" not in kwargs or s.stop and "stop" not in kwargs:
                raise TypeError(f"swiftkv_fast SamplingParams cannot take {s} (no min_tokens or stop)")
            params.append(SamplingParams(**kwargs))
        gen = self.llm.generate
        kwargs: dict[str, Any] = {}
        sig = inspect.signature(gen).parameters
        if "use_tqdm" in sig:
            kwargs["use_tqdm"] = False
        if "return_logits" in sig:
            kwargs["return_logits"] = True
        before = _stats(self.llm)
        outs = gen([list(p) for p in prompts], params, **kwargs)
        if self.expect_graph_replays:
            self._check_graph_replays(before, _stats(self.llm))
        return [convert_output(o, s) for o, s in zip(outs, sampling)]

    @staticmethod
    def _check_graph_replays(before: dict[str, Any], after: dict[str, Any]) -> None:
        """Every step samples at most max_num_seqs tokens (the largest bucket) with block tables no
        wider than captured, so a generate() call with graphs on replays at least one graph."""
        if "cuda_graph_replays" not in after:
            raise AssertionError("fast-cudagraph: LLM.get_stats() has no 'cuda_graph_replays' counter")
        replays = after["cuda_graph_replays"] - before.get("cuda_graph_replays", 0)
        eager = after.get("eager_second_half_steps", 0) - before.get("eager_second_half_steps", 0)
        assert after.get("cuda_graph_enabled", True), "fast-cudagraph: CUDA graphs are disabled in the engine"
        assert replays > 0, (
            f"fast-cudagraph: no second-half CUDA graph replayed in this generate() call "
            f"({eager} eager second-half steps)"
        )

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        scheduler = getattr(getattr(self.llm, "llm_engine", None), "scheduler", None)
        value = getattr(scheduler, "num_preemptions", None)
        if value is not None:
            out["num_preemptions"] = int(value)
        for name in ("cuda_graph_replays", "eager_second_half_steps"):
            stat = _stats(self.llm).get(name)
            if stat is not None:
                out[name] = int(stat)
        return out

    def close(self) -> None:
        for name in ("shutdown", "close"):
            fn = getattr(self.llm, name, None)
            if callable(fn):
                fn()
                break
        self.llm = None
        if _cuda():
            torch.cuda.empty_cache()


class Fast(Implementation):
    """The engine with one attention backend. Subclasses set the knobs below."""

    backend: str = "torch"
    enforce_eager: bool = True
    expect_graph_replays: bool = False  # assert that each generate() replayed a second-half CUDA graph

    @classmethod
    def _base_available(cls) -> tuple[bool, str]:
        try:
            import swiftkv_fast
        except ImportError as exc:
            return False, f"swiftkv_fast not importable: {exc}"
        if not hasattr(swiftkv_fast, "LLM") or not hasattr(swiftkv_fast.LLM, "from_state_dict"):
            return (
                False,
                "swiftkv_fast.LLM.from_state_dict is missing (the adapter builds engines from weights)",
            )
        return True, ""

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return cls._base_available()

    @classmethod
    def version(cls) -> str:
        try:
            return importlib.metadata.version("swiftkv-fast")
        except importlib.metadata.PackageNotFoundError:
            return "?"

    @classmethod
    def device(cls) -> str:
        return "cuda" if _cuda() else "cpu"

    def engine_kwargs(self, engine: EngineOptions) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "block_size": engine.block_size,
            "enable_prefix_caching": engine.enable_prefix_caching,
            "attention_backend": self.backend,
            "enforce_eager": self.enforce_eager,
            "dtype": self.dtype,
            "device": self.device(),
        }
        for name in ("max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "max_model_len"):
            value = getattr(engine, name)
            if value is not None:
                kwargs[name] = value
        # tiny models, short prompts: a small pool instead of the engine's memory-sized default
        kwargs.setdefault("num_kv_blocks", DEFAULT_POOL_TOKENS // engine.block_size + 2)
        return kwargs

    def build(self, config: Any, state_dict: dict[str, torch.Tensor], engine: EngineOptions) -> Runner:
        from swiftkv_fast import LLM
        from swiftkv_fast.config import EngineConfig

        kwargs = self.engine_kwargs(engine)
        kwargs["return_logits"] = True  # fp32 logits rows at the sampled positions
        # fail loudly (not silently drop a knob) if the engine does not know an option
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise TypeError(f"swiftkv_fast EngineConfig has no {unknown}")
        llm = LLM.from_state_dict(config, state_dict, tokenizer=CharTokenizer.for_config(config), **kwargs)
        return _FastRunner(llm, expect_graph_replays=self.expect_graph_replays)


class FastTorch(Fast):
    name = "fast-torch"
    backend = "torch"


class FastTriton(Fast):
    name = "fast-triton"
    backend = "triton"
    gpu = True

    @classmethod
    def available(cls) -> tuple[bool, str]:
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed"
        if not _cuda() and os.environ.get("TRITON_INTERPRET") != "1":
            return False, "no CUDA and TRITON_INTERPRET is not 1 (the suite sets it when no CUDA is present)"
        return cls._base_available()

    @classmethod
    def version(cls) -> str:
        try:
            triton = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            triton = "?"
        return f"{super().version()} (triton {triton})"

    @property
    def interpreted(self) -> bool:  # type: ignore[override]
        return not _cuda()

    @classmethod
    def device(cls) -> str:
        return "cuda" if _cuda() else "cpu (TRITON_INTERPRET=1)"

    def engine_kwargs(self, engine: EngineOptions) -> dict[str, Any]:
        kwargs = super().engine_kwargs(engine)
        kwargs["device"] = "cuda" if _cuda() else "cpu"
        return kwargs


class _CudaOnly(Fast):
    """An implementation that runs only on CUDA with the packages in `requires` installed."""

    gpu = True
    cuda_reason = "needs CUDA"
    requires: tuple[str, ...] = ()

    @classmethod
    def device(cls) -> str:
        return "cuda" if _cuda() else "cuda (absent)"

    @classmethod
    def available(cls) -> tuple[bool, str]:
        if not _cuda():
            return False, f"{cls.cuda_reason}; no CUDA device here"
        for module in cls.requires:
            if importlib.util.find_spec(module) is None:
                return False, f"{module} is not installed"
        return cls._base_available()


class FastFlash(_CudaOnly):
    name = "fast-flash"
    backend = "flash_attn"
    cuda_reason = "flash-attn needs CUDA"
    requires = ("flash_attn",)

    @classmethod
    def version(cls) -> str:
        try:
            fa = importlib.metadata.version("flash-attn")
        except importlib.metadata.PackageNotFoundError:
            fa = "?"
        return f"{super().version()} (flash-attn {fa})"

    def default_engine(self) -> EngineOptions:
        return EngineOptions(block_size=256)

    def unsupported(self, engine: EngineOptions) -> str | None:
        if engine.block_size % 256:
            return f"flash-attn's paged mode needs block_size % 256 == 0 (got {engine.block_size})"
        return None


class FastCudaGraph(_CudaOnly):
    name = "fast-cudagraph"
    backend = "triton"
    enforce_eager = False
    expect_graph_replays = True
    cuda_reason = "CUDA graphs need CUDA"
    requires = ("triton",)
