"""Implementation selection for the conformance suite (narwhals-style `--impl`, array-api-tests-style header).

    pytest conformance                          every implementation; those that cannot run here are skipped
    pytest conformance --impl=fast-torch        one implementation (comma list; "all"; "gpu")
    pytest conformance --impl=gpu --dtype=bfloat16   the GPU implementations in bf16 (nox -s gpu)

Default for --impl: $SWIFTKV_IMPL, else "all".
"""

from __future__ import annotations

import os

import torch

# The Triton interpreter must be chosen before any @triton.jit kernel is defined, i.e. before
# swiftkv_fast's kernels are imported. This conftest is imported before every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from .adapters import GPU_IMPLEMENTATIONS, IMPLEMENTATIONS  # noqa: E402
from .adapters.base import env_snapshot  # noqa: E402
from .cases import Workbench  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("swiftkv conformance")
    group.addoption(
        "--impl",
        default=os.environ.get("SWIFTKV_IMPL", "all"),
        help=f"comma list of implementations: {', '.join(IMPLEMENTATIONS)}; 'all'; 'gpu' "
        f"(= {', '.join(GPU_IMPLEMENTATIONS)}). Default: $SWIFTKV_IMPL or all.",
    )
    group.addoption(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="dtype of the implementations under test (the reference oracle is always fp32). "
        "float32: logits within 1e-4 and equal greedy tokens; bf16/fp16: vLLM's top-5 rule.",
    )


def selected_impls(config: pytest.Config) -> list[str]:
    names: list[str] = []
    for item in str(config.getoption("--impl")).split(","):
        item = item.strip()
        if not item:
            continue
        if item == "all":
            names += list(IMPLEMENTATIONS)
        elif item == "gpu":
            names += GPU_IMPLEMENTATIONS
        elif item in IMPLEMENTATIONS:
            names.append(item)
        else:
            raise pytest.UsageError(
                f"--impl: unknown implementation {item!r}; known: {', '.join(IMPLEMENTATIONS)}, all, gpu"
            )
    return list(dict.fromkeys(names))


def _dtype(config: pytest.Config) -> torch.dtype:
    return DTYPES[config.getoption("--dtype")]


def pytest_configure(config: pytest.Config) -> None:
    selected_impls(config)  # a bad --impl is a usage error before collection
    config.addinivalue_line("markers", "impl_only(*names): run this test only for these implementations")
    config.addinivalue_line(
        "markers", "engine: a test of scheduling knobs (only implementations with an engine)"
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    dtype = _dtype(config)
    lines = [
        f"swiftkv conformance: --impl={config.getoption('--impl')} --dtype={config.getoption('--dtype')}"
    ]
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    lines.append(f"  torch {torch.__version__}, CUDA device: {cuda}")
    for name in selected_impls(config):
        cls = IMPLEMENTATIONS[name]
        ok, why = cls.available()
        impl = cls(dtype)
        status = "available" if ok else f"SKIPPED: {why}"
        lines.append(f"  {impl.describe()}  [{status}]")
    env = env_snapshot()
    lines.append(
        "  env: " + (", ".join(f"{k}={v}" for k, v in env.items()) or "(none of the relevant variables set)")
    )
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl_name" in metafunc.fixturenames:
        names = selected_impls(metafunc.config)
        marker = metafunc.definition.get_closest_marker("impl_only")
        if marker is not None:
            names = [n for n in names if n in marker.args]
        if metafunc.definition.get_closest_marker("engine") is not None:  # not applicable to the reference
            names = [n for n in names if IMPLEMENTATIONS[n].has_engine]
        metafunc.parametrize("impl_name", names, ids=names, scope="session")


@pytest.fixture(scope="session")
def dtype(pytestconfig: pytest.Config) -> torch.dtype:
    return _dtype(pytestconfig)


@pytest.fixture(scope="session")
def impl(impl_name: str, dtype: torch.dtype):
    cls = IMPLEMENTATIONS[impl_name]
    ok, why = cls.available()
    if not ok:
        pytest.skip(f"{impl_name}: {why}")
    return cls(dtype)


@pytest.fixture(scope="session")
def workbench():
    wb = Workbench()
    yield wb
    wb.close()


@pytest.fixture
def bench(workbench, request):
    """The workbench as the test's implementation sees it (its weights); the plain one without one."""
    impl = request.getfixturevalue("impl") if "impl_name" in request.fixturenames else None
    return workbench.on(impl.weights if impl is not None else "random")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    """Skip reasons grouped, so an implementation that could not run is never silently dropped."""
    reasons: dict[str, int] = {}
    for rep in terminalreporter.stats.get("skipped", []):
        if isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3:
            reason = str(rep.longrepr[2]).removeprefix("Skipped: ")
            reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("conformance: skipped (count, reason)")
        for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{count:4d}  {reason}")
