"""One system in a process of its own, started with vLLM's venv: the worker `bench vllm` and the
`vllm-*` systems of `bench throughput` share.

`Worker` starts `python -m bench.vllm_worker IN_FD OUT_FD` with the venv's interpreter and talks to it
over two pipes, one JSON line per message: the job (a system, a dtype, a temperature) first, answered
once the system is built, with its start-up (and vLLM's compilation, part of it) timed apart; then one
call per line (token-id prompts and an output length), each answered with its result, timed in the
worker as the harness times a case (`bench.harness.timed`): seconds, token counts, per-request TTFT
and TPOT, every request's output tokens. The worker stays up between calls, so `bench throughput`
interleaves its rounds with this process's systems (A, B, A, B); `spawn` makes a list of calls in one.

Systems: `vllm` (plain vLLM on the embedded SmolLM2-135M-Instruct, compiled: its default),
`vllm-swiftkv` (vLLM with `swiftkv_vllm` on the demo's calibrated student, `kv_sharing_fast_prefill`
on), `ours-off` / `ours-on` (our engine on those two checkpoints, in the same venv).

CPU settings (../shared/anchors/vllm-plugin-facts.md): the KV space fixed, no reserved core, the engine
core in the worker's process, and Intel's OpenMP and tcmalloc preloaded where present (vLLM's CPU
install guide). vLLM binds its OpenMP threads (VLLM_CPU_OMP_THREADS_BIND) only in the worker processes
it starts itself, with multiprocessing on; with the engine in this process, the process starts with
the OpenMP settings vLLM gives such a worker for the same bind (vllm/utils/ompmultiprocessing.py):
one thread per listed core, each bound to its core.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from bench.harness import Sample

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = ROOT / ".nox" / "vllm" / "bin" / "python"  # the `vllm` nox session's venv
STUDENT_LAYERS = 15
SYSTEMS = ("vllm", "vllm-swiftkv", "ours-off", "ours-on")
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def torch_cores() -> list[int]:
    """The cores this process's torch runs on: the first torch.get_num_threads() of its affinity."""
    import torch

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return cores[: max(1, torch.get_num_threads())]


def worker_env(python: Path, system: str, cores: list[int]) -> dict[str, str]:
    """What the worker's process starts with, beyond this process's environment: `VLLM_ENV`, one
    OpenMP thread per core of `cores`, and for vLLM's systems the preloads and the threads' binding."""
    listed = ",".join(map(str, cores))
    env = VLLM_ENV | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env |= {"VLLM_CPU_OMP_THREADS_BIND": listed, "OMP_NUM_THREADS": str(len(cores))}
    if not system.startswith("vllm"):
        return env
    preload = _preload(python)
    if preload:
        env["LD_PRELOAD"] = ":".join(filter(None, [*preload, os.environ.get("LD_PRELOAD")]))
    if any("libiomp" in p for p in preload):
        env |= {
            "KMP_AFFINITY": f"granularity=fine,explicit,proclist=[{listed}]",
            "KMP_BLOCKTIME": "5",
            "KMP_TPAUSE": "0",
        }
    else:
        env |= {"OMP_PLACES": "{" + listed + "}", "OMP_PROC_BIND": "true"}
    return env


def _preload(python: Path) -> list[str]:
    """The libraries vLLM's CPU guide preloads: tcmalloc (from the system) and Intel's OpenMP (from the
    venv, where vLLM's CPU wheel installs it), each where present."""
    libs = Path("/usr/lib/x86_64-linux-gnu")
    tcmalloc = sorted(libs.glob("libtcmalloc_minimal.so*")) + sorted(libs.glob("libtcmalloc.so*"))
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    return [str(p) for p in tcmalloc[:1]] + ([str(iomp)] if iomp.exists() else [])


class WorkerError(RuntimeError):
    """The worker process ended before answering (its output, above, says why)."""


class Worker:
    """`system` in `dtype` in a worker process started with `python` (its threads on `cores`), up from
    construction (which waits for the build) until `close`. `info`: system, dtype, startup_s,
    compile_s, threads, vllm (version). `call` -> the call's Sample, timed in the worker."""

    def __init__(
        self, python: Path, system: str, dtype: str, cores: list[int], temperature: float = 0.0
    ) -> None:
        if system not in SYSTEMS:
            raise ValueError(f"unknown worker system {system!r}; choose from {SYSTEMS}")
        self.system = system
        to_worker, from_worker = os.pipe(), os.pipe()
        log.info("%s in %s: a process of its own (%s, cores %s)", system, dtype, python, cores)
        command = [str(python), "-m", "bench.vllm_worker", str(to_worker[0]), str(from_worker[1])]
        env = os.environ | worker_env(python, system, cores)
        self._process = subprocess.Popen(command, cwd=ROOT, env=env, pass_fds=(to_worker[0], from_worker[1]))
        os.close(to_worker[0])
        os.close(from_worker[1])
        self._send, self._receive = os.fdopen(to_worker[1], "w"), os.fdopen(from_worker[0])
        try:
            self._message(dict(system=system, dtype=dtype, temperature=temperature))
            self.info: dict[str, Any] = self._answer()
        except BaseException:
            self.close(kill=True)
            raise

    def call(self, prompts: list[list[int]], max_tokens: int) -> Sample:
        self._message({"prompts": prompts, "max_tokens": max_tokens})
        answer = self._answer()
        return Sample(answer.pop("seconds"), answer)

    def close(self, kill: bool = False) -> int:
        """End the worker: it exits when its input closes, and is killed if it is still up 60 s later
        (at once with `kill`, what an exception on this side does). Returns its exit status."""
        with contextlib.suppress(OSError):
            self._send.close()
        if kill:
            self._process.kill()
        try:
            status = self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            status = self._process.wait()
        self._receive.close()
        return status

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(kill=exc_type is not None)

    def _message(self, message: dict) -> None:
        try:
            self._send.write(json.dumps(message) + "\n")
            self._send.flush()
        except BrokenPipeError:
            self._fail()

    def _answer(self) -> dict[str, Any]:
        line = self._receive.readline()
        if not line:
            self._fail()
        return json.loads(line)

    def _fail(self) -> NoReturn:
        status = self._process.wait()
        raise WorkerError(f"the {self.system} worker exited with status {status} (its output is above)")


def spawn(
    python: Path,
    system: str,
    dtype: str,
    calls: list[tuple[list[list[int]], int]],
    cores: list[int],
    temperature: float = 0.0,
) -> dict[str, Any]:
    """Run `calls` ((prompts, max_tokens) each) on `system` in one worker; returns its `info` and
    `calls` (one dict per call: seconds and the call's metrics)."""
    with Worker(python, system, dtype, cores, temperature) as worker:
        samples = [worker.call(prompts, max_tokens) for prompts, max_tokens in calls]
    return worker.info | {"calls": [{"seconds": s.seconds, **s.metrics} for s in samples]}


def schedule(rounds: dict[str, tuple[list, list]], warmup: int, repeat: int) -> list:
    """A job's calls from each mix's (warm-up calls, one round's calls): per mix in order, the warm-up
    calls `warmup` times, then the round's calls `repeat` times."""
    return [c for warm, each in rounds.values() for c in warm * warmup + each * repeat]


def timed_rounds(result: dict, rounds: dict[str, tuple[list, list]], warmup: int, repeat: int) -> dict:
    """The inverse of `schedule` on a worker's result: {mix: [[each call's result] per timed round]},
    the warm-up calls dropped."""
    calls = iter(result["calls"])
    out = {}
    for mix, (warm, each) in rounds.items():
        for _ in range(warmup * len(warm)):
            next(calls)
        out[mix] = [[next(calls) for _ in each] for _ in range(repeat)]
    return out


def main(argv: list[str]) -> int:
    """The worker: `python -m bench.vllm_worker IN_FD OUT_FD` (the pipes `Worker` opened)."""
    import torch

    from bench.harness import timed

    with os.fdopen(int(argv[0])) as jobs, os.fdopen(int(argv[1]), "w") as answers:
        job = json.loads(jobs.readline())
        started = time.perf_counter()
        with _compile_clock(job["system"]) as compile_s:
            run = _build(job["system"], job["dtype"], job["temperature"])
        info = dict(
            system=job["system"],
            dtype=job["dtype"],
            startup_s=time.perf_counter() - started,
            compile_s=None if compile_s is None else sum(compile_s),
            threads=torch.get_num_threads(),
            vllm=_vllm_version(),
        )
        _answer(answers, info)
        for line in jobs:
            call = json.loads(line)
            sample = timed(lambda c=call: run(c["prompts"], c["max_tokens"]).metrics())
            _answer(answers, {"seconds": sample.seconds, **sample.metrics})
    return 0


def _answer(answers, message: dict) -> None:
    answers.write(json.dumps(message) + "\n")
    answers.flush()


def _checkpoint(system: str) -> str:
    from swiftkv_reference.default_model import default_model_dir

    if system in ("vllm", "ours-off"):
        return str(default_model_dir())
    from bench.demo import calibrated_student

    path, _, _ = calibrated_student(STUDENT_LAYERS, seed=0)
    return str(path)


def _build(system: str, dtype: str, temperature: float):
    """A function (prompts, max_tokens) -> engine.BatchResult, EOS ignored: greedy, or sampled at
    `temperature` with request i seeded with i."""
    from bench import engine

    path = _checkpoint(system)
    if not system.startswith("vllm"):
        llm = engine.build_llm(model=path, dtype=dtype)
        return lambda prompts, n: engine.run_batch(llm, prompts, n, temperature=temperature)
    from vllm import LLM, SamplingParams

    llm = LLM(
        path, dtype=dtype, max_model_len=2048, seed=0, disable_log_stats=False,
        kv_sharing_fast_prefill=system == "vllm-swiftkv", enable_prefix_caching=False,
    )  # fmt: skip

    def run(prompts, max_tokens):
        params = [
            SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                           seed=i if temperature else None)
            for i in range(len(prompts))
        ]  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return batch_result(outs)

    return run


def batch_result(outs) -> Any:
    """vLLM's RequestOutputs as an engine.BatchResult (TTFT from arrival, TPOT as vLLM's own: decode
    time over the tokens after the first)."""
    from bench.engine import BatchResult

    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    result = BatchResult(prompt_tokens, sum(len(o.outputs[0].token_ids) for o in outs))
    for o in outs:
        result.texts.append(o.outputs[0].text)
        result.token_ids.append(list(o.outputs[0].token_ids))
        m = o.metrics
        if m is None:
            continue
        result.ttft_s.append(m.first_token_latency)
        if m.num_generation_tokens > 1:
            result.tpot_s.append((m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1))
    return result


@contextlib.contextmanager
def _compile_clock(system: str):
    """Yields a list that gets the seconds of each of vLLM's torch.compile windows opened meanwhile
    (vllm/compilation/monitor.py's `monitor_torch_compile`, which adds them to vLLM's own compilation
    time only in its VLLM_COMPILE mode, not in the CPU build's DYNAMO_TRACE_ONCE); None for our engine,
    or where vLLM has no such function."""
    if not system.startswith("vllm"):
        yield None
        return
    from vllm.compilation import decorators

    original = getattr(decorators, "monitor_torch_compile", None)
    if original is None:
        yield None
        return
    spent: list[float] = []

    @contextlib.contextmanager
    def clocked(*args, **kwargs):
        start = time.perf_counter()
        with original(*args, **kwargs):
            yield
        spent.append(time.perf_counter() - start)

    decorators.monitor_torch_compile = clocked
    try:
        yield spent
    finally:
        decorators.monitor_torch_compile = original


def _vllm_version() -> str | None:
    vllm = sys.modules.get("vllm")
    return None if vllm is None else vllm.__version__


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main(sys.argv[1:]))
