"""CPU linear kernels chosen by measurement (kernels/linear_kernels.py): numerics of each kernel, the choice
from injected timings, the per-machine cache file, fallbacks, the config field, greedy tokens."""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch
import torch.nn.functional as F
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.config import LINEAR_KERNELS, EngineConfig
from swiftkv_fast.kernels import cpu_amx, cpu_gemm
from swiftkv_fast.kernels import linear_kernels as lk
from swiftkv_fast.kernels.weight_forms import FormMismatch
from swiftkv_fast.model.layers import Linear
from swiftkv_reference.testing import fp32_atol, random_state_dict, tiny_config

FORCED = [k for k in LINEAR_KERNELS if k != "auto"]
FP32 = [  # the kernels of fp32 precision that take any weight
    k for k in FORCED if lk.KERNELS[k].precision == "highest" and lk.KERNELS[k].forms is None
]


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.INFO, logger=lk.logger.name)
    return caplog


def fake_timer(seconds: dict[str, dict[int, float]], calls: list | None = None):
    """A timer that reports `seconds[kernel][rows]` (and runs nothing)."""

    def timer(kernel, rows, call):
        if calls is not None:
            calls.append((kernel, rows))
        return seconds[kernel][rows]

    return timer


def chooser(kernel="auto", buckets=(1, 16, 256), **kw) -> lk.LinearKernelChooser:
    kw.setdefault("waited", lambda: 0.0)  # a machine of our own, whatever else the test run is doing
    return lk.LinearKernelChooser(kernel, "cpu", buckets, **kw)


def test_config_names_the_kernels():
    assert set(LINEAR_KERNELS) == {"auto", *lk.KERNELS}


@pytest.mark.parametrize("kernel", FP32)
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_each_kernel_matches_f_linear(kernel, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)  # (out, in)
    b = torch.randn(96, generator=g) if with_bias else None
    lin = Linear(w, b, lk.KernelChoice.single(kernel, w))
    assert (lin.in_features, lin.out_features) == (40, 96)
    # another summation order (oneDNN and MKL block the reduction differently): fp32_atol's bound,
    # 32 units in the last place of the largest |y| (~30 here), far below any real error
    for x in (torch.randn(rows, 40, generator=g), torch.randn(rows, 80, generator=g)[:, ::2]):
        want = F.linear(x, w, b)
        torch.testing.assert_close(lin(x), want, rtol=0, atol=fp32_atol(want))


def test_matmul_layout_is_the_transposed_weight_and_linear_shares_it():
    w = torch.randn(8, 4)
    assert lk.KernelChoice.single("linear", w).layouts["linear"] is w
    w_t = lk.KernelChoice.single("matmul", w).layouts["matmul"]
    assert w_t.shape == (4, 8) and w_t.is_contiguous() and torch.equal(w_t, w.t())


def test_linear_runs_the_kernel_of_each_row_bucket():
    # two different matrices in the two layouts reveal which kernel ran
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    choice = lk.KernelChoice(
        {"matmul": b.t().contiguous(), "linear": a}, ((2, "matmul"), (sys.maxsize, "linear"))
    )
    lin = Linear(a, None, choice)
    for rows, w in ((1, b), (2, b), (3, a), (5000, a)):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(lin(x), x @ w.t())


def test_row_buckets_cover_decode_batches_and_the_prefill_chunk():
    assert lk.row_buckets(256, 4096) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
    assert lk.row_buckets(12, 100) == (1, 2, 4, 8, 12, 48, 100)
    assert lk.row_buckets(64, 16) == (1, 2, 4, 8, 16)  # a step never has more rows than its budget


def test_plan_keeps_one_layout_unless_another_saves_more_than_copy_worth():
    times = {
        1: {"linear": 1.0, "matmul": 0.95, "mkldnn": 3.0},
        16: {"linear": 2.0, "matmul": 5.0, "mkldnn": 1.0},
    }
    assert lk.plan_kernels(times) == ((1, "matmul"), (16, "mkldnn"))  # mkldnn 3x slower at 1 row
    times[1]["mkldnn"] = 0.95 * lk.COPY_WORTH * 0.99  # within COPY_WORTH: one layout serves both buckets
    assert lk.plan_kernels(times) == ((1, "mkldnn"), (16, "mkldnn"))
    # a tied lm_head: F.linear reads the embedding, so its layout is free beside one copy
    assert lk.plan_kernels(times, frozenset({"linear"})) == ((1, "linear"), (16, "mkldnn"))


def test_chooser_picks_the_fastest_of_injected_timings_interleaved():
    seconds = {
        "linear": {1: 0.1, 16: 0.9, 256: 5.0},
        "matmul": {1: 0.2, 16: 0.8, 256: 9.0},
        "mkldnn": {1: 0.3, 16: 0.2, 256: 1.0},
        "panel": {1: 0.4, 16: 0.3, 256: 1.1},
    }
    calls: list = []
    ch = chooser(timer=fake_timer(seconds, calls))
    w = torch.randn(32, 16)
    choice = ch.choose("o", w, None, max_rows=256)
    assert choice.plan == ((1, "linear"), (sys.maxsize, "mkldnn"))
    assert set(choice.layouts) == {"linear", "mkldnn"}
    assert calls[:8] == [("linear", 1), ("matmul", 1), ("mkldnn", 1), ("panel", 1)] * 2  # round by round
    assert len(calls) == 4 * lk.MIN_SAMPLES * 3  # 3 buckets; each case over its budget after the minimum
    assert ch.timed_cases == 3
    # a layer that only runs decode rows is timed at the buckets up to its largest batch
    assert ch.choose("lm_head", torch.randn(48, 16), None, max_rows=10).plan[-1] == (sys.maxsize, "mkldnn")
    assert ch.timed_cases == 5  # (48x16, 1) and (48x16, 16): 16 covers 10 rows


def test_cache_round_trips_and_skips_the_timing(tmp_path):
    seconds = {k: {1: 1.0, 16: 1.0} for k in lk.KERNELS} | {"matmul": {1: 0.5, 16: 0.1}}
    first = chooser(buckets=(1, 16), cache_dir=tmp_path, timer=fake_timer(seconds))
    w = torch.randn(32, 16)
    want = first.choose("o", w, None, 16).plan
    first.finish()
    assert first.cache_path.exists() and first.cache_path.parent == tmp_path
    assert first.how().startswith("timed now")

    def no_timing(kernel, rows, call):
        raise AssertionError("timed although the cache has the case")

    second = chooser(buckets=(1, 16), cache_dir=tmp_path, timer=no_timing)
    assert second.choose("o", w, None, 16).plan == want == ((sys.maxsize, "matmul"),)
    second.finish()
    assert second.how() == "cached timings"  # what the kernel plan reports


def test_a_case_timed_on_a_busy_machine_is_timed_again(tmp_path, log):
    """Each try of a case (one row bucket, every kernel) reads the run-queue delay before and after.
    Bucket 1: the first try's threads waited (another process had the cores), the second's did not, and
    the second try's timings decide. Bucket 16: undisturbed at once. Then the shape is cached."""
    waits = iter([0.0, 50.0, 50.0, 50.0, 50.0, 50.0])
    tries: list = []

    def timer(kernel, rows, call):
        tries.append((kernel, rows))
        disturbed = len(tries) <= 4 * lk.MIN_SAMPLES  # the first try of bucket 1
        return 0.1 if kernel == ("matmul" if disturbed else "panel") else 1.0

    ch = chooser(buckets=(1, 16), cache_dir=tmp_path, timer=timer, waited=lambda: next(waits))
    w = torch.randn(32, 16)
    assert ch.choose("o", w, None, 16).plan == ((sys.maxsize, "panel"),)
    assert [rows for _, rows in tries] == [1] * 8 * lk.MIN_SAMPLES + [16] * 4 * lk.MIN_SAMPLES
    assert not ch.busy
    ch.finish()
    cached = json.loads(ch.cache_path.read_text())["times"]
    assert set(cached) == {ch._shape_key(w, None)}


def test_a_case_disturbed_in_every_try_uses_the_least_disturbed_and_is_not_cached(tmp_path, log):
    w_cached, w_busy = torch.randn(32, 16), torch.randn(48, 16)
    even = fake_timer({k: {1: 1.0, 16: 1.0} for k in lk.KERNELS})
    quiet = chooser(buckets=(1, 16), cache_dir=tmp_path, timer=even)
    quiet.choose("o", w_cached, None, 16)
    quiet.finish()
    before = json.loads(quiet.cache_path.read_text())["times"]

    # bucket 1 waits 90, then 10, then 90 seconds in its three tries; bucket 16 is undisturbed
    waits = iter([0.0, 90.0, 90.0, 100.0, 100.0, 190.0, 190.0, 190.0])
    tries: list = []

    def timer(kernel, rows, call):
        tries.append(kernel)
        second = 4 * lk.MIN_SAMPLES < len(tries) <= 2 * 4 * lk.MIN_SAMPLES
        return 0.1 if kernel == ("mkldnn" if second or rows == 16 else "matmul") else 1.0

    busy = chooser(buckets=(1, 16), cache_dir=tmp_path, timer=timer, waited=lambda: next(waits))
    assert busy.choose("o", w_cached, None, 16).plan  # cached: not timed
    assert busy.choose("lm_head", w_busy, None, 16).plan == ((sys.maxsize, "mkldnn"),)
    assert len(tries) == (lk.MAX_TRIES + 1) * 4 * lk.MIN_SAMPLES
    assert set(busy.busy) == {busy._shape_key(w_busy, None)}
    busy.finish()
    assert json.loads(busy.cache_path.read_text())["times"] == before  # the busy shape left out
    assert "the CPU was busy" in log.text and busy._shape_key(w_busy, None) in log.text


def test_cold_timing_evicts_the_caches_before_every_call_and_is_cached_apart(tmp_path, monkeypatch):
    events: list = []
    monkeypatch.setattr(lk, "evict_caches", lambda: events.append("evict"))
    seconds = {k: {1: 1.0, 16: 1.0} for k in lk.KERNELS} | {"panel": {1: 0.5, 16: 0.1}}

    def timer(kernel, rows, call):
        events.append(kernel)
        return seconds[kernel][rows]

    w = torch.randn(32, 16)
    cold = chooser(buckets=(1, 16), cache_dir=tmp_path, timer=timer, cold=True)
    assert cold.choose("o", w, None, 16).plan == ((sys.maxsize, "panel"),)
    lk._eviction_buffer()  # what the real evict_caches allocates: freed by finish, not kept by the engine
    cold.finish()
    assert lk._eviction_buffer.cache_info().currsize == 0
    assert events[:4] == ["evict", "linear", "evict", "matmul"]
    assert events.count("evict") == len(events) // 2  # one eviction before each timed call
    events.clear()
    warm = chooser(buckets=(1, 16), cache_dir=tmp_path, timer=timer)  # the cold timings do not answer it
    warm.choose("o", w, None, 16)
    assert events and "evict" not in events
    assert lk.largest_cache_bytes() > 0


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "corrupt"),
        (json.dumps({"version": lk.CACHE_VERSION, "machine": {}, "times": {}}), "another machine"),
        (json.dumps({"version": lk.CACHE_VERSION, "machine": lk.machine_key(), "times": [1]}), "corrupt"),
    ],
)
def test_corrupt_or_foreign_cache_is_ignored_with_a_log_line(tmp_path, log, content, why):
    path = lk.cache_file(tmp_path)
    path.write_text(content)
    seconds = {k: {1: 1.0} for k in lk.KERNELS}
    ch = chooser(buckets=(1,), cache_dir=tmp_path, timer=fake_timer(seconds))
    ch.choose("o", torch.randn(8, 4), None, 1)
    assert ch.timed_cases == 1
    lines = [r.getMessage() for r in log.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and why in lines[0] and str(path) in lines[0]
    ch.finish()  # rewritten with this machine's timings
    assert json.loads(path.read_text())["machine"] == lk.machine_key()


def broken_mkldnn(monkeypatch):
    def pack(weight):
        raise RuntimeError("no oneDNN here")

    monkeypatch.setitem(lk.KERNELS, "mkldnn", lk.LinearKernel("mkldnn", pack, lk.KERNELS["mkldnn"].run))


def test_failing_private_op_falls_back_with_one_log_line(monkeypatch, log):
    broken_mkldnn(monkeypatch)
    forced = chooser("mkldnn")
    plans = [forced.choose(name, torch.randn(8, 4), None, 16).plan for name in ("a", "b")]
    assert plans == [((sys.maxsize, "linear"),)] * 2
    seconds = {k: {1: 1.0, 16: 1.0} for k in lk.KERNELS}
    auto = chooser(buckets=(1, 16), timer=fake_timer(seconds))
    for name in ("a", "b"):
        assert set(auto.choose(name, torch.randn(8, 4), None, 16).layouts) <= {"linear", "matmul", "panel"}
    warnings = [r.getMessage() for r in log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("'mkldnn' failed" in w and "no oneDNN here" in w for w in warnings)


def test_a_kernel_that_fails_on_a_cached_choice_is_replaced(tmp_path, monkeypatch, log):
    seconds = {"linear": {1: 1.0}, "matmul": {1: 2.0}, "mkldnn": {1: 0.1}, "panel": {1: 3.0}}
    first = chooser(buckets=(1,), cache_dir=tmp_path, timer=fake_timer(seconds))
    first.choose("o", torch.randn(8, 4), None, 1)
    first.finish()
    broken_mkldnn(monkeypatch)
    second = chooser(buckets=(1,), cache_dir=tmp_path)
    assert second.choose("o", torch.randn(8, 4), None, 1).plan == ((sys.maxsize, "linear"),)


def test_memory_beyond_one_copy_is_counted():
    w = torch.randn(64, 32)
    ch = chooser("matmul")
    ch.choose("o", w, None, 16)
    assert ch.extra_bytes == 0  # the transposed copy replaces the checkpoint layout
    ch.choose("lm_head", w, None, 16, shared=True)
    assert ch.extra_bytes == w.numel() * 4  # the embedding stays: the copy is extra
    assert chooser("linear").choose("lm_head", w, None, 16, shared=True).layouts["linear"] is w


def test_other_devices_run_f_linear_untimed():
    def no_timing(kernel, rows, call):
        raise AssertionError("timed on a non-CPU device")

    ch = lk.LinearKernelChooser("auto", "meta", (1, 16), timer=no_timing)
    assert ch.choose("o", torch.randn(8, 4), None, 16).plan == ((sys.maxsize, "linear"),)


def test_bad_linear_kernel_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="linear_kernel"):
        EngineConfig(linear_kernel="fastest", device="cpu")
    with pytest.raises(ValueError, match="linear_kernel"):
        lk.LinearKernelChooser("fastest", "cpu", (1,))


@pytest.mark.parametrize(
    "model", [dict(num_hidden_layers=3, tie_word_embeddings=True), dict(num_hidden_layers=4)]
)
def test_greedy_tokens_do_not_depend_on_the_kernel(model):
    config = tiny_config(**model)
    state = random_state_dict(config)
    prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=6)
    got = {}
    for kernel in FP32 + (["bf16x3"] if cpu_amx.unavailable_reason() is None else []):
        precision = lk.KERNELS[kernel].precision
        llm = LLM.from_state_dict(
            config,
            state,
            linear_kernel=kernel,
            matmul_precision=precision,
            num_key_value_layers=2,
            max_model_len=64,
        )
        got[kernel] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        lm_head = llm.llm_engine.runner.model.w.lm_head
        assert lm_head.plan == ((sys.maxsize, kernel),)
        if kernel == "linear" and config.tie_word_embeddings:  # the tied lm_head reads the embedding
            assert lm_head.layouts["linear"].data_ptr() == llm.llm_engine.runner.model.w.embed.data_ptr()
    assert got["matmul"] == got["linear"] == got["mkldnn"] == got["panel"] == got.get("bf16x3", got["linear"])


def fake_bf16x3(monkeypatch) -> None:
    """A stand-in for the AMX kernel (F.linear at "high" precision), so the choice is tested anywhere."""
    monkeypatch.setitem(lk.KERNELS, "bf16x3", lk.LinearKernel("bf16x3", lambda w: w, F.linear, "high"))


def test_bf16x3_is_a_candidate_only_at_high_precision(monkeypatch):
    fake_bf16x3(monkeypatch)
    seconds = {k: {1: 1.0, 256: 1.0} for k in lk.KERNELS}
    seconds["bf16x3"] = {1: 0.1, 256: 0.1}  # the fastest everywhere
    timed = []
    highest = chooser(buckets=(1, 256), timer=fake_timer(seconds, timed))
    assert "bf16x3" not in {k for _, k in highest.choose("o", torch.randn(8, 4), None, 256).plan}
    assert "bf16x3" not in {k for k, _ in timed}  # not even timed
    high = chooser(buckets=(1, 256), timer=fake_timer(seconds), precision="high")
    assert high.choose("o", torch.randn(8, 4), None, 256).plan == ((sys.maxsize, "bf16x3"),)


def test_timings_cached_at_one_precision_serve_the_other(tmp_path, monkeypatch):
    """A cache written at "high" holds bf16x3's timings, which "highest" leaves out; one written at
    "highest" lacks them, so "high" times the shape again."""
    fake_bf16x3(monkeypatch)
    seconds = {k: {1: 1.0} for k in lk.KERNELS}
    seconds["bf16x3"], seconds["mkldnn"] = {1: 0.1}, {1: 0.5}
    first = chooser(buckets=(1,), cache_dir=tmp_path, timer=fake_timer(seconds), precision="high")
    assert first.choose("o", torch.randn(8, 4), None, 1).plan == ((sys.maxsize, "bf16x3"),)
    first.finish()

    def no_timing(kernel, rows, call):
        raise AssertionError("timed again")

    again = chooser(buckets=(1,), cache_dir=tmp_path, timer=no_timing)
    assert again.choose("o", torch.randn(8, 4), None, 1).plan == ((sys.maxsize, "mkldnn"),)
    other = tmp_path / "other"
    chooser(buckets=(1,), cache_dir=other, timer=fake_timer(seconds)).choose("o", torch.randn(8, 4), None, 1)
    timed = []
    high = chooser(buckets=(1,), cache_dir=other, timer=fake_timer(seconds, timed), precision="high")
    assert high.choose("o", torch.randn(8, 4), None, 1).plan == ((sys.maxsize, "bf16x3"),)
    assert ("bf16x3", 1) in timed


def test_matmul_precision_is_checked_naming_the_field():
    with pytest.raises(ValueError, match="matmul_precision must be one of"):
        EngineConfig(matmul_precision="medium", device="cpu")
    with pytest.raises(ValueError, match="linear_kernel='bf16x3'.*matmul_precision='high'"):
        EngineConfig(linear_kernel="bf16x3", device="cpu")
    EngineConfig(linear_kernel="bf16x3", matmul_precision="high", device="cpu")
    with pytest.raises(ValueError, match="matmul_precision"):
        lk.LinearKernelChooser("auto", "cpu", (1,), precision="medium")


def test_the_engine_hands_its_matmul_precision_to_the_chooser(monkeypatch):
    from swiftkv_fast.model import loader

    seen = []

    class Recording(lk.LinearKernelChooser):
        def __post_init__(self) -> None:
            seen.append(self.precision)
            super().__post_init__()

    monkeypatch.setattr(loader, "LinearKernelChooser", Recording)
    config = tiny_config(num_hidden_layers=2)
    state = random_state_dict(config)
    for precision in ("highest", "high"):
        LLM.from_state_dict(
            config, state, matmul_precision=precision, linear_kernel="linear", max_model_len=32
        )
    assert seen == ["highest", "high"]


def test_a_forced_bf16x3_where_it_cannot_run_falls_back_with_one_log_line(monkeypatch, log):
    monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", "amx")
    forced = chooser("bf16x3", precision="high")
    assert forced.choose("o", torch.randn(8, 4), None, 16).plan == ((sys.maxsize, "linear"),)
    warnings = [r.getMessage() for r in log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'bf16x3' failed" in warnings[0] and "unavailable here" in warnings[0]


def test_a_changed_kernel_source_is_timed_afresh(tmp_path, monkeypatch):
    """The timings cache is keyed by the C kernels' sources too: timings of an older kernel are not
    reused for a new one."""
    before = lk.cache_file(tmp_path)
    monkeypatch.setattr(lk.build, "source_digest", lambda: "changed" * 8)
    lk.machine_key.cache_clear()
    try:
        assert lk.cache_file(tmp_path) != before
    finally:
        monkeypatch.undo()
        lk.machine_key.cache_clear()
    assert lk.cache_file(tmp_path) == before


def test_widen_keeps_bf16_values_and_multiplies_them_exactly():
    w = torch.randn(96, 40).bfloat16().float()  # a bf16 checkpoint's values, loaded as fp32
    b = torch.randn(96)
    lin = Linear(w, b, lk.KernelChoice.single("widen", w))
    assert lin.layouts["widen"].dtype == torch.bfloat16 and lk.nbytes(lin.layouts["widen"]) == w.numel() * 2
    x = torch.randn(7, 40)
    assert torch.equal(lin(x), F.linear(x, w, b))  # the same fp32 values through the same kernel
    with pytest.raises(FormMismatch):  # an fp32 weight has no exact bf16 layout
        lk.KERNELS["widen"].pack(torch.randn(8, 4))
    # an fp32 engine offers widen only for weights whose values are exact in bf16 (forced: falls back)
    assert chooser("widen").choose("o", torch.randn(8, 4), None, 16).plan == ((sys.maxsize, "linear"),)


def test_a_widened_chooser_keeps_every_weight_in_bf16_bytes():
    # the fastest kernels hold fp32 layouts: a chooser for bf16 weights multiplied in fp32 never offers them
    seconds = {k: {1: 1.0, 16: 1.0, 256: 1.0} for k in lk.KERNELS}
    seconds["mkldnn"] = seconds["matmul"] = {1: 0.01, 16: 0.01, 256: 0.01}
    seconds["widen"] = {1: 2.0, 16: 2.0, 256: 0.5}
    calls: list = []
    ch = chooser(timer=fake_timer(seconds, calls), widened=True)
    w = torch.randn(64, 32).bfloat16().float()  # (out, in): whole panels of 16 columns
    choice = ch.choose("o", w, None, max_rows=256)
    panel = cpu_gemm.unavailable_reason() is None
    assert {k for k, _ in calls} == ({"widen", "panel"} if panel else {"widen"})
    assert all(lk.nbytes(layout) == w.numel() * 2 for layout in choice.layouts.values())
    if panel:
        assert choice.plan == ((16, "panel"), (sys.maxsize, "widen"))
        assert choice.layouts["panel"].format == "bf16"
    assert ch.extra_bytes == sum(lk.nbytes(x) for x in choice.layouts.values()) - w.numel() * 2


@pytest.mark.skipif(cpu_gemm.unavailable_reason() is not None, reason="the panel GEMM is not built here")
def test_a_widened_forced_panel_holds_bf16_panels_even_with_compact_forms_off(monkeypatch):
    monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", "gemm-4bit")
    w = torch.randn(40, 24).bfloat16().float()
    assert chooser("panel").choose("o", w, None, 16).layouts["panel"].format == "fp32"
    layout = chooser("panel", widened=True).choose("o", w, None, 16).layouts["panel"]
    assert layout.format == "bf16"
    x = torch.randn(5, 24)
    torch.testing.assert_close(layout.linear(x), F.linear(x, w), rtol=0, atol=fp32_atol(F.linear(x, w)))
