"""Where an engine step's time goes: linear layers (GEMMs), attention, KV writes, the rest.

`profiled(llm)` is a context manager: inside it, the model runner's `execute` (one engine step), every
`Linear` of the model and the attention backend's calls are wrapped with wall-clock timers; on exit
the engine is restored, so outside a profiled run it runs untouched (no cost when not profiling).
CPU ops are synchronous, so the wall time around a call is its cost (on CUDA each timer synchronizes).

Categories, per step (summed over the step's calls):
    linear     every Linear of the model: qkv, o, gate_up, down, SwiftKV's fused K/V, lm_head (with the
               RMSNorm / SiLU-and-mul in front of it where the panel GEMM fuses them, model/layers.py)
    attention  the backend's `prefill` (the first half's attention: prompt and decode rows) and
               `decode` (the second half's) calls
    kv_write   the backend's `write_kv` calls
    stack      the decode stacks' own time (model/decode_stack.py: on CPU, a half's layers over decode
               rows as one C call): building the call, checking its inputs, the buffers; the call times
               its phases inside (thread 0, between the barriers that end them) and its GEMMs count
               in linear, its attention in attention, its RoPE and KV writes in kv_write
    rest       the step's remaining time: norms, RoPE, residuals, sampling, building the batch
A step is a decode step when every scheduled request has one token; `decode` summarizes those steps
only, `all` every step. `runner_share` is the share of the run's wall time spent in steps (the rest:
scheduling, detokenizing, the LLM front end).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from swiftkv_fast.kernels.cpu_decode_stack import TIMED_PHASES

from bench import engine

CATEGORIES = ("linear", "attention", "kv_write", "stack", "rest")
_UNSET = object()
_ATTENTION_CALLS = {"prefill": "attention", "decode": "attention", "write_kv": "kv_write"}
_STACK_PHASES = {"linear": "linear", "attention": "attention", "rope_kv": "kv_write"}


@dataclass
class _Step:
    seconds: float
    decode: bool
    by_category: dict[str, float]  # seconds; "rest" not included


@dataclass
class StepProfile:
    """Timers of the profiled steps; `summary()` turns them into shares."""

    sync: Any = None  # a no-argument callable run before each clock read (CUDA), or None
    steps: list[_Step] = field(default_factory=list)
    _open: dict[str, float] | None = None  # the step being run: seconds per category so far

    def clock(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def add(self, category: str, seconds: float) -> None:
        if self._open is not None:
            self._open[category] = self._open.get(category, 0.0) + seconds

    def summary(self, wall_seconds: float | None = None) -> dict[str, Any]:
        """{"all": ..., "decode": ...}, each {"steps", "step_ms", "<category>_ms", "<category>_share"}
        (the shares of one summary sum to 1), and `runner_share` when the run's wall time is given."""
        out: dict[str, Any] = {
            "all": _summarize(self.steps),
            "decode": _summarize([s for s in self.steps if s.decode]),
        }
        if wall_seconds:
            out["runner_share"] = sum(s.seconds for s in self.steps) / wall_seconds
        return out


def _summarize(steps: list[_Step]) -> dict[str, Any]:
    total = sum(s.seconds for s in steps)
    out: dict[str, Any] = {"steps": len(steps), "step_ms": 1e3 * total / len(steps) if steps else None}
    spent = {c: sum(s.by_category.get(c, 0.0) for s in steps) for c in CATEGORIES[:-1]}
    spent["rest"] = max(0.0, total - sum(spent.values()))
    norm = sum(spent.values())
    for c in CATEGORIES:
        out[f"{c}_ms"] = 1e3 * spent[c] / len(steps) if steps else None
        out[f"{c}_share"] = spent[c] / norm if norm > 0 else None
    return out


class _TimedLinear:
    def __init__(self, linear, prof: StepProfile):
        self.inner, self.prof = linear, prof

    def _timed(self, fn, *args) -> torch.Tensor:
        start = self.prof.clock()
        y = fn(*args)
        self.prof.add("linear", self.prof.clock() - start)
        return y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._timed(self.inner, x)

    def after_norm(self, *args) -> torch.Tensor:
        return self._timed(self.inner.after_norm, *args)

    def after_silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._timed(self.inner.after_silu_and_mul, gate_up)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _TimedBackend:
    """Forwards every attribute to the backend; times prefill, decode, write_kv. The backend's own
    internal calls (prefill serving its decode rows through self.decode) are not counted twice."""

    def __init__(self, backend, prof: StepProfile):
        self.inner, self.prof = backend, prof

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        category = _ATTENTION_CALLS.get(name)
        if category is None:
            return attr

        def timed(*args, **kw):
            start = self.prof.clock()
            out = attr(*args, **kw)
            self.prof.add(category, self.prof.clock() - start)
            return out

        return timed


class _TimedStack:
    def __init__(self, stack, prof: StepProfile):
        self.inner, self.prof = stack, prof

    def run(self, *args) -> torch.Tensor:
        self.inner.timings = torch.zeros(len(TIMED_PHASES), dtype=torch.float64)
        start = self.prof.clock()
        try:
            out = self.inner.run(*args)
        finally:
            phases, self.inner.timings = self.inner.timings.tolist(), None
        seconds = self.prof.clock() - start
        for name, spent in zip(TIMED_PHASES, phases, strict=True):
            self.prof.add(_STACK_PHASES[name], spent)
        self.prof.add("stack", max(0.0, seconds - sum(phases)))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextmanager
def profiled(llm) -> Iterator[StepProfile]:
    """Times every engine step run inside the block (see the module docstring); restores the engine
    on exit, also when the block raises."""
    from swiftkv_fast.model.layers import Linear

    runner = engine.model_runner(llm)
    model = engine.swiftkv_model(llm)
    prof = StepProfile(sync=torch.cuda.synchronize if runner.device.type == "cuda" else None)
    restore: list[tuple[Any, str, Any]] = []  # (object, attribute, its own value or _UNSET)

    def wrap(obj: Any, name: str, value: Any) -> None:
        restore.append((obj, name, vars(obj).get(name, _UNSET)))
        setattr(obj, name, value)

    for holder in [model.w, *model.w.layers]:
        for name, value in list(vars(holder).items()):
            if isinstance(value, Linear):
                wrap(holder, name, _TimedLinear(value, prof))
    wrap(model, "backend", _TimedBackend(model.backend, prof))
    wrap(model, "stacks", tuple(None if s is None else _TimedStack(s, prof) for s in model.stacks))
    execute = runner.execute

    def timed_execute(out):
        prof._open = {}
        start = prof.clock()
        try:
            return execute(out)
        finally:
            seconds = prof.clock() - start
            decode = all(s.num_tokens == 1 for s in out.scheduled)
            prof.steps.append(_Step(seconds, decode, prof._open))
            prof._open = None

    wrap(runner, "execute", timed_execute)
    try:
        yield prof
    finally:
        for obj, name, value in reversed(restore):
            if value is _UNSET:  # an instance attribute shadowing a method: remove it
                delattr(obj, name)
            else:
                setattr(obj, name, value)
