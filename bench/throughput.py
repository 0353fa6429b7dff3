"""The fast engine against Hugging Face transformers (and vLLM, on request) on the same model, prompts and
sampling settings.

Systems: the fast engine with SwiftKV off (L = N) and on (L = N/2), transformers' `generate` (one
static batch, left padding) and `generate_batch` (its continuous batching, where installed), all
fp32 with the embedded model's weights; and the GEMM floor of the engine's workload at L = N and
L = N/2 (bench/gemm_floor.py: its linear layers alone): its "x hf-generate" is the highest speedup
over transformers that any engine can reach on this machine's fp32 GEMM. On request (`--systems`), the
engine over a bf16 KV cache too (`fast-off-kv-bf16`, `fast-on-kv-bf16`: kv_cache_dtype="bfloat16"), the
engine in bf16 (`fast-off-bf16`, `fast-on-bf16`: dtype="bfloat16"; on a CPU without bf16 units its bf16
weights and KV cache are multiplied in fp32, EngineConfig.compute_dtype), and
the engine with every weight kept in fp32 (`fast-off-fp32-weights`, `fast-on-fp32-weights`: built with
SWIFTKV_DISABLED_KERNELS=gemm-4bit, so 4-bit weights get neither 4-bit panels nor q4-amx). With the
floors, the table notes each floor plus attention's irreducible work (bench/attention_floor.py), every engine
system's share of it, and the largest share of the GEMM floor's ratio any engine can reach (the floor's
time over that sum's: an engine's share of the floor is the floor's time over its own).

`vllm-fp32`, `vllm-bf16` (`--systems`): vLLM's CPU build on the embedded model (compiled, its default;
prefix caching off) in fp32 / bf16, each in a process of its own started with the vLLM venv's Python
(`--vllm-python`, default `.nox/vllm/bin/python`: `nox -s vllm` builds it; skipped, saying why, where it
is missing) by bench/vllm_worker.py: vLLM's KV space fixed, no reserved core, its engine core in that
process, one OpenMP thread bound to each core torch uses here (`--threads`: the same thread count).
It gets the same token-id prompts, output length, greedy decoding with EOS ignored, warm-up and rounds,
and its rows the same keys; its start-up and compilation are timed apart (`startup_s`, `compile_s`),
not counted. The worker stays up between its calls, so its rounds interleave with the others' (A, B,
A, B), each timed in its own process, and "x vLLM" is each engine system's output tok/s over the vLLM
system of the same precision's, round by round. At temperature 0, each vLLM system's share of
requests whose tokens equal fast-off's (`tokens_identical_to_fast_off`; vllm-fp32 should match, bf16
rounds otherwise) is noted, not enforced.

Mixes (request count x prompt length -> output length):

  issue4          16 x 256 -> 64              the issue-4 scenario
  prefill-heavy   16 x ~640 -> 64             prompt:output about 10:1 (SwiftKV paper's enterprise mix)
  decode-heavy    16 x ~64 -> 256             prompt:output 1:4

"~" lengths are drawn uniformly within +-25% (so static batching pays its padding). Keys follow
vLLM's `bench throughput` (requests_per_second, tokens_per_second, output_tokens_per_second) and
`bench latency` (mean/median/p99 of ttft_ms and tpot_ms, pooled over rounds).

`--temperature T` samples instead of decoding greedily: every system at temperature T, no top-k or
top-p, the engine's requests seeded one by one (vLLM's per-request `seed`, drawn the way the reference
draws: kernels/cpu_sample.py), transformers with `do_sample=True`. The GEMM floor does not sample.

`--profile`: after the timed rounds, one more run of each engine system (fast-off, fast-on) with
timers around its linear layers and attention calls (bench/step_profile.py), reported as the share
of a step's time in each (every step, and decode steps alone) in a table and in each row's
`step_profile`. The timed rounds run without timers.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

from bench import attention_floor, engine, gemm_floor, hf_baseline, report, step_profile, vllm_worker
from bench.harness import Sample, Stats, paired_ratio, run_interleaved

log = logging.getLogger(__name__)

HELP = "fast engine (SwiftKV off/on) vs transformers generate / generate_batch and vLLM: tok/s, TTFT, TPOT"
# name: (num_requests, mean prompt len, output len, length jitter)
MIXES = {
    "issue4": (16, 256, 64, 0.0),
    "prefill-heavy": (16, 640, 64, 0.25),
    "decode-heavy": (16, 64, 256, 0.25),
}
QUICK_MIXES = {
    "issue4": (4, 64, 8, 0.0),
    "prefill-heavy": (4, 160, 16, 0.25),
    "decode-heavy": (4, 16, 32, 0.25),
}
DEFAULT_SYSTEMS = [
    "fast-off",
    "fast-on",
    "hf-generate",
    "hf-generate-batch",
    "gemm-floor-off",
    "gemm-floor-on",
]
# the engine over a bf16 KV cache (kv_cache_dtype="bfloat16"): half the bytes decode attention reads
KV_BF16_SYSTEMS = {"fast-off-kv-bf16": "fast-off", "fast-on-kv-bf16": "fast-on"}
# the engine with its weights in fp32 layouts only (SWIFTKV_DISABLED_KERNELS=gemm-4bit): the 4-bit
# layouts' gain
FP32_WEIGHTS_SYSTEMS = {"fast-off-fp32-weights": "fast-off", "fast-on-fp32-weights": "fast-on"}
# the engine in bf16 (dtype="bfloat16": bf16 weights and KV cache; bf16 products where the CPU has bf16
# units, fp32 ones where it has none, EngineConfig.compute_dtype), the peer of vllm-bf16
BF16_SYSTEMS = {"fast-off-bf16": "fast-off", "fast-on-bf16": "fast-on"}
# every such variant: name -> (the engine system it varies, its build kwargs, its environment at build)
VARIANT_SYSTEMS = {
    **{name: (base, {"kv_cache_dtype": "bfloat16"}, {}) for name, base in KV_BF16_SYSTEMS.items()},
    **{name: (base, {"dtype": "bfloat16"}, {}) for name, base in BF16_SYSTEMS.items()},
    **{
        name: (base, {}, {"SWIFTKV_DISABLED_KERNELS": "gemm-4bit"})
        for name, base in FP32_WEIGHTS_SYSTEMS.items()
    },
}
# vLLM's CPU build in a process of its own (bench/vllm_worker.py): name -> its dtype
VLLM_SYSTEMS = {"vllm-fp32": "float32", "vllm-bf16": "bfloat16"}
SYSTEMS = [*DEFAULT_SYSTEMS, *VARIANT_SYSTEMS, *VLLM_SYSTEMS]
BASELINE = "hf-generate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixes", type=lambda s: s.split(","), help=f"comma-separated, from {list(MIXES)}")
    parser.add_argument(
        "--systems",
        type=lambda s: s.split(","),
        help=f"comma-separated, from {SYSTEMS} (default: {','.join(DEFAULT_SYSTEMS)})",
    )
    parser.add_argument(
        "--temperature",
        type=_temperature,
        default=0.0,
        help="sample at this temperature (seeded per request) instead of greedy decoding (default 0: greedy)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more run of each engine system, timing its linear layers, attention and the rest per step",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=vllm_worker.DEFAULT_PYTHON,
        help="the Python of a venv with vLLM's CPU build, for the vllm-* systems (default: the `vllm` nox "
        "session's venv, .nox/vllm/bin/python)",
    )


def _temperature(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"--temperature must be a finite number >= 0, got {text}")
    return value


def mix_prompts(mix: tuple, vocab_size: int, seed: int) -> tuple[list[list[int]], int]:
    num, mean_len, output_len, jitter = mix
    rng = random.Random(seed)
    lengths = [max(1, round(mean_len * (1 + rng.uniform(-jitter, jitter)))) for _ in range(num)]
    prompts = [
        engine.random_prompts(1, n, vocab_size, seed=seed * 1000 + i)[0] for i, n in enumerate(lengths)
    ]
    return prompts, output_len


def run(args: argparse.Namespace) -> int:
    table_of = QUICK_MIXES if args.quick else MIXES
    mixes = args.mixes or list(table_of)
    systems = args.systems or DEFAULT_SYSTEMS
    repeat = args.repeat or 3
    warmup = 1 if args.warmup is None else args.warmup

    runners = _systems(systems, args.temperature)
    peak = gemm_floor.peak_gflops() if runners.floor_llms else {}
    # at matmul precision "high" the floor may multiply on AMX tiles (bf16x3): fp32 FMAs bound nothing
    fp32_only = engine.matmul_precision() == "highest"
    fma_peak = gemm_floor.fma_peak_gflops() if runners.floor_llms and fp32_only else None
    # nor do they where a linear of an exact form multiplies on AMX tiles (exact products)
    fma_bounds_gemms = not _exact_amx()
    read_gbps = attention_floor.read_gbps() if fma_peak else None
    plans = {name: mix_prompts(table_of[name], runners.vocab_size, args.seed) for name in mixes}
    with contextlib.ExitStack() as workers:
        peers, skipped = vllm_workers(systems, args.vllm_python, args.temperature, workers)
        skipped = runners.skipped | skipped
        for name, why in skipped.items():
            print(f"skipping {name}: {why}")
        available = [s for s in systems if s in runners.fns or s in peers]
        samples_of = {}
        for name in mixes:
            prompts, output_len = plans[name]
            cases = {s: _case(runners.get(s), prompts, output_len) for s in runners.available}
            warm = {s: _case(runners.get(s), *stand_in(prompts)) for s in runners.available}
            cases |= {s: _peer_case(w, prompts, output_len) for s, w in peers.items()}
            warm |= {s: _peer_case(w, *stand_in(prompts)) for s, w in peers.items()}
            cases = {s: cases[s] for s in available}
            print(
                f"mix {name}: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
                f"{output_len} output tokens each; systems {list(cases)}"
            )
            samples_of[name] = run_interleaved(
                cases, repeat=repeat, warmup=warmup, warmup_cases=warm, progress=True
            )
    tables, rows = [], []
    for name in mixes:
        prompts, output_len = plans[name]
        samples = samples_of[name]
        mix_rows = [summarize(name, s, samples[s]) for s in available]
        _peer_rows(mix_rows, {s: w.info for s, w in peers.items()}, samples, greedy=args.temperature == 0)
        _vs_vllm(mix_rows, samples)
        for row in mix_rows:
            if row["system"] in runners.floor_llms:
                flops = gemm_floor.workload_flops(runners.floor_llms[row["system"]], prompts, output_len)
                row["flops"] = flops
                row["gflops_per_second"] = Stats.of([flops / x.seconds / 1e9 for x in samples[row["system"]]])
        if BASELINE in samples:
            base = samples[BASELINE]
            for row in mix_rows:
                if "flops" in row and fma_peak and fma_bounds_gemms:
                    # the floor's products at the FMA peak: no fp32 engine can finish sooner here
                    row["hardware_seconds"] = row["flops"] / fma_peak / 1e9
                    row["hardware_ceiling_vs_hf_generate"] = Stats.of(
                        [x.seconds / row["hardware_seconds"] for x in base]
                    )
                if "flops" in row and fma_peak:
                    work = (runners.floor_llms[row["system"]], prompts, output_len)
                    row["attention_floor"] = _attention_floor(
                        samples[row["system"]], base, work, read_gbps, fma_peak
                    )
            for row in mix_rows:
                row["output_tps_vs_hf_generate"] = paired_ratio(
                    [x.metrics["output_tokens"] / x.seconds for x in samples[row["system"]]],
                    [x.metrics["output_tokens"] / x.seconds for x in base],
                )
        rows += mix_rows
        tables.append(_table(name, table_of[name], mix_rows, repeat, peak, fma_peak, args.temperature))
        if args.profile:
            for row in mix_rows:
                if row["system"] in runners.llms:
                    llm = runners.llms[row["system"]]
                    row["step_profile"] = profile_run(llm, prompts, output_len, args.temperature)
            tables.append(_profile_table(name, mix_rows))
    settings = {
        "mixes": {
            m: dict(zip(["num_requests", "prompt_len", "output_len", "jitter"], table_of[m])) for m in mixes
        },
        "systems": available,
        "skipped": skipped,
        "repeat": repeat,
        "warmup": warmup,
        "num_key_value_layers_on": runners.on_layers,
        "dtype": "float32",
        "temperature": args.temperature,
        "seed": args.seed,
        "profile": args.profile,
        "peak_gemm_gflops": peak,
        "peak_fma_gflops": fma_peak,
    }
    if any(s in VLLM_SYSTEMS for s in systems):
        cores = vllm_worker.torch_cores()
        env = vllm_worker.worker_env(args.vllm_python, "vllm", cores)
        settings["vllm"] = {"python": args.vllm_python, "cores": cores, "worker_env": env}
    json_path = report.write_json(args.out, "throughput", settings, rows)
    png_path = plot(rows, mixes, available, args.out)
    report.finish(tables, [json_path, png_path])
    return 0


class _Systems:
    """Builds each system once; `get(name)` -> a function(prompts, output_len) -> BatchResult."""

    def __init__(self, wanted: list[str], temperature: float) -> None:
        self.skipped: dict[str, str] = {}
        self.fns: dict[str, Callable] = {}
        self.llms: dict[str, Any] = {}  # the engine systems' LLMs (what --profile instruments)
        self.floor_llms: dict[str, Any] = {}  # the GEMM floor systems' LLMs (whose linears they replay)
        off = engine.build_llm(None)
        self.vocab_size = off.config.vocab_size
        self.on_layers = off.config.num_hidden_layers // 2
        if "fast-off" in wanted:
            self.fns["fast-off"] = lambda p, n: engine.run_batch(off, p, n, temperature=temperature)
            self.llms["fast-off"] = off
        if "gemm-floor-off" in wanted:
            self.fns["gemm-floor-off"] = lambda p, n: gemm_floor.run(off, p, n)
            self.floor_llms["gemm-floor-off"] = off
        if {"fast-on", "gemm-floor-on"} & set(wanted):
            on = engine.build_llm(self.on_layers)
            if "fast-on" in wanted:
                self.fns["fast-on"] = lambda p, n: engine.run_batch(on, p, n, temperature=temperature)
                self.llms["fast-on"] = on
            if "gemm-floor-on" in wanted:
                self.fns["gemm-floor-on"] = lambda p, n: gemm_floor.run(on, p, n)
                self.floor_llms["gemm-floor-on"] = on
        for name in [s for s in VARIANT_SYSTEMS if s in wanted]:
            base, kwargs, env = VARIANT_SYSTEMS[name]
            with mock.patch.dict(os.environ, env):  # what the engine reads while it chooses its layouts
                llm = engine.build_llm(self.on_layers if base == "fast-on" else None, **kwargs)
            self.fns[name] = lambda p, n, llm=llm: engine.run_batch(llm, p, n, temperature=temperature)
            self.llms[name] = llm
        if {"hf-generate", "hf-generate-batch"} & set(wanted):
            from swiftkv_reference.default_model import default_model_dir

            model = hf_baseline.load_model(default_model_dir())
            if "hf-generate" in wanted:
                self.fns["hf-generate"] = lambda p, n: hf_baseline.generate(
                    model, p, n, temperature=temperature
                )
            if "hf-generate-batch" in wanted:
                if hf_baseline.has_generate_batch(model):
                    self.fns["hf-generate-batch"] = lambda p, n: hf_baseline.generate_batch(
                        model, p, n, temperature=temperature
                    )
                else:
                    self.skipped["hf-generate-batch"] = "this transformers has no generate_batch"
        self.available = [s for s in wanted if s in self.fns]

    def get(self, name: str) -> Callable:
        return self.fns[name]


def stand_in(prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """A warm-up's cheaper stand-in for a mix: its first two prompts' first 16 tokens, 2 tokens each."""
    return [p[:16] for p in prompts[:2]], 2


# what a vllm-* row adds to the rows' keys: its worker's start-up, compilation, threads, vLLM version
VLLM_ROW_KEYS = ("dtype", "startup_s", "compile_s", "threads", "vllm")


def vllm_workers(
    wanted: list[str], python: Path, temperature: float, stack: contextlib.ExitStack
) -> tuple[dict[str, vllm_worker.Worker], dict[str, str]]:
    """A worker process (bench/vllm_worker.py) for each vllm-* system of `wanted`, started and built
    before any round, closed with `stack`: ({system: its worker}, {system: why it was skipped})."""
    names = [s for s in wanted if s in VLLM_SYSTEMS]
    if names and not python.exists():
        why = f"no vLLM Python at {python} (--vllm-python; `nox -s vllm --install-only` builds one)"
        return {}, {s: why for s in names}
    cores = vllm_worker.torch_cores()
    peers, skipped = {}, {}
    for name in names:
        try:
            worker = vllm_worker.Worker(python, "vllm", VLLM_SYSTEMS[name], cores, temperature)
        except vllm_worker.WorkerError as e:
            skipped[name] = str(e)
            continue
        peers[name] = stack.enter_context(worker)
    return peers, skipped


def vllm_peer_of(system: str) -> str | None:
    """The vllm-* system an engine system is held to: vllm-bf16 for the bf16 engine, vllm-fp32 for the
    others (fp32 weights and activations); None for the systems that are not our engine."""
    if system in BF16_SYSTEMS:
        return "vllm-bf16"
    engine_systems = ("fast-off", "fast-on", *VARIANT_SYSTEMS)
    return "vllm-fp32" if system in engine_systems else None


def _vs_vllm(rows: list[dict], samples: dict[str, list[Sample]]) -> None:
    """Each engine row's output tok/s over its vLLM peer's (`vllm_peer_of`), round by round: the
    rounds are interleaved, so round i of both ran side by side."""
    for row in rows:
        peer = vllm_peer_of(row["system"])
        if peer in samples:
            row["output_tps_vs_vllm"] = paired_ratio(
                [x.metrics["output_tokens"] / x.seconds for x in samples[row["system"]]],
                [x.metrics["output_tokens"] / x.seconds for x in samples[peer]],
            )
            row["vllm_peer"] = peer


def _peer_case(worker: vllm_worker.Worker, prompts: list[list[int]], output_len: int):
    def call() -> Sample:
        return worker.call(prompts, output_len)

    return call


def _peer_rows(rows: list[dict], peers: dict[str, dict], samples: dict[str, list], greedy: bool) -> None:
    """The vllm-* rows' worker facts (VLLM_ROW_KEYS, from each worker's `info`) and, decoding greedily
    beside fast-off, their share of requests whose output tokens (last round) equal fast-off's; a
    warning where vllm-fp32's differ."""
    ref = samples["fast-off"][-1].metrics["token_ids"] if greedy and "fast-off" in samples else None
    for row in rows:
        if row["system"] not in peers:
            continue
        row.update({k: peers[row["system"]][k] for k in VLLM_ROW_KEYS})
        if ref:
            got = samples[row["system"]][-1].metrics["token_ids"]
            same = sum(a == b for a, b in zip(got, ref))
            row["tokens_identical_to_fast_off"] = same / len(ref)
            if row["system"] == "vllm-fp32" and same < len(ref):
                log.warning("vllm-fp32: %d of %d requests' greedy tokens differ from fast-off's",
                            len(ref) - same, len(ref))  # fmt: skip


def _exact_amx() -> bool:
    """Some linear built in this process multiplies weights of an exact form on AMX tiles (the kernels
    named "*-amx": q4-amx, panel-amx, bf16-amx)."""
    plans = engine.linear_kernels()["linear_kernels"].values()
    return any(word.endswith("-amx") for plan in plans for word in plan.replace(",", " ").split())


def _systems(wanted: list[str], temperature: float = 0.0) -> _Systems:
    unknown = set(wanted) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    return _Systems(wanted, temperature)


# the engine systems measured against each GEMM floor, and the KV cache's bytes per value they read
FLOOR_OF = {
    "fast-off": ("gemm-floor-off", "fp32"),
    "fast-on": ("gemm-floor-on", "fp32"),
    "fast-off-kv-bf16": ("gemm-floor-off", "bf16"),
    "fast-on-kv-bf16": ("gemm-floor-on", "bf16"),
}


def _attention_floor(floor_samples, base, work, gbps: float, fma_peak: float) -> dict[str, Any]:
    """The GEMM floor plus attention's irreducible work (bench/attention_floor.py) for `work` (llm,
    prompts, output_len), with an fp32 and with a bf16 KV cache, each with its x hf-generate."""
    gemm_seconds = statistics.median(x.seconds for x in floor_samples)
    out: dict[str, Any] = {"read_gbps": gbps, "fma_peak_gflops": fma_peak}
    for kv, element_bytes in (("fp32", 4), ("bf16", 2)):
        floor = attention_floor.floor_seconds(
            gemm_seconds, *work, element_bytes=element_bytes, gbps=gbps, fma_gflops=fma_peak
        )
        floor["vs_hf_generate"] = Stats.of([x.seconds / floor["seconds"] for x in base])
        # an engine's share of the GEMM floor's ratio is floor time / its own time, and its own time is
        # at least this floor's: the largest share any engine can reach here
        floor["most_of_gemm_floor"] = gemm_seconds / floor["seconds"]
        out[kv] = floor
    return out


def _case(fn, prompts, output_len):
    def call():
        return fn(prompts, output_len).metrics()

    return call


def profile_run(llm, prompts: list[list[int]], output_len: int, temperature: float = 0.0) -> dict[str, Any]:
    """One run of the workload with step timers (bench/step_profile.py): StepProfile.summary()."""
    with step_profile.profiled(llm) as prof:
        start = time.perf_counter()
        engine.run_batch(llm, prompts, output_len, temperature=temperature)
        wall = time.perf_counter() - start
    return prof.summary(wall)


def _profile_table(name: str, rows: list[dict]) -> report.Table:
    t = report.Table(
        f"Step profile, mix {name}: share of a step's time (one profiled run per engine system)",
        ["system", "steps", "ms/step", "linear", "attention", "kv write", "stack", "rest"],
    )
    for r in rows:
        prof = r.get("step_profile")
        if prof is None:
            continue
        for kind in ("all", "decode"):
            p = prof[kind]
            shares = [
                None if p[f"{c}_share"] is None else f"{100 * p[f'{c}_share']:.0f}%"
                for c in step_profile.CATEGORIES
            ]
            t.add(f"{r['system']} ({kind} steps)", p["steps"], p["step_ms"], *shares)
    t.notes.append(
        "linear: every Linear (GEMMs); attention: the backend's prefill + decode calls (first and second "
        "half); kv write: write_kv; the decode stacks (a half's layers over decode rows as one C call, "
        "model/decode_stack.py) time their GEMMs, attention and RoPE + KV writes inside and add them to "
        "those columns; stack: the stacks' own rest (the call, its checks, buffers); rest: norms, RoPE, "
        "residuals, sampling, batch building."
    )
    return t


def _percentiles(values_s: list[float], prefix: str) -> dict[str, float | None]:
    if not values_s:
        return {f"mean_{prefix}_ms": None, f"median_{prefix}_ms": None, f"p99_{prefix}_ms": None}
    ms = sorted(v * 1000 for v in values_s)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {
        f"mean_{prefix}_ms": statistics.fmean(ms),
        f"median_{prefix}_ms": statistics.median(ms),
        f"p99_{prefix}_ms": p99,
    }


def summarize(mix: str, system: str, samples: list[Sample]) -> dict:
    """vLLM's throughput and latency keys, from every round of one system on one mix."""
    num = len(samples[0].metrics["ttft_s"]) or None
    row = {
        "mix": mix,
        "system": system,
        "num_requests": num,
        "elapsed_time": Stats.of([s.seconds for s in samples]),
        "total_num_tokens": samples[0].metrics["prompt_tokens"] + samples[0].metrics["output_tokens"],
        "total_output_tokens": samples[0].metrics["output_tokens"],
    }
    row["requests_per_second"] = Stats.of([num / s.seconds for s in samples]) if num else None
    row["tokens_per_second"] = Stats.of(
        [(s.metrics["prompt_tokens"] + s.metrics["output_tokens"]) / s.seconds for s in samples]
    )
    row["output_tokens_per_second"] = Stats.of([s.metrics["output_tokens"] / s.seconds for s in samples])
    row.update(_percentiles([t for s in samples for t in s.metrics["ttft_s"]], "ttft"))
    row.update(_percentiles([t for s in samples for t in s.metrics["tpot_s"]], "tpot"))
    return row


def _table(
    name: str,
    mix: tuple,
    rows: list[dict],
    repeat: int,
    peak: dict[str, float],
    fma_peak: float | None,
    temperature: float = 0.0,
) -> report.Table:
    num, mean_len, output_len, jitter = mix
    length = f"~{mean_len}" if jitter else str(mean_len)
    decoding = "greedy" if temperature == 0 else f"sampled at temperature {temperature:g}"
    t = report.Table(
        f"Throughput, mix {name}: {num} requests x {length} prompt tokens -> {output_len} output tokens, "
        f"fp32 (vllm-bf16 and *-bf16: bf16), {decoding}, {repeat} round(s)",
        [
            "system",
            "req/s",
            "total tok/s",
            "output tok/s",
            "x hf-generate",
            "x vLLM",
            "TTFT ms mean/med/p99",
            "TPOT ms mean/med/p99",
        ],
    )
    for r in rows:
        ratio, vs_vllm = r.get("output_tps_vs_hf_generate"), r.get("output_tps_vs_vllm")
        t.add(
            r["system"],
            r["requests_per_second"].median if r["requests_per_second"] else None,
            r["tokens_per_second"],
            r["output_tokens_per_second"],
            f"{ratio.median:.2f}x" if ratio else None,
            f"{vs_vllm.median:.2f}x {r['vllm_peer'].removeprefix('vllm-')}" if vs_vllm else None,
            _lat(r, "ttft"),
            _lat(r, "tpot"),
        )
    t.notes.append(
        "fast-on: SwiftKV converted on the fly (no distillation): speed, not quality. "
        "x hf-generate: output tok/s ratio, round by round; x vLLM: the same over the vllm-* system of "
        "the same precision (fp32, or bf16 for *-bf16)."
    )
    if any(r["system"] in FP32_WEIGHTS_SYSTEMS for r in rows):
        t.notes.append(
            "*-fp32-weights: the same engine with every weight in fp32 layouts "
            "(SWIFTKV_DISABLED_KERNELS=gemm-4bit): no 4-bit panels, no q4-amx; the same fp32 numbers."
        )
    if any(r["system"] in KV_BF16_SYSTEMS for r in rows):
        t.notes.append(
            "*-kv-bf16: the same engine with kv_cache_dtype='bfloat16' (K/V rounded to bf16, read back as "
            "fp32): half the KV cache's bytes, other numerics than the fp32 systems."
        )
    if any(r["system"].startswith("gemm-floor") for r in rows):
        t.notes.append(
            "gemm-floor-off/on: only the engine's fp32 linear layers for this workload (same weights, "
            "shapes and chunking): the fastest any engine can be here; its x hf-generate is the ceiling."
        )
    for r in rows:
        if "gflops_per_second" in r and peak:
            best = max(peak, key=peak.get)
            rate = r["gflops_per_second"].median
            share = 100 * rate / peak[best]
            precision = engine.matmul_precision()
            four_bit = ""
            if _exact_amx():
                four_bit = " on arbitrary fp32 weights; the AMX kernels for exact-form weights are not in it"
            t.notes.append(
                f"{r['system']}: {r['flops'] / 1e9:.0f} GFLOP at {rate:.0f} GFLOP/s, {share:.0f}% of this "
                f"machine's GEMM peak at float32 matmul precision {precision!r} ({peak[best]:.0f} GFLOP/s: "
                f"2048^3 through {best}){four_bit}."
            )
        if "hardware_ceiling_vs_hf_generate" in r:
            t.notes.append(
                f"{r['system']} at this machine's fp32 FMA peak ({fma_peak:.0f} GFLOP/s: vector FMAs on "
                f"registers, every thread) would take {r['hardware_seconds']:.1f} s: "
                f"{r['hardware_ceiling_vs_hf_generate'].median:.2f}x hf-generate, the hardware's ceiling "
                "for any fp32 engine computing these products."
            )
    t.notes += _attention_floor_notes(rows)
    t.notes += _vllm_notes(rows)
    return t


def _vllm_notes(rows: list[dict]) -> list[str]:
    """What the vllm-* rows are, their start-up, and their tokens against fast-off's."""
    peers = [r for r in rows if r["system"] in VLLM_SYSTEMS]
    if not peers:
        return []
    notes = [
        f"vllm-fp32 / vllm-bf16: vLLM {peers[0]['vllm']}'s CPU build, compiled, in fp32 / bf16, each in a "
        f"process of its own with {peers[0]['threads']} OpenMP thread(s) bound to torch's cores here; its "
        "rounds interleaved with the others', each timed in its own process."
    ]
    for r in peers:
        compile_s = f", compilation {r['compile_s']:.0f} s of it" if r.get("compile_s") else ""
        line = f"{r['system']}: start-up {r['startup_s']:.0f} s{compile_s}, not counted"
        share = r.get("tokens_identical_to_fast_off")
        if share is not None:
            expected = "expected: all" if r["system"] == "vllm-fp32" else "bf16 rounds otherwise"
            line += f"; greedy tokens identical to fast-off's for {100 * share:.0f}% of requests ({expected})"
        notes.append(line + ".")
    return notes


def _attention_floor_notes(rows: list[dict]) -> list[str]:
    """One note per GEMM floor with attention's irreducible work added, and each engine system's share
    of the floor it is measured against (its x hf-generate over the floor's)."""
    by_system = {r["system"]: r for r in rows}
    notes = []
    for r in rows:
        floors = r.get("attention_floor")
        if not floors:
            continue
        parts = []
        for kv in ("fp32", "bf16"):
            f = floors[kv]
            engines = [
                e
                for e, (floor, kind) in FLOOR_OF.items()
                if floor == r["system"]
                and kind == kv
                and by_system.get(e, {}).get("output_tps_vs_hf_generate")
            ]
            floor_ratio = f["vs_hf_generate"].median
            shares = ", ".join(
                f"{e} at {100 * by_system[e]['output_tps_vs_hf_generate'].median / floor_ratio:.0f}%"
                for e in engines
            )
            parts.append(
                f"{kv} KV cache ({f['kv_read_bytes'] / 1e9:.1f} GB read): {f['seconds']:.1f} s, "
                f"{f['vs_hf_generate'].median:.2f}x hf-generate"
                + (f" ({shares} of it)" if shares else "")
                + f", so no engine passes {100 * f['most_of_gemm_floor']:.0f}% of {r['system']}"
            )
        notes.append(
            f"{r['system']} + attention's irreducible work (every decode step's K/V read once at "
            f"{floors['read_gbps']:.0f} GB/s, a sequential sum's rate; causal prompt attention "
            f"({floors['fp32']['prompt_attention_flops'] / 1e9:.0f} GFLOP) at the FMA peak): "
            + "; ".join(parts)
            + "."
        )
    return notes


def _lat(row: dict, key: str) -> str:
    vals = [row[f"{k}_{key}_ms"] for k in ("mean", "median", "p99")]
    return "-" if vals[0] is None else "/".join(f"{v:.0f}" for v in vals)


@report.optional_plot
def plot(rows: list[dict], mixes: list[str], systems: list[str], out: Path) -> Path:
    fig, axes = report.new_figure(ncols=len(mixes), width=4.2)
    for ax, mix in zip(axes, mixes):
        mine = {r["system"]: r for r in rows if r["mix"] == mix}
        names = [s for s in systems if s in mine]
        report.bars(ax, names, [mine[s]["output_tokens_per_second"] for s in names])
        ax.set_title(mix)
        ax.set_ylabel("output tokens/s")
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle("SmolLM2-135M-Instruct (fp32 unless named bf16)")
    return report.save_figure(fig, out, "throughput")
