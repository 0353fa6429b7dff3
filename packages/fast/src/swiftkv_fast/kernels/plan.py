"""One engine's kernel plan: which implementation serves each op, decided once when the engine is built.

The model, the attention backend and the sampler hold what the plan resolved (a built C kernel, or
None for the portable torch path) and never ask per call whether a kernel applies. The worker fills
in what it measures on the built model (each linear's kernels, the decode stacks, the weight forms);
the plan is logged once as a table and returned by `LLM.get_kernel_plan()` and the server's `/version`:

    op                      implementation                        note
    row ops                 C (csrc/row_ops.c)                    RMSNorm + residual, SiLU-and-mul, ...
    decode attention        C (csrc/decode_attention.c)           head_dim 64, 3 query heads per KV head
    prefill attention       torch SDPA                            prefill in disabled_kernels
    linear o (576x576)      panel <= 256, matmul above            +0.6 MiB
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from swiftkv_fast import envs
from swiftkv_fast.kernels import build, cpu_decode, cpu_decode_stack, cpu_ops, cpu_prefill, cpu_sample
from swiftkv_fast.kernels.linear_kernels import cpuinfo_field


@dataclass(frozen=True)
class PlanEntry:
    op: str
    implementation: str
    note: str = ""


@dataclass
class KernelPlan:
    """What runs where for one engine (see the module docstring). The C handles are None where the
    portable torch path runs."""

    device: str
    dtype: torch.dtype  # the weights'
    kv_dtype: torch.dtype
    disabled: frozenset[str]
    isa: str | None  # the instruction set the C kernels are built for; None off CPU
    compute_dtype: torch.dtype | None = None  # the activations' (EngineConfig.compute_dtype); None: dtype
    row_ops: SimpleNamespace | None = None  # csrc/row_ops.c: norms, SiLU-and-mul, RoPE, KV writes
    sampler_ops: SimpleNamespace | None = None  # the same library for the greedy argmax of host fp32 logits
    decode_attention: Callable | None = None  # csrc/decode_attention.c for the model's heads and cache
    prefill_attention: Callable | None = None  # csrc/prefill_attention.c, likewise
    sample: cpu_sample.SampleKernels | None = None  # csrc/sample.c: the seeded race and top-k
    decode_stack: Callable | None = None  # csrc/decode_stack.c: a half's decode layers in one call
    entries: list[PlanEntry] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.compute_dtype = self.compute_dtype or self.dtype

    def add(self, op: str, implementation: str, note: str = "") -> None:
        self.entries = [e for e in self.entries if e.op != op] + [PlanEntry(op, implementation, note)]

    def table(self) -> str:
        """The plan as aligned text, one op per line (what the engine logs at start-up)."""
        head = PlanEntry("op", "implementation", "note")
        rows = [head, *self.entries]
        w_op = max(len(e.op) for e in rows)
        w_impl = max(len(e.implementation) for e in rows)
        lines = [f"{e.op:<{w_op}}  {e.implementation:<{w_impl}}  {e.note}".rstrip() for e in rows]
        widened = f" (multiplied in {_name(self.compute_dtype)})" if self.compute_dtype != self.dtype else ""
        dtypes = f"{_name(self.dtype)} weights{widened}, {_name(self.kv_dtype)} KV cache"
        isa = f", C kernels for {self.isa}" if self.isa else ""
        off = f", disabled: {','.join(sorted(self.disabled))}" if self.disabled else ""
        return "\n".join([f"kernel plan ({self.device}, {dtypes}{isa}{off}):", *lines])

    def as_dict(self) -> dict[str, object]:
        return {
            "device": self.device,
            "dtype": _name(self.dtype),
            "compute_dtype": _name(self.compute_dtype),
            "kv_cache_dtype": _name(self.kv_dtype),
            "isa": self.isa,
            "disabled_kernels": sorted(self.disabled),
            "ops": {e.op: {"implementation": e.implementation, "note": e.note} for e in self.entries},
        }


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_kernels(
    device: str | torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    disabled: frozenset[str],
    tensor_parallel_size: int = 1,
    compute_dtype: torch.dtype | None = None,
) -> KernelPlan:
    """The plan's fixed part: which C kernels serve this model's heads, dtypes and cache on `device`.
    `compute_dtype`: the activations' (EngineConfig.compute_dtype), None: `dtype`. Builds (or loads from
    the on-disk cache) every kernel it picks."""
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    isa = isa_label() if on_cpu else None
    plan = KernelPlan(str(device), dtype, kv_dtype, frozenset(disabled), isa, compute_dtype)
    with envs.kernels_disabled(plan.disabled):
        if on_cpu and dtype in (torch.bfloat16, torch.float16) and not cpu_bf16_units():
            widened = plan.compute_dtype == torch.float32
            plan.add(
                "bf16 units",
                "none on this CPU",
                "bf16 weights widened exactly, fp32 arithmetic (the libraries emulate bf16 products)"
                if widened
                else "bf16 products are emulated by the libraries: float32 is usually faster here",
            )
        fp32 = on_cpu and plan.compute_dtype == torch.float32
        why_not = _why_not(on_cpu, fp32)

        ops = why_not("ops") or _built(lib := cpu_ops.load())
        plan.row_ops = None if ops else lib
        plan.add(
            "row ops",
            "C (csrc/row_ops.c)" if ops is None else "torch",
            ops or "RMSNorm + residual, SiLU-and-mul, RoPE, KV writes",
        )

        group = num_heads // num_kv_heads
        shape = cpu_decode.supports_shape(head_dim, group) and build.kv_bf16(kv_dtype) is not None
        heads = f"head_dim {head_dim}, {group} query heads per KV head, {_name(kv_dtype)} cache"
        unfit = None if shape else f"no build for {heads}"
        decode = why_not("decode") or unfit or _built(fn := cpu_decode.kernel(head_dim, group, kv_dtype))
        plan.decode_attention = None if decode else fn
        plan.add(
            "decode attention",
            "C (csrc/decode_attention.c)" if decode is None else "torch SDPA",
            decode or heads,
        )

        unfit = unfit or (None if cpu_prefill.supports_shape(head_dim, group) else f"no build for {heads}")
        prefill = (
            why_not("prefill")
            or unfit
            or _built(fn := cpu_prefill.kernel(head_dim, group, kv_dtype=kv_dtype))
        )
        plan.prefill_attention = None if prefill else fn
        plan.add(
            "prefill attention",
            "C (csrc/prefill_attention.c)" if prefill is None else "torch SDPA",
            prefill or heads,
        )

        stack = why_not("decode-stack") or why_not("gemm") or decode
        if stack is None and tensor_parallel_size > 1:
            stack = "tensor parallelism: the layers' all-reduces run between ops"
        stack = stack or _built(fn := cpu_decode_stack.kernel(head_dim, group, kv_dtype))
        plan.decode_stack = None if stack else fn
        if stack:
            plan.add("decode stack", "none: layers op by op", stack)

        # the sampler reads fp32 logits on the host whatever the model's device and dtype
        argmax = None if envs.kernel_enabled("ops") else envs.disabled_reason("ops")
        argmax = argmax or _built(lib := cpu_ops.load())
        plan.sampler_ops = None if argmax else lib
        plan.add(
            "greedy argmax",
            "C (csrc/row_ops.c)" if argmax is None else "torch",
            argmax or "over host fp32 logits",
        )
        sample = None if envs.kernel_enabled("sample") else envs.disabled_reason("sample")
        kernels = None if sample else cpu_sample.load()
        sample = sample or (
            None if kernels is not None else "not built, or it does not match torch's draw here"
        )
        plan.sample = kernels
        plan.add(
            "seeded sampling",
            "C (csrc/sample.c)" if sample is None else "torch",
            sample or "exponential race, top-k",
        )
    return plan


def cpu_bf16_units() -> bool:
    """The CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16), as oneDNN's bf16 kernels need."""
    flags = set(cpuinfo_field("flags").split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def isa_label() -> str:
    """The instruction sets the C kernels use here: SWIFTKV_CPU_MAX_ISA's cap applied to the CPU's."""
    flags = set(cpuinfo_field("flags").split())
    order = ["generic", "avx2", "avx512", "amx"]
    have = (
        "amx"
        if "amx_tile" in flags
        else "avx512"
        if "avx512f" in flags
        else "avx2"
        if "avx2" in flags
        else "generic"
    )
    cap = build.max_isa()
    return have if cap == "native" else min(have, cap, key=order.index)


def _why_not(on_cpu: bool, fp32: bool) -> Callable[[str], str | None]:
    def why(kernel: str) -> str | None:
        if not on_cpu:
            return "not on CPU"
        if not fp32:
            return "fp32 only"
        return None if envs.kernel_enabled(kernel) else envs.disabled_reason(kernel)

    return why


def _built(handle: object) -> str | None:
    return None if handle is not None else "no C compiler, or its build failed"
