"""`swiftkv_fast` adapters: one small class per attention backend / execution mode.

fast-torch      attention_backend="torch", eager (the portable backend; CPU or CUDA)
fast-triton     attention_backend="triton", eager (CUDA, or CPU under TRITON_INTERPRET=1)
fast-flash      attention_backend="flash_attn", eager (CUDA + flash-attn; block size % 256 == 0)
fast-cudagraph  attention_backend="triton" with the second half replayed from CUDA graphs (CUDA);
                every generate() call must replay at least one graph (LLM.get_stats()["cuda_graph_replays"])
fast-tp2        attention_backend="torch", tensor_parallel_size=2: rank 0 here and one worker process
                (gloo on CPU; on CUDA two devices and NCCL, else skipped)
fast-cpu-stack  attention_backend="torch" on CPU with every linear through the panel GEMM
                (linear_kernel="panel"), so that decode rows run each half's layers as one C call
                (model/decode_stack.py) whatever the kernel timings of the machine say
fast-cpu-bf16x3 attention_backend="torch" on CPU at matmul_precision="high" with every linear through
                the AMX bf16x3 kernel (linear_kernel="bf16x3"; CPUs with AMX-BF16), held to the fp32
                tolerances like the others
fast-cpu-kv-bf16 attention_backend="torch" on CPU over a bf16 KV cache (kv_cache_dtype="bfloat16"):
                K/V rounded to bf16, so held to vLLM's low-precision rule, not the fp32 one
fast-cpu-4bit   fast-cpu-stack on weights that are a dequantized 4-bit checkpoint's (`weights`
                "four-bit", the reference's too): the panel GEMM keeps them as 4-bit panels
fast-cpu-bf16   fast-cpu-stack on the tiny models' weights rounded to bf16 (`weights` "bf16"): the panel
                GEMM keeps them as bf16 panels, in the decode stack and alone
fast-cpu-q4-amx attention_backend="torch" on CPU with every 4-bit linear through the AMX kernel for them
                (linear_kernel="q4-amx"; CPUs with AMX-BF16), at "highest", held to the fp32 rule
fast-cpu-bf16-amx weights exact in bf16 (a bf16 checkpoint loaded as fp32) through the AMX kernel with
                exact products for them (linear_kernel="bf16-amx"), at "highest", held to the fp32 rule
fast-cpu-panel-amx the 4-bit panels multiplied on AMX tiles (linear_kernel="panel-amx"), the decode stack
                included, on four-bit weights, at "highest", held to the fp32 rule
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from swiftkv_fast import LLM, RequestOutput

DEFAULT_POOL_TOKENS = 4096  # per cache group, when a case does not size the pool itself


def _cuda() -> bool:
    return torch.cuda.is_available()


def convert_output(out: RequestOutput, sampling: Sampling) -> Output:
    comp = out.outputs[0]
    token_ids = list(comp.token_ids)
    logits = None
    if comp.logits is not None:
        logits = comp.logits.detach().float().cpu().reshape(len(token_ids), -1)
    # one {chosen token, top-n tokens: logprob} per position (SamplingParams.logprobs)
    top = comp.logprobs or None
    chosen = [top[i].get(t, float("nan")) for i, t in enumerate(token_ids)] if top else []
    if (top is None or any(len(t) < sampling.top_n for t in top)) and logits is not None:
        top = top_logprobs_from_logits(logits, sampling.top_n)
    return Output(
        token_ids=token_ids,
        logprobs=chosen,
        top_logprobs=top,
        logits=logits,
        num_cached_tokens=out.num_cached_tokens,
        text=comp.text,
        finish_reason=comp.finish_reason,
    )


class _FastRunner(Runner):
    def __init__(self, llm: LLM, expect_graph_replays: bool = False):
        self.llm = llm
        self.expect_graph_replays = expect_graph_replays

    def generate(self, prompts: list[list[int]], sampling: list[Sampling]) -> list[Output]:
        from swiftkv_fast import SamplingParams

        params = [
            SamplingParams(
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                seed=s.seed,
                ignore_eos=s.ignore_eos,
                logprobs=s.logprobs,
                min_tokens=s.min_tokens,
                stop=list(s.stop),
            )
            for s in sampling
        ]
        before = self.llm.get_stats()
        outs = self.llm.generate([list(p) for p in prompts], params, use_tqdm=False)
        if self.expect_graph_replays:
            self._check_graph_replays(before, self.llm.get_stats())
        return [convert_output(o, s) for o, s in zip(outs, sampling)]

    @staticmethod
    def _check_graph_replays(before: dict[str, Any], after: dict[str, Any]) -> None:
        """Every step samples at most max_num_seqs tokens (the largest bucket) with block tables no
        wider than captured, so a generate() call with graphs on replays at least one graph."""
        replays = after["cuda_graph_replays"] - before["cuda_graph_replays"]
        eager = after["eager_second_half_steps"] - before["eager_second_half_steps"]
        assert after["cuda_graph_enabled"], "fast-cudagraph: CUDA graphs are disabled in the engine"
        assert replays > 0, (
            f"fast-cudagraph: no second-half CUDA graph replayed in this generate() call "
            f"({eager} eager second-half steps)"
        )

    def counters(self) -> dict[str, int]:
        stats = self.llm.get_stats()
        return {
            name: int(stats[name])
            for name in ("num_preemptions", "cuda_graph_replays", "eager_second_half_steps")
        }

    def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()  # tensor-parallel workers stop now, not when the LLM is collected
        self.llm = None
        if _cuda():
            torch.cuda.empty_cache()


class Fast(Implementation):
    """The engine with one attention backend. Subclasses set the knobs below."""

    backend: str = "torch"
    enforce_eager: bool = True
    expect_graph_replays: bool = False  # assert that each generate() replayed a second-half CUDA graph
    tensor_parallel_size: int = 1

    @classmethod
    def _base_available(cls) -> tuple[bool, str]:
        try:
            import swiftkv_fast  # noqa: F401
        except ImportError as exc:
            return False, f"swiftkv_fast not importable: {exc}"
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
            "tensor_parallel_size": self.tensor_parallel_size,
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

        kwargs = self.engine_kwargs(engine)
        kwargs["return_logits"] = True  # fp32 logits rows at the sampled positions
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


class FastTP2(Fast):
    """Tensor parallelism over two ranks: on CPU with gloo, on CUDA with two devices and NCCL."""

    name = "fast-tp2"
    backend = "torch"
    tensor_parallel_size = 2
    gpu = True  # also part of `--impl gpu` (nox -s gpu), where it needs two devices

    @classmethod
    def available(cls) -> tuple[bool, str]:
        if _cuda() and torch.cuda.device_count() < 2:
            return (
                False,
                f"tensor parallelism on CUDA needs 2 devices, this machine has {torch.cuda.device_count()}",
            )
        return cls._base_available()

    @classmethod
    def version(cls) -> str:
        return f"{super().version()} (torch.distributed {'nccl' if _cuda() else 'gloo'})"


class FastCpuStack(Fast):
    """The CPU path whose decode rows run the decode stack (model/decode_stack.py): it serves only where
    the panel GEMM runs every linear, so this forces that kernel instead of timing the candidates."""

    name = "fast-cpu-stack"
    backend = "torch"

    @classmethod
    def available(cls) -> tuple[bool, str]:
        import shutil

        if shutil.which(os.environ.get("CC", "cc")) is None:
            return False, "no C compiler: the panel GEMM and the decode stack are compiled kernels"
        return cls._base_available()

    @classmethod
    def device(cls) -> str:
        return "cpu"

    def engine_kwargs(self, engine: EngineOptions) -> dict[str, Any]:
        return {**super().engine_kwargs(engine), "linear_kernel": "panel"}


class _FastCpuAmx(Fast):
    """A CPU path through one of the AMX kernels: where the CPU, the compiler and Linux allow them."""

    backend = "torch"

    @classmethod
    def available(cls) -> tuple[bool, str]:
        from swiftkv_fast.kernels import cpu_amx

        reason = cpu_amx.unavailable_reason()
        if reason is not None:
            return False, f"the AMX kernels cannot run here ({reason})"
        return cls._base_available()

    @classmethod
    def device(cls) -> str:
        return "cpu"


class FastCpuBf16x3(_FastCpuAmx):
    """The CPU path at PyTorch's "high" float32 matmul precision: every linear through the AMX bf16x3
    kernel (kernels/cpu_amx.py), forced rather than timed, so that it runs every case here. It is held
    to the fp32 tolerances (about 16 of fp32's 24 significant bits per operand, fp32 sums)."""

    name = "fast-cpu-bf16x3"

    def engine_kwargs(self, engine: EngineOptions) -> dict[str, Any]:
        return {**super().engine_kwargs(engine), "linear_kernel": "bf16x3", "matmul_precision": "high"}


class FastCpuKvBf16(Fast):
    """The CPU path over a bf16 KV cache (kv_cache_dtype="bfloat16"): K and V are rounded to bf16 when
    written and read back as fp32, so the logits move by about 1e-2 (tests/test_kv_cache_dtype.py) and
    the case is judged by vLLM's low-precision rule (`exact` is False), as vLLM judges its own
    quantized KV caches."""

    name = "fast-cpu-kv-bf16"
    backend = "torch"
    lossy_kv_cache = True

    @classmethod
    def device(cls) -> str:
        return "cpu"

    def engine_kwargs(self, engine: EngineOptions) -> dict[str, Any]:
        return {**super().engine_kwargs(engine), "kv_cache_dtype": "bfloat16"}

    def describe(self) -> str:
        return f"{super().describe()} kv_cache_dtype=bfloat16"


class FastCpu4Bit(FastCpuStack):
    """fast-cpu-stack on four-bit weights: every linear weight is exactly 4-bit blocks, so the panel GEMM
    reads 4-bit panels (kernels/weight_forms.py), in the decode stack and alone."""

    name = "fast-cpu-4bit"
    weights = "four-bit"


class FastCpuBf16(FastCpuStack):
    """fast-cpu-stack on bf16 weights (a bf16 checkpoint loaded as fp32): every value is exact in bf16, so
    the panel GEMM reads bf16 panels (half the fp32 panels' bytes), in the decode stack and alone."""

    name = "fast-cpu-bf16"
    weights = "bf16"


class FastCpuQ4Amx(_FastCpuAmx):
    """The CPU path with every 4-bit linear through the AMX kernel for 4-bit blocks (kernels/cpu_amx_q4.py),
    forced rather than timed, on four-bit weights, at "highest": its products are exact and its sums
    fp32, so it is held to the fp32 rule."""

    name = "fast-cpu-q4-amx"
    weights = "four-bit"

    def engine_kwargs(self, engine: EngineOptions) -> dict[str, Any]:
        return {**super().engine_kwargs(engine), "linear_kernel": "q4-amx"}


class FastCpuPanelAmx(FastCpuQ4Amx):
    """The 4-bit panels multiplied on AMX tiles (kernels/cpu_gemm.py, PANEL_Q4_AMX) for every 4-bit
    linear, forced, so that the decode stack runs them too; four-bit weights, "highest"."""

    name = "fast-cpu-panel-amx"

    @classmethod
    def available(cls) -> tuple[bool, str]:
        from swiftkv_fast.kernels import cpu_gemm
        from swiftkv_reference.testing import q4_1_dequantized

        try:
            cpu_gemm.PanelWeight(q4_1_dequantized(torch.randn(16, 32)), amx=True)
        except RuntimeError as e:
            return False, str(e)
        return cls._base_available()

    def engine_kwargs(self, engine: EngineOptions) -> dict[str, Any]:
        return {**super().engine_kwargs(engine), "linear_kernel": "panel-amx"}


class FastCpuBf16Amx(_FastCpuAmx):
    """Every linear through the AMX kernel for weights exact in bf16 (kernels/cpu_amx.py, `exact`),
    forced, on the tiny models' weights rounded to bf16, at "highest": exact products, fp32 sums."""

    name = "fast-cpu-bf16-amx"
    weights = "bf16"

    def engine_kwargs(self, engine: EngineOptions) -> dict[str, Any]:
        return {**super().engine_kwargs(engine), "linear_kernel": "bf16-amx"}
