"""CPU linear kernels, chosen by measurement at start-up.

Nine ways to compute y = x W^T + b for a checkpoint weight W (out_features, in_features):

    linear   F.linear on W as it is, (out, in)
    matmul   torch.mm / addmm on W^T stored contiguous, (in, out)
    mkldnn   oneDNN's prepacked fp32 inner product (torch.ops.mkldnn._reorder_linear_weight +
             _linear_pointwise, what Inductor's weight freezing uses on CPU): W reordered once
    panel    our compiled C kernel over W packed in 16-column panels (kernels/cpu_gemm.py; fp32,
             needs a C compiler): 1.1-1.5x oneDNN on a 16-row decode batch with the weights read
             from memory, on AMD EPYC Zen 3 (AVX2) and Zen 4 (AVX-512); a weight that is exactly
             4-bit blocks (kernels/weight_forms.py) as 4-bit panels, bit-identical results
    widen    W's values kept as bf16 (their exact form: a bf16 checkpoint), widened to fp32 by each call
             for F.linear: the portable layout of half the bytes, at thousands of rows about as fast
    bf16x3   our compiled C kernel on Intel AMX tiles, W split into bf16 hi + lo (kernels/cpu_amx.py):
             PyTorch's "high" float32 matmul precision, so a candidate only when the engine is allowed
             it (EngineConfig.matmul_precision = "high"); about 2x MKL's sgemm at thousands of rows
    q4-amx   our compiled C kernel on Intel AMX tiles for a weight that is exactly 4-bit blocks (a
             dequantized 4-bit checkpoint, kernels/weight_forms.py): exact bf16 products of the codes and
             x split in three, fp32 sums (kernels/cpu_amx_q4.py), so at "highest" too; a candidate
             only for such weights; 1.2-2.2x MKL's sgemm at 256-4,096 rows on a 2-core Xeon
    bf16-amx the bf16x3 kernel's machinery for a weight whose values are exact in bf16 (a bf16
             checkpoint loaded as fp32): W as bf16 tiles alone, x split in three exact parts, so every
             product is exact and the sums fp32, at "highest"; a candidate only for such weights
    panel-amx the panel GEMM's 4-bit panels multiplied on AMX tiles (kernels/cpu_gemm.py; the same
             exact products and fp32 sums, the same bytes as `panel`'s 4-bit layout, so the decode
             stack can run it too), and 8-bit panels for weights that are exactly 8-bit blocks (GGUF's
             Q8_0: the embedded model's tied lm_head, 1.8x the fp32 panels at 16 rows); a candidate
             only for such weights on CPUs with AMX-BF16

Which one is fastest depends on the GEMM library, the CPU and the row count (one layout was 2.3x
faster than the other on one x86 machine and slower on another), so `LinearKernelChooser` times
them once per weight shape and row bucket (decode batch sizes up to max_num_seqs, then up to the
prefill chunk max_num_batched_tokens), interleaved, best of a few calls, and caches the timings in
a JSON file per machine (CPU model and flags, core count, torch threads, torch version). A case
timed while another process kept the threads waiting for a core (kernels/cpu_contention.py) is timed
again, and not cached if every try was disturbed: on a Zen 4 EPYC, timings cached during a test run
had picked oneDNN over the panel GEMM for the 16-row lm_head, 1.2x slower there. When the
model's weights exceed the CPU's largest cache (`cold`), every timed call first reads a buffer twice
that size, as a step's other layers would: a 16-row product then reads its weight from memory, as
it does in the engine, and the kernel that overlaps those reads with its FMAs wins (on a Zen 4 EPYC
the warm timings ranked oneDNN first at 16 rows, the cold ones the panel GEMM, by 1.1-1.3x). Each layer
keeps the fewest weight layouts that are nowhere more than COPY_WORTH slower than the fastest
kernel (`plan_kernels`), and runs the fastest of them for each row bucket. An engine that keeps bf16
weights and multiplies them in fp32 (a CPU without bf16 units, EngineConfig.compute_dtype; `widened`)
is offered only the kernels whose layouts hold them in bf16 bytes or fewer (`bf16_pack`: the panel
GEMM's bf16 panels, widen), so its weights take the memory the user asked for. A forced kernel
(EngineConfig.linear_kernel) skips the timing (and keeps its own layout, fp32 in a widened engine
where it has no bf16 one). A private op that is missing or fails is dropped,
with one warning, for the next candidate; a kernel this machine cannot run (the AMX ones on a CPU
without AMX, a kernel switched off) is not offered, and one info line says which and why. Other
devices always run F.linear.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, partial
from itertools import combinations
from pathlib import Path

import torch
import torch.nn.functional as F

from swiftkv_fast import envs
from swiftkv_fast.kernels import build, cpu_amx, cpu_gemm
from swiftkv_fast.kernels.cpu_amx import MATMUL_PRECISIONS, Bf16x3Weight
from swiftkv_fast.kernels.cpu_amx_q4 import Q4AmxWeight
from swiftkv_fast.kernels.cpu_contention import ContentionMeter, waited_seconds
from swiftkv_fast.kernels.cpu_gemm import PanelWeight
from swiftkv_fast.kernels.weight_forms import FormMismatch, bf16_exact, q4_blocks, q8_blocks, remembered
from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

# a second weight layout is kept only where it makes some row bucket more than 1.2x faster: less than
# that is within the timing noise of a busy machine, and each layout is a full copy of the weight
COPY_WORTH = 1.2
MIN_SAMPLES, MAX_SAMPLES = 2, 7  # timed calls per kernel and case (the first one included: best-of)
CASE_BUDGET_S = 0.02  # more samples while the case has taken less than this (all kernels together)
CACHE_VERSION = 2
# a case (one row bucket, every kernel) during whose timing the threads waited more than this share of
# the time for a core (another process was busy: 0.003 alone on a 2-core EPYC, 0.3-0.4 beside one busy
# process) is timed again; its shape is not cached if every try was disturbed
BUSY_SHARE = 0.1
MAX_TRIES = 3
FALLBACK = "linear"  # what a failing forced kernel is replaced by
FORM_NAMES = {"q4": "4-bit", "q8": "8-bit", "bf16": "bf16"}  # the exact forms of kernels/weight_forms.py


@dataclass(frozen=True)
class LinearKernel:
    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]  # W (out, in) -> the kernel's layout of it
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (x, layout, bias)
    precision: str = "highest"  # the most precise matmul precision level that permits this kernel
    forms: frozenset[str] | None = None  # runs only weights of these exact forms (FORM_NAMES), or any
    # why this machine cannot run it (a CPU without AMX, a switch off), None where it can: such a kernel
    # is not offered, where a failing one (a private op missing in this torch) is logged as failed
    unavailable: Callable[[], str | None] = lambda: None
    fp32_only: bool = False  # its layouts hold fp32 weights (or exact forms of them): not for bf16 models
    # packs a weight whose values are exact in bf16 into 2 bytes a value or fewer (what a `widened` chooser
    # packs); None: this kernel's layouts hold more
    bf16_pack: Callable[[torch.Tensor], torch.Tensor] | None = None

    def permitted(self, precision: str) -> bool:
        """The kernel may run under the matmul precision level `precision` (MATMUL_PRECISIONS)."""
        return MATMUL_PRECISIONS.index(precision) >= MATMUL_PRECISIONS.index(self.precision)


def _matmul(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)


def _mkldnn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)  # opaque oneDNN tensor, (out, in)


def _mkldnn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """W (out, in) fp32 whose every value is exact in bf16 -> the same values in bf16, (out, in)."""
    if not bf16_exact(weight):
        raise FormMismatch(f"a {tuple(weight.shape)} weight whose values are not all exact in bf16")
    return weight.to(torch.bfloat16)


def _widen(x: torch.Tensor, w_bf16: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w_bf16.to(x.dtype), bias)  # exact: every bf16 value is an fp32 one


def _own_linear(x: torch.Tensor, layout, bias: torch.Tensor | None) -> torch.Tensor:
    """The compiled kernels' layouts (PanelWeight, Bf16x3Weight, Q4AmxWeight) multiply by themselves."""
    return layout.linear(x, bias)


KERNELS = {
    "linear": LinearKernel("linear", lambda w: w, F.linear),
    "matmul": LinearKernel("matmul", lambda w: w.t().contiguous(), _matmul),
    "mkldnn": LinearKernel("mkldnn", _mkldnn_pack, _mkldnn),
    "panel": LinearKernel(
        "panel",
        PanelWeight,
        _own_linear,
        unavailable=cpu_gemm.unavailable_reason,
        fp32_only=True,
        bf16_pack=partial(PanelWeight, compact=True),  # bf16 panels (4- or 8-bit ones where exact)
    ),
    "widen": LinearKernel("widen", _bf16_pack, _widen, forms=frozenset({"bf16"}), bf16_pack=_bf16_pack),
    "bf16x3": LinearKernel(
        "bf16x3",
        Bf16x3Weight,
        _own_linear,
        precision="high",
        unavailable=cpu_amx.unavailable_reason,
        fp32_only=True,
    ),
    "q4-amx": LinearKernel(
        "q4-amx",
        Q4AmxWeight,
        _own_linear,
        forms=frozenset({"q4"}),
        unavailable=cpu_amx.unavailable_reason,
    ),
    "bf16-amx": LinearKernel(
        "bf16-amx",
        partial(Bf16x3Weight, exact=True),
        _own_linear,
        forms=frozenset({"bf16"}),
        unavailable=cpu_amx.unavailable_reason,
    ),
    "panel-amx": LinearKernel(
        "panel-amx",
        partial(PanelWeight, amx=True),
        _own_linear,
        forms=frozenset({"q4", "q8"}),
        unavailable=cpu_gemm.amx_unavailable_reason,
    ),
}


def nbytes(t: torch.Tensor | PanelWeight) -> int:
    """Bytes a weight layout holds (a oneDNN tensor's own size, padding included)."""
    if isinstance(t, (PanelWeight, Bf16x3Weight, Q4AmxWeight)):
        return t.nbytes
    if t.is_mkldnn:
        return int(torch.ops.mkldnn._nbytes(t))
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class KernelChoice:
    """The weight layouts one Linear keeps and which kernel runs which row counts: `plan` is
    ((max_rows, kernel), ...) ascending; the last entry also takes every larger count."""

    layouts: dict[str, torch.Tensor]
    plan: tuple[tuple[int, str], ...]

    @classmethod
    def single(cls, kernel: str, weight: torch.Tensor) -> KernelChoice:
        return cls({kernel: KERNELS[kernel].pack(weight)}, ((sys.maxsize, kernel),))


def row_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, ...]:
    """Row counts the kernels are timed at: powers of two up to the largest decode batch, that batch,
    x4 steps above it and the prefill chunk. A step of r rows uses the choice of the first bucket >= r."""
    decode = min(max_num_seqs, max_num_batched_tokens)
    sizes = {decode, max_num_batched_tokens} | {1 << i for i in range(decode.bit_length())}
    m = 4 * decode
    while m < max_num_batched_tokens:
        sizes.add(m)
        m *= 4
    return tuple(sorted(sizes))


def plan_kernels(
    times: dict[int, dict[str, float]], free: frozenset[str] = frozenset()
) -> tuple[tuple[int, str], ...]:
    """Per row bucket, the kernel to run, from `times` {rows: {kernel: seconds}}: among the kernel sets
    that are within COPY_WORTH of each bucket's fastest kernel, the one needing the fewest weight copies
    (kernels in `free` need none), then the fastest overall; each bucket runs the set's fastest."""
    names = sorted(set.intersection(*(set(t) for t in times.values())))
    best = {b: max(min(t[k] for k in names), 1e-12) for b, t in times.items()}

    def slowdowns(kept):
        return [min(times[b][k] for k in kept) / best[b] for b in times]

    options = [
        (len(set(kept) - free), sum(slowdowns(kept)), kept)
        for size in range(1, len(names) + 1)
        for kept in combinations(names, size)
        if max(slowdowns(kept)) <= COPY_WORTH
    ]
    kept = min(options)[2]
    return tuple((b, min(kept, key=lambda k: times[b][k])) for b in sorted(times))


@cache
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpuinfo_field(name: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


@cache
def machine_key() -> dict[str, object]:
    """What kernel timings depend on; a cache file measured under another key is not used. The C
    kernels' sources are part of it: a changed kernel is timed afresh."""
    flags = cpuinfo_field("flags") or cpuinfo_field("Features")
    libraries = {v: getattr(envs, v) for v in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")}
    return {
        "cpu": cpu_model(),
        "cpu_flags": hashlib.sha1(flags.encode()).hexdigest()[:12],
        # the instruction sets in use: the kernels', ATen's, and the libraries' where held back
        "isa": [build.max_isa(), torch.backends.cpu.get_cpu_capability(), libraries],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "mkldnn": torch.backends.mkldnn.is_available(),
        "kernels": build.source_digest()[:12],
    }


def cache_file(cache_dir: Path) -> Path:
    key = json.dumps(machine_key(), sort_keys=True).encode()
    return Path(cache_dir) / f"linear_kernels-v{CACHE_VERSION}-{hashlib.sha1(key).hexdigest()[:16]}.json"


@cache
def largest_cache_bytes() -> int:
    """The CPU's largest cache (its last level) from /sys, 64 MiB where that cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()  # '32768K'
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes, default=64 << 20)


def weights_exceed_cache(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> bool:
    """The model's weights in `dtype` exceed the CPU's largest cache: every step reads them from memory,
    so kernels are timed `cold`."""
    return sum(t.numel() for t in state_dict.values()) * dtype.itemsize > largest_cache_bytes()


@cache
def _eviction_buffer() -> torch.Tensor:
    return torch.ones(2 * largest_cache_bytes() // 4)  # (twice the largest cache,) fp32


def evict_caches() -> None:
    """Reads a buffer twice the largest cache, so that what was cached before comes from memory next.
    The buffer is kept until `LinearKernelChooser.finish` frees it."""
    _eviction_buffer().sum()


Times = dict[str, dict[int, dict[str, float]]]  # shape key -> rows -> kernel -> best seconds


def load_times(path: Path) -> Times:
    """The timings cached in `path`; {} (with one log line) when it is missing, corrupt or foreign."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            raise ValueError(f"not a version-{CACHE_VERSION} linear-kernel cache")
        if data.get("machine") != machine_key():
            logger.warning("ignoring linear-kernel cache %s: measured on another machine or torch", path)
            return {}
        return {
            shape: {int(rows): {str(k): float(s) for k, s in per.items()} for rows, per in t.items()}
            for shape, t in data["times"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("ignoring corrupt linear-kernel cache %s (%s: %s)", path, type(e).__name__, e)
        return {}


def save_times(path: Path, times: Times) -> None:
    """Written atomically; a cache that cannot be written is logged, not raised."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # for a reader judging the timings
    data = {"version": CACHE_VERSION, "machine": machine_key(), "load_average_1m": load, "times": times}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not write the linear-kernel cache %s (%s)", path, e)


def wall_time(kernel: str, rows: int, call: Callable[[], object]) -> float:
    """Seconds of one call (the chooser's default timer; tests inject their own)."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


_CHOICES: dict[str, str] = {}  # "name (out x in)" -> its plan, every choice made in this process


def kernel_choices() -> dict[str, str]:
    """The kernel plan of every linear layer shape built in this process (benchmarks report it)."""
    return dict(_CHOICES)


def merge_runs(plan: tuple[tuple[int, str], ...]) -> tuple[tuple[int, str], ...]:
    """Consecutive buckets of one kernel as one entry; the last one takes every larger row count."""
    runs: list[tuple[int, str]] = []
    for rows, k in plan:
        if runs and runs[-1][1] == k:
            runs[-1] = (rows, k)
        else:
            runs.append((rows, k))
    runs[-1] = (sys.maxsize, runs[-1][1])
    return tuple(runs)


def describe_plan(plan: tuple[tuple[int, str], ...]) -> str:
    """'matmul <= 1, mkldnn above' for a merged plan."""
    last = plan[-1][1] + (" above" if len(plan) > 1 else "")
    return ", ".join([f"{k} <= {rows}" for rows, k in plan[:-1]] + [last])


@dataclass
class LinearKernelChooser:
    """Picks the kernel of every linear layer (see the module docstring). `kernel`: 'auto' or one of
    KERNELS to force; `row_buckets` from `row_buckets()`; `cache_dir` None: no cache file; `cold`: time
    every call with the caches evicted first (for a model whose weights exceed them); `precision`: the
    matmul precision level (MATMUL_PRECISIONS) whose kernels 'auto' chooses from."""

    kernel: str
    device: str | torch.device
    row_buckets: tuple[int, ...]
    cache_dir: Path | None = None
    cold: bool = False
    precision: str = "highest"
    timer: Callable[[str, int, Callable[[], object]], float] = wall_time
    forms: bool = True  # weights exactly in a compact form may get its layouts (also needs gemm-4bit on)
    # the weights are bf16 values (passed as fp32) to be kept in bf16 bytes: only kernels with a bf16_pack
    widened: bool = False
    times: Times = field(default_factory=dict)
    extra_bytes: int = 0  # weight memory the kept layouts take beyond one copy of each weight
    spare_bytes: int = 0  # weight memory of the spare layouts (`choose`), until they are dropped
    timed_cases: int = 0
    timed_seconds: float = 0.0
    failed: set[str] = field(default_factory=set)
    absent: dict[str, str] = field(default_factory=dict)  # kernel -> why this machine cannot run it
    waited: Callable[[], float | None] = waited_seconds  # the threads' run-queue delay (tests inject)
    busy: dict[str, float] = field(default_factory=dict)  # shape key -> its timings' run-queue share
    choices: dict[str, str] = field(default_factory=dict)  # "name (out x in)" -> its plan, described
    choice_bytes: dict[str, int] = field(default_factory=dict)  # the same keys -> bytes beyond one copy
    forms_found: set[str] = field(default_factory=set)  # compact forms seen among the weights (FORM_NAMES)

    def __post_init__(self) -> None:
        if self.kernel != "auto" and self.kernel not in KERNELS:
            raise ValueError(f"linear_kernel must be 'auto' or one of {list(KERNELS)}, got {self.kernel!r}")
        if self.precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {self.precision!r}")
        self.on_cpu = torch.device(self.device).type == "cpu"
        self.fallback = "widen" if self.widened else FALLBACK  # what a failing forced kernel is replaced by
        self.cache_path = cache_file(self.cache_dir) if self.cache_dir is not None else None
        if self.on_cpu and self.kernel == "auto" and self.cache_path is not None:
            self.times = load_times(self.cache_path)
        # what the cache file held, per shape (a shape timed again on a busy machine keeps it there)
        self._loaded = {s: {rows: dict(t) for rows, t in per.items()} for s, per in self.times.items()}
        self._timed_shapes: set[str] = set()

    def choose(
        self,
        name: str,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        max_rows: int,
        shared: bool = False,
        spare: str | None = None,
        copied: int = 0,
    ) -> KernelChoice:
        """The layouts and plan of one Linear over W (out, in) that runs at most `max_rows` rows.
        `shared`: W's storage is kept anyway (the tied lm_head's embedding), so 'linear' costs nothing.
        `spare`: a kernel whose layout is kept too where the plan does not use it, when the kernels are
        chosen by measurement (the decode stack's panel GEMM: worker/stack_timing.py times the stack
        against the per-op path, then drops the spare where the stack does not run)."""
        with remembered(weight):  # its block form is found once, not once per layout packed
            return self._choose(name, weight, bias, max_rows, shared, spare, copied)

    def _choose(self, name, weight, bias, max_rows, shared, spare, copied=0) -> KernelChoice:
        if not self.on_cpu:
            return KernelChoice.single("linear", weight)
        layouts: dict[str, torch.Tensor] = {}
        form = self._form(weight)
        key = self._shape_key(weight, form)
        if self.kernel != "auto":
            kernel = self.kernel if self._pack(self.kernel, weight, layouts) else self.fallback
            plan: tuple[tuple[int, str], ...] = ((sys.maxsize, kernel),)
        else:
            buckets = [b for b in self.row_buckets if b < max_rows]
            buckets.append(next((b for b in self.row_buckets if b >= max_rows), max_rows))
            times = self._times(key, form, weight, bias, buckets, layouts)
            plan = merge_runs(plan_kernels(times, frozenset({"linear"}) if shared else frozenset()))
        kept = {k for _, k in plan}
        for k in kept - set(layouts):  # chosen from cached timings: packed here
            if not self._pack(k, weight, layouts):
                return self._without(key, k, name, weight, bias, max_rows, shared, copied)
        layouts = {k: layouts[k] for k in kept}
        extra = self._extra_bytes(weight, layouts, shared) + copied
        self.extra_bytes += extra
        if spare == "panel" and self.kernel == "auto":
            spare = self._faster_panel(times)
        if spare is not None and self.kernel == "auto" and spare not in layouts:
            spare_layout: dict[str, torch.Tensor] = {}
            if self._pack(spare, weight, spare_layout):
                layouts[spare] = spare_layout[spare]
                self.spare_bytes += nbytes(spare_layout[spare])
        # layers that run fewer rows (SwiftKV's second half: decode rows only) are named apart
        rows = "" if max_rows >= max(self.row_buckets) else f" at <= {max_rows} rows"
        bits = f", {FORM_NAMES[form]}" if form else ""  # engines over the same shapes in other forms apart
        label = f"{name} ({weight.shape[0]}x{weight.shape[1]}{bits}){rows}"
        self.choices[label] = describe_plan(plan)
        self.choice_bytes[label] = self.choice_bytes.get(label, 0) + extra
        _CHOICES.update(self.choices)
        return KernelChoice(layouts, plan)

    @staticmethod
    def _faster_panel(times: dict[int, dict[str, float]]) -> str:
        """Of the panel GEMM's flavours timed here (fp32 or 4-bit on FMAs, "panel"; 4-bit on AMX tiles,
        "panel-amx"), the one faster over decode-sized rows (up to 64): the decode stack's spare."""
        decode = [t for rows, t in times.items() if rows <= 64] or list(times.values())
        timed = [k for k in ("panel", "panel-amx") if all(k in t for t in decode)]
        return min(timed, key=lambda k: sum(t[k] for t in decode)) if timed else "panel"

    def _without(self, key, kernel, name, weight, bias, max_rows, shared, copied=0) -> KernelChoice:
        for t in self.times.get(key, {}).values():
            t.pop(kernel, None)
        return self._choose(name, weight, bias, max_rows, shared, None, copied)

    def _pack(self, kernel: str, weight: torch.Tensor, layouts: dict[str, torch.Tensor]) -> bool:
        """Packs W for `kernel` into `layouts` and checks one call runs; False (logged once) if not."""
        if kernel in self.failed:
            return False
        pack = KERNELS[kernel].pack
        if self.widened and KERNELS[kernel].bf16_pack is not None:
            pack = KERNELS[kernel].bf16_pack
        try:
            layout = pack(weight)
            with torch.inference_mode():
                KERNELS[kernel].run(weight.new_zeros(1, weight.shape[1]), layout, None)
        except FormMismatch:  # this weight only (a forced form-bound kernel: the others may have the form)
            return False
        except Exception as e:  # a private op: missing in this torch, or unsupported here
            if kernel == self.fallback:
                raise
            self.failed.add(kernel)
            logger.warning(
                "linear kernel %r failed (%s: %s): not used in this process", kernel, type(e).__name__, e
            )
            return False
        layouts[kernel] = layout
        return True

    def _times(
        self, shape: str, form: str | None, weight, bias, buckets: list[int], layouts
    ) -> dict[int, dict[str, float]]:
        """{rows: {kernel: best seconds}} for every bucket, measuring the ones the cache lacks. A case
        (one bucket, every kernel) timed while the threads waited for a core (another process busy) is
        timed again, up to MAX_TRIES in all; the least disturbed try is used, and the shape is not
        cached if that one was disturbed too."""
        names = [
            k
            for k, kern in KERNELS.items()
            if k not in self.failed
            and kern.permitted(self.precision)
            and (kern.forms is None or form in kern.forms)
            and (kern.bf16_pack is not None or not self.widened)
            and self._here(k, weight.dtype)
        ]
        known = self.times.setdefault(shape, {})
        missing = [b for b in buckets if not set(names) <= set(known.get(b, {}))]
        if missing:
            names = [k for k in names if self._pack(k, weight, layouts)]
            start = time.perf_counter()
            used = {k: layouts[k] for k in names}
            for rows in missing:
                best_share = math.inf
                for _ in range(MAX_TRIES):
                    meter = ContentionMeter(self.waited)
                    with torch.inference_mode():
                        timed = self._measure(weight, bias, rows, used)
                    share = meter.share(torch.get_num_threads())
                    share = 0.0 if share is None else share  # unknown (not Linux): taken as undisturbed
                    if share < best_share:
                        best_share, known[rows] = share, timed
                    if share <= BUSY_SHARE:
                        break
                if best_share > BUSY_SHARE:
                    self.busy[shape] = max(best_share, self.busy.get(shape, 0.0))
            self._timed_shapes.add(shape)
            self.timed_seconds += time.perf_counter() - start
            self.timed_cases += len(missing)
        return {b: {k: known[b][k] for k in names} for b in buckets}

    def _here(self, kernel: str, dtype: torch.dtype = torch.float32) -> bool:
        """The kernel can run on this machine, for weights of `dtype` (else noted in `absent`, which the
        kernel plan reports)."""
        if KERNELS[kernel].fp32_only and dtype != torch.float32:
            self.absent.setdefault(
                kernel, f"fp32 weights only, these are {str(dtype).removeprefix('torch.')}"
            )
            return False
        if kernel not in self.absent:
            reason = KERNELS[kernel].unavailable()
            if reason is None:
                return True
            self.absent[kernel] = reason
        return False

    def _measure(self, weight, bias, rows: int, layouts: dict[str, torch.Tensor]) -> dict[str, float]:
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)  # (rows, in)
        calls = {k: partial(KERNELS[k].run, x, w, bias) for k, w in layouts.items()}
        best = dict.fromkeys(calls, math.inf)
        spent, samples = 0.0, 0
        while samples < MIN_SAMPLES or (samples < MAX_SAMPLES and spent < CASE_BUDGET_S):
            for k, call in calls.items():
                if self.cold:
                    evict_caches()
                seconds = self.timer(k, rows, call)
                best[k] = min(best[k], seconds)
                spent += seconds
            samples += 1
        return best

    def _extra_bytes(self, weight: torch.Tensor, layouts: dict[str, torch.Tensor], shared: bool) -> int:
        copies = sum(nbytes(w) for k, w in layouts.items() if k != "linear" or not shared)
        one_copy = weight.numel() * (torch.bfloat16.itemsize if self.widened else weight.element_size())
        return copies - (0 if shared else one_copy)

    def finish(self) -> None:
        """Saves new timings to the cache file (the kernel plan reports the choices: `how`, `choices`,
        `choice_bytes`, `absent`)."""
        _eviction_buffer.cache_clear()  # the cold timings' buffer: not held for the engine's lifetime
        if self.busy:
            logger.warning(
                "the CPU was busy while the linear kernels were timed (threads waited up to %.0f%% of the "
                "time for a core; %d tries): the choices for %s hold for this process only, are not "
                "cached, and are timed again at the next start",
                100 * max(self.busy.values()),
                MAX_TRIES,
                ", ".join(sorted(self.busy)),
            )
        if self.cache_path is not None and self._timed_shapes - set(self.busy):
            saved = {s: self._loaded.get(s) if s in self.busy else t for s, t in self.times.items()}
            save_times(self.cache_path, {s: t for s, t in saved.items() if t is not None})

    def how(self) -> str:
        """How the choices were made: forced, timed now, or from the timings cached on this machine."""
        if self.kernel != "auto":
            return f"forced {self.kernel!r}"
        if self.timed_cases:
            return f"timed now ({self.timed_cases} cases, {self.timed_seconds:.1f} s)"
        return "cached timings"

    def _form(self, weight: torch.Tensor) -> str | None:
        """W's exact form where those layouts are on (kernels/weight_forms.py): "q4" (4-bit d q + m: the panel
        GEMM reads 5.3x fewer bytes, q4-amx and panel-amx are candidates), "q8" (8-bit d q: panel-amx
        is), "bf16" (values exact in bf16, a bf16 checkpoint: bf16-amx and widen are), or None. A `widened`
        chooser's weights are bf16 values by construction: "bf16"."""
        if self.widened:
            return "bf16"
        if self.kernel != "auto" or weight.dtype != torch.float32 or not cpu_gemm.four_bit_enabled():
            return None
        form = "q4" if q4_blocks(weight) is not None else "q8" if q8_blocks(weight) is not None else None
        form = form or ("bf16" if bf16_exact(weight) else None)
        if form is not None:
            self.forms_found.add(form)
        return form if self.forms else None

    def _shape_key(self, weight: torch.Tensor, form: str | None) -> str:
        """The cache key of a weight's timings: dtype, shape, the block form, cold."""
        bits = f" {form}" if form else ""
        cold = " cold" if self.cold else ""
        return f"{str(weight.dtype).removeprefix('torch.')} {weight.shape[0]}x{weight.shape[1]}{bits}{cold}"
