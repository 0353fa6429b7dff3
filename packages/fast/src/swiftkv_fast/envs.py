"""Every environment variable swiftkv_fast reads, with its default and what it does (vLLM's envs.py).

Read them as attributes, `envs.SWIFTKV_CPU_MAX_ISA`: each access reads the environment afresh (the
callers that must decide once per process cache the answer themselves). Nothing else in the package
reads os.environ for its own settings. `python -m swiftkv_fast.envs` prints the table that
docs/environment.md holds.

The C kernels' on/off switches are one list, SWIFTKV_DISABLED_KERNELS (like VLLM_DISABLED_KERNELS):
`SWIFTKV_DISABLED_KERNELS=gemm,decode` runs the library / portable torch path for those two. A name
not in KERNELS is refused with the list of known ones. An engine reads it once, as the default of
`EngineConfig.disabled_kernels`, and builds its kernel plan under its own list (`kernels_disabled`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

# the C kernels SWIFTKV_DISABLED_KERNELS can switch off, and what each is
KERNELS = {
    "ops": "RMSNorm, SiLU-and-mul, RoPE, the KV write and greedy argmax (kernels/cpu_ops.py)",
    "decode": "decode attention over the paged cache (kernels/cpu_decode.py)",
    "prefill": "prompt attention over the paged cache (kernels/cpu_prefill.py)",
    "gemm": "the panel GEMM, the `panel` linear kernel (kernels/cpu_gemm.py)",
    "gemm-4bit": "compact panels (4-bit, 8-bit, bf16) of weights exactly in those forms: fp32 panels only",
    "amx": "the AMX GEMMs: bf16x3, bf16-amx, q4-amx (kernels/cpu_amx.py, cpu_amx_q4.py)",
    "decode-stack": "a run of decode layers as one C call (kernels/cpu_decode_stack.py)",
    "sample": "the seeded sampler's exponential race and top-k (kernels/cpu_sample.py)",
}


def _flag(value: str) -> bool:
    return value != "0"


def _kernel_list(value: str, what: str = "SWIFTKV_DISABLED_KERNELS") -> frozenset[str]:
    names = frozenset(n.strip().lower() for n in value.split(",") if n.strip())
    unknown = names - KERNELS.keys()
    if unknown:
        raise ValueError(
            f"{what}={value!r}: unknown {sorted(unknown)}; expected names from {sorted(KERNELS)}"
        )
    return names


def _isa(value: str) -> str:
    value = value.lower() or "native"
    if value not in ("native", "avx512", "avx2"):
        raise ValueError(f"SWIFTKV_CPU_MAX_ISA={value!r}: expected one of ['avx2', 'avx512', 'native']")
    return value


@dataclass(frozen=True)
class Variable:
    default: str
    doc: str
    parse: Callable[[str], Any] = str


VARIABLES: dict[str, Variable] = {
    "SWIFTKV_DISABLED_KERNELS": Variable(
        "", f"comma-separated C kernels to switch off, of: {', '.join(KERNELS)}", _kernel_list
    ),
    "SWIFTKV_CPU_MAX_ISA": Variable(
        "native", "build the C kernels for a lesser x86 CPU: native, avx512 (no AMX) or avx2", _isa
    ),
    "SWIFTKV_TUNE_MALLOC": Variable(
        "1", "0: leave glibc malloc's thresholds alone (worker/host_allocator.py)", _flag
    ),
    "SWIFTKV_CACHE": Variable(
        "", "the cache dir (converted default model, kernel timings, built kernels); default ~/.cache/swiftkv"
    ),
    "SWIFTKV_LOGGING_LEVEL": Variable("INFO", "the level of the swiftkv_fast loggers"),
    "SWIFTKV_CONFIGURE_LOGGING": Variable(
        "1", "0: leave logging to the application (no handler added)", _flag
    ),
    "SWIFTKV_API_KEY": Variable("", "the API key `swiftkv serve` requires when --api-key is not given"),
    "CC": Variable("cc", "the C compiler the kernels are built with"),
    "XDG_CACHE_HOME": Variable("", "where the built kernels go when SWIFTKV_CACHE is not set ($XDG/swiftkv)"),
    "TRITON_INTERPRET": Variable(
        "0", "1: Triton kernels run in its CPU interpreter (set before import)", _flag
    ),
    "MKL_ENABLE_INSTRUCTIONS": Variable("", "MKL's instruction-set cap; part of the kernel timings' key"),
    "ONEDNN_MAX_CPU_ISA": Variable("", "oneDNN's instruction-set cap; part of the kernel timings' key"),
}


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.parse(os.environ.get(name, var.default))


def __dir__() -> list[str]:
    return [*globals(), *VARIABLES]


# an engine's own list while its kernel plan is built (EngineConfig.disabled_kernels), else None
_DISABLED: ContextVar[frozenset[str] | None] = ContextVar("swiftkv_disabled_kernels", default=None)


def disabled_kernels(value: str | None = None) -> frozenset[str]:
    """The kernels switched off: those of `value` (comma-separated KERNELS names), else of the engine
    whose plan is being built, else of SWIFTKV_DISABLED_KERNELS."""
    if value is not None:
        return _kernel_list(value, "disabled_kernels")
    override = _DISABLED.get()
    return override if override is not None else _kernel_list(os.environ.get("SWIFTKV_DISABLED_KERNELS", ""))


@contextmanager
def kernels_disabled(names: frozenset[str]) -> Iterator[None]:
    """While the block runs (an engine's plan being built), `kernel_enabled` answers from `names`."""
    token = _DISABLED.set(frozenset(names))
    try:
        yield
    finally:
        _DISABLED.reset(token)


def kernel_enabled(name: str) -> bool:
    """Whether the C kernel `name` (a KERNELS key) may run: not switched off (`disabled_kernels`)."""
    if name not in KERNELS:
        raise KeyError(f"{name!r} is not one of {sorted(KERNELS)}")
    return name not in disabled_kernels()


def disabled_reason(name: str) -> str:
    """The text that says `name` was switched off."""
    return f"{name} in disabled_kernels"


def markdown() -> str:
    """The variables as a markdown table (docs/environment.md)."""
    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    rows += [
        f"| `{k}` | {f'`{v.default}`' if v.default else 'unset'} | {v.doc} |" for k, v in VARIABLES.items()
    ]
    rows += ["", "`SWIFTKV_DISABLED_KERNELS` names:", "", "| name | the kernel |", "| --- | --- |"]
    rows += [f"| `{k}` | {doc} |" for k, doc in KERNELS.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())
