"""The timing harness every benchmark uses.

`run_interleaved` times several cases against each other: warm-up calls first (discarded), then
`repeat` rounds, each round calling every case once in the same order (A, B, A, B, ...), so slow
drifts of a loaded machine hit all cases alike. `Stats` summarises one metric (median, min, max,
quartiles); `paired_ratio` divides two metrics round by round (the ratio of round i uses the two
measurements of round i only) and summarises those ratios.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stats:
    """Median and spread of repeated measurements."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            raise ValueError("Stats.of needs at least one value")
        xs = sorted(float(v) for v in values)
        if len(xs) == 1:
            q1 = q3 = xs[0]
        else:
            q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        return cls(statistics.median(xs), xs[0], xs[-1], q1, q3, len(xs))

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def fmt(self, digits: int = 1) -> str:
        """`median [min–max]`, or just the median for one measurement."""
        if self.n == 1:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} [{self.min:.{digits}f}-{self.max:.{digits}f}]"


@dataclass
class Sample:
    """One call of one case: wall seconds and whatever metrics the case returned."""

    seconds: float
    metrics: dict[str, Any]


def timed(fn: Callable[[], dict[str, Any] | Sample | None]) -> Sample:
    # a full collection outside the clock: otherwise an old-generation pass over every object the
    # imports left (torch, transformers, vLLM) lands inside whichever sample happens to trigger it
    gc.collect()
    start = time.perf_counter()
    metrics = fn() or {}
    if isinstance(metrics, Sample):  # timed where it ran (bench/vllm_worker.py): that clock, not this one
        return metrics
    return Sample(time.perf_counter() - start, dict(metrics))


def run_interleaved(
    cases: dict[str, Callable[[], dict[str, Any] | Sample | None]],
    repeat: int = 3,
    warmup: int = 1,
    warmup_cases: dict[str, Callable[[], Any]] | None = None,
    progress: bool = False,
) -> dict[str, list[Sample]]:
    """Call every case `warmup` times (or its cheaper `warmup_cases` stand-in), then `repeat`
    rounds of A, B, C, ...; returns the samples of each case in round order.

    A case returns a dict of metrics it measured itself (e.g. per-request latencies), or None, and
    the harness records its wall time as `seconds`; or a Sample timed where it ran (a worker
    process's own clock, without the messages to it and back), kept as it is. `progress` shows a
    tqdm bar over the calls.
    """
    from tqdm.auto import tqdm

    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    bar = tqdm(total=len(cases) * (warmup + repeat), disable=not progress, unit="run", dynamic_ncols=True)
    try:
        for name, fn in cases.items():
            stand_in = (warmup_cases or {}).get(name, fn)
            for _ in range(warmup):
                bar.set_description(f"warm-up {name}")
                log.debug("warm-up: %s", name)
                stand_in()
                bar.update()
        samples: dict[str, list[Sample]] = {name: [] for name in cases}
        for round_ in range(repeat):
            for name, fn in cases.items():
                bar.set_description(f"round {round_ + 1}/{repeat} {name}")
                log.debug("round %d/%d: %s", round_ + 1, repeat, name)
                samples[name].append(timed(fn))
                bar.update()
    finally:
        bar.close()
    return samples


def metric(samples: Sequence[Sample], key: str) -> list[float]:
    """One metric across rounds: `seconds` or a key the case returned."""
    return [s.seconds if key == "seconds" else s.metrics[key] for s in samples]


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Stats:
    """Ratio of two cases measured in the same rounds: round i divides by round i only."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired_ratio needs equal rounds, got {len(numerator)} and {len(denominator)}")
    return Stats.of([a / b for a, b in zip(numerator, denominator)])


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge a number: CPU model and count, load, versions (BLAS and oneDNN too),
    device, date, commit, and the engine's linear kernel per layer shape (why two machines differ)."""
    import torch

    from bench.engine import linear_kernels

    kernels = linear_kernels()
    info: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": kernels["cpu_model"],
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        **blas_info(),
        "linear_kernels": kernels["linear_kernels"],
        "malloc_tuned": _malloc_tuned(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git_commit": _git_commit(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def _malloc_tuned() -> bool:
    """Whether an engine in this process raised glibc's malloc thresholds (worker/host_allocator.py of
    swiftkv_fast): every system measured in the process, transformers included, then runs with it."""
    from swiftkv_fast.worker import host_allocator

    return host_allocator.tuned()


def blas_info() -> dict[str, Any]:
    """torch's BLAS library and versions of MKL and oneDNN (from torch.__config__.show()), whether oneDNN
    is usable, and the SIMD level torch's CPU kernels use."""
    import torch

    config = torch.__config__.show()

    def find(pattern: str) -> str | None:
        m = re.search(pattern, config)
        return m.group(1) if m else None

    return {
        "blas": find(r"BLAS_INFO=(\w+)"),
        "mkl": find(r"Math Kernel Library Version ([\w.]+)"),
        "onednn": find(r"(?:MKL-DNN|oneDNN) v([\w.]+)"),
        "onednn_available": torch.backends.mkldnn.is_available(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # instruction sets held back below this CPU's (empty: none): the C kernels', MKL's, oneDNN's
        "isa_limits": {
            k: v
            for k in ("SWIFTKV_CPU_MAX_ISA", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
            if (v := os.environ.get(k))
        },
    }


def machine_summary(info: dict[str, Any]) -> list[str]:
    """The lines a table header shows of `machine_info()`."""
    load = info["load_average_1m"]
    lines = [
        f"machine: {info['cpu_model']}, {info['cpu_count']} CPUs ({info['torch_threads']} torch threads"
        + ("" if load is None else f", load {load:.1f}")
        + f"), {info['cpu_capability']}; torch {info['torch']}, BLAS {info['blas']} (MKL {info['mkl']}), "
        f"oneDNN {info['onednn']}" + ("" if info["onednn_available"] else " (unavailable)")
    ]
    if info.get("isa_limits"):
        held = ", ".join(f"{k}={v}" for k, v in info["isa_limits"].items())
        lines.append(f"instruction sets held back: {held} (this CPU measured as a lesser one)")
    if info.get("malloc_tuned"):
        lines.append(
            "malloc: glibc keeps freed memory for reuse (set by the engine; every system in this process, "
            "transformers included, runs with it)"
        )
    if info.get("matmul_precision", "highest") != "highest":
        lines.append(
            f"float32 matmul precision: {info['matmul_precision']!r} for every system in this process "
            "(torch.set_float32_matmul_precision; the engine's matmul_precision)"
        )
    kernels = info.get("linear_kernels") or {}
    if kernels:
        lines.append("linear kernels: " + "; ".join(f"{k}: {v}" for k, v in kernels.items()))
    return lines


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
