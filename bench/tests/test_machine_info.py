"""Every benchmark's JSON and table header name the machine: CPU model, cores, torch, BLAS and oneDNN,
the engine's linear kernel per layer shape, and whether malloc was tuned in the process."""

from __future__ import annotations

import platform

from bench import engine, harness, report


def test_machine_info_names_cpu_blas_and_the_kernel_choices(capsys, tmp_path):
    from swiftkv_reference.testing import random_state_dict, tiny_config

    config = tiny_config(num_hidden_layers=2)
    engine.build_llm(config=config, state_dict=random_state_dict(config), linear_kernel="matmul")
    info = harness.machine_info()
    for key in ("cpu_model", "cpu_count", "torch", "blas", "mkl", "onednn", "onednn_available"):
        assert key in info
    assert info["cpu_model"] and info["linear_kernels"]["gate_up (192x64)"] == "matmul"
    report.finish([report.Table("t", ["a"])], [])
    header = capsys.readouterr().out
    assert f"machine: {info['cpu_model']}, {info['cpu_count']} CPUs" in header
    assert "torch " + info["torch"] in header and "gate_up (192x64): matmul" in header
    # the engine tuned this process's malloc (glibc), and the header says every system here shares it
    assert info["malloc_tuned"] == (platform.libc_ver()[0] == "glibc")
    assert ("malloc: glibc keeps freed memory" in header) == info["malloc_tuned"]
