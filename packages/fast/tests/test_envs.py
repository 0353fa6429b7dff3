"""envs.py: one registry of the environment variables, read afresh on each access; the C kernels'
switches are one list whose names are checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import swiftkv_fast
from swiftkv_fast import envs
from swiftkv_fast.kernels import cpu_decode, cpu_gemm

ROOT = Path(swiftkv_fast.__file__).parent
# os.environ.get("X" / os.getenv("X" / os.environ["X"]
READ = re.compile(r"""os\.(?:environ\.get|getenv)\(\s*["']([A-Z0-9_]+)|os\.environ\[["']([A-Z0-9_]+)""")


def test_every_variable_the_package_reads_is_registered():
    read = {
        name
        for path in ROOT.rglob("*.py")
        for m in READ.finditer(path.read_text())
        for name in m.groups()
        if name
    }
    assert read <= set(envs.VARIABLES), sorted(read - set(envs.VARIABLES))
    assert all(v.doc for v in envs.VARIABLES.values())


def test_values_are_read_on_each_access(monkeypatch):
    monkeypatch.delenv("SWIFTKV_CPU_MAX_ISA", raising=False)
    assert envs.SWIFTKV_CPU_MAX_ISA == "native"
    monkeypatch.setenv("SWIFTKV_CPU_MAX_ISA", "AVX2")
    assert envs.SWIFTKV_CPU_MAX_ISA == "avx2"
    monkeypatch.setenv("SWIFTKV_TUNE_MALLOC", "0")
    assert envs.SWIFTKV_TUNE_MALLOC is False
    with pytest.raises(AttributeError):
        envs.SWIFTKV_NOT_A_VARIABLE  # noqa: B018


def test_disabled_kernels_switch_off_the_named_ones(monkeypatch):
    monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", " gemm, decode ")
    assert envs.SWIFTKV_DISABLED_KERNELS == {"gemm", "decode"}
    assert not cpu_gemm.enabled() and not cpu_decode.enabled()
    assert cpu_gemm.four_bit_enabled()
    assert cpu_gemm.unavailable_reason() == "gemm in disabled_kernels"
    monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", "")
    assert cpu_gemm.enabled() and cpu_decode.enabled()


def test_an_engines_own_list_replaces_the_environments_while_its_plan_is_built(monkeypatch):
    """EngineConfig.disabled_kernels (None: the environment's list) is what `kernel_enabled` answers
    from inside `kernels_disabled`, and only there."""
    from swiftkv_fast.config import EngineConfig

    monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", "gemm")
    assert envs.disabled_kernels() == {"gemm"} and envs.disabled_kernels("decode, ops") == {"decode", "ops"}
    assert envs.disabled_reason("gemm") == "gemm in disabled_kernels"
    with envs.kernels_disabled(frozenset({"decode"})):
        assert envs.disabled_kernels() == {"decode"}
        assert cpu_gemm.enabled() and not cpu_decode.enabled()
        with envs.kernels_disabled(frozenset()):
            assert cpu_gemm.enabled() and cpu_decode.enabled()
        assert not cpu_decode.enabled()
    assert not cpu_gemm.enabled() and cpu_decode.enabled()
    assert EngineConfig(device="cpu").disabled_kernels == frozenset({"gemm"})
    assert EngineConfig(device="cpu", disabled_kernels="decode,prefill").disabled_kernels == {
        "decode",
        "prefill",
    }
    assert EngineConfig(device="cpu", disabled_kernels=["ops"]).disabled_kernels == frozenset({"ops"})
    with pytest.raises(ValueError, match="unknown \\['gemmm'\\]"):
        EngineConfig(device="cpu", disabled_kernels=["gemmm"])


def test_an_unknown_kernel_name_is_refused_with_the_known_ones(monkeypatch):
    monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", "gemm,gemmm")
    with pytest.raises(ValueError, match="unknown \\['gemmm'\\].*'decode'"):
        cpu_gemm.enabled()


def test_the_docs_table_lists_every_variable():
    table = envs.markdown()
    assert all(f"`{name}`" in table for name in [*envs.VARIABLES, *envs.KERNELS])
    doc = ROOT.parents[3] / "docs" / "environment.md"
    if not doc.exists():
        pytest.skip("not a source checkout")
    assert table in doc.read_text(), (
        "docs/environment.md is stale: python -m swiftkv_fast.envs regenerates it"
    )
