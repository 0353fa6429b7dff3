"""`bench tp` and the per-rank KV figures of `bench memory` on tiny models (gloo, CPU, spawned workers).
No timing assertions: the step times are only checked to be there."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("swiftkv_fast")


def test_tp_quick_rows_per_n_with_bytes_per_token_exactly_one_over_n(tmp_path, monkeypatch):
    from bench import tp
    from bench.__main__ import main

    monkeypatch.setattr(tp, "plot", lambda kv_rows, step_rows, out: out / "tp.png")  # no matplotlib in tests

    assert main(["tp", "--quick", "--models", "tiny", "--sizes", "1,2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "tp.json").read_text())
    rows = {r["tensor_parallel_size"]: r for r in data["results"]}
    assert sorted(rows) == [1, 2] and {r["model"] for r in rows.values()} == {"tiny"}
    one, two = rows[1], rows[2]
    assert two["bytes_per_token"] * 2 == one["bytes_per_token"]  # a count of bytes: exact
    assert (one["kv_heads"], two["kv_heads"]) == (6, 3)
    assert all(r["matches_formula"] and r["scales"] for r in rows.values())
    assert two["bytes_of_n1"] == 0.5
    # the same bytes per rank hold twice the blocks (up to the rounding of budget // bytes per block)
    assert two["num_blocks"] in (2 * one["num_blocks"], 2 * one["num_blocks"] + 1)
    assert two["concurrency_x_n1"] == pytest.approx(2, rel=1e-3)
    steps = {r["tensor_parallel_size"]: r for r in data["step_time"]}
    assert sorted(steps) == [1, 2]
    for r in steps.values():
        assert r["decode_steps"] > 0 and r["mixed_steps"] > 0 and r["decode_step_ms"]["median"] > 0
    assert steps[2]["decode_step_x_n1"]["n"] == 1  # one round (quick), paired with N=1's


def test_memory_measure_refuses_an_n_that_does_not_split_and_replicates_fewer_kv_heads():
    from swiftkv_reference.testing import random_state_dict, tiny_config

    from bench import memory

    config = tiny_config(num_attention_heads=4, num_key_value_heads=1)  # 4 heads: N = 3 refused
    state = random_state_dict(config)
    refused = memory.measure(config, state, None, None, 1 << 20, 64, tensor_parallel_size=3)
    assert "num_attention_heads=4" in refused["refused"] and "bytes_per_token" not in refused
    one = memory.measure(config, state, None, None, 1 << 20, 64)
    two = memory.measure(config, state, None, None, 1 << 20, 64, tensor_parallel_size=2)
    # one K/V head, two ranks: each rank keeps the whole head (replicated), so the same bytes per token
    assert two["kv_heads"] == one["kv_heads"] == 1
    assert two["bytes_per_token"] == one["bytes_per_token"] == two["formula_bytes_per_token"]
    assert memory.kv_heads_per_rank(3, 3) == 1 and memory.kv_heads_per_rank(6, 2) == 3
    # a bf16 KV cache: half the bytes per token (the formula at 2 bytes a value), twice the blocks
    bf16 = memory.measure(config, state, None, None, 1 << 20, 64, kv_cache_dtype="bfloat16")
    assert bf16["element_bytes"] == 2 and bf16["matches_formula"]
    assert 2 * bf16["bytes_per_token"] == one["bytes_per_token"]
    assert bf16["num_blocks"] in (2 * one["num_blocks"], 2 * one["num_blocks"] + 1)
