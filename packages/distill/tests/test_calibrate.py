"""Closed-form calibration: the accumulated ridge fit is least squares, recovers a planted SwiftKV
projection, and beats Snowflake's initialisation on held-out data."""

from __future__ import annotations

import sys

import pytest
import torch
from swiftkv_distill.batch import Batch
from swiftkv_distill.calibrate import (
    VALUE_PRIOR_QUERIES,
    Accumulator,
    CalibrationError,
    calibrate,
    collect_statistics,
    fit,
)
from swiftkv_distill.forward import training_forward
from swiftkv_reference.checkpoint import CheckpointError, check_state_dict, swiftkv_init
from swiftkv_reference.config import ConfigError
from swiftkv_reference.model import SwiftKVForCausalLM
from swiftkv_reference.testing import tiny_config, tiny_model
from tiny_models import PLAIN_MODELS


def _synthetic(n: int, d_in: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    ys = {k: torch.randn(n, 5 + k, generator=g, dtype=torch.float64) for k in range(2)}
    return s, ys


@pytest.mark.parametrize("bias", [False, True])
def test_ridge_solution_is_lstsq_and_batches_add_up(bias):
    s, ys = _synthetic(200)
    whole = Accumulator(12, {0: 5, 1: 6}, bias=bias)
    whole.update(s, ys)
    parts = Accumulator(12, {0: 5, 1: 6}, bias=bias)
    for rows in (slice(0, 70), slice(70, 71), slice(71, 200)):
        parts.update(s[rows].float(), {k: y[rows] for k, y in ys.items()})
    design = torch.cat([s, torch.ones(200, 1, dtype=torch.float64)], 1) if bias else s
    for (key, (w, b)), (_, (w_parts, b_parts)) in zip(whole.solve(1e-12).items(), parts.solve(1e-12).items()):
        want = torch.linalg.lstsq(design, ys[key]).solution  # (in [+1], out)
        torch.testing.assert_close(w, want[:12].T, rtol=0, atol=1e-8)
        assert (b is None) == (not bias)
        if bias:
            torch.testing.assert_close(b, want[12], rtol=0, atol=1e-8)
            torch.testing.assert_close(b_parts, b, rtol=0, atol=1e-6)  # float32 rows in one part
        torch.testing.assert_close(w_parts, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_weighted_fit_is_lstsq_of_the_scaled_rows(bias):
    """Row weights w: the fit is least squares on rows scaled by sqrt(w), each key with its own weights."""
    s, ys = _synthetic(150)
    g = torch.Generator().manual_seed(5)
    weights = {k: torch.rand(150, generator=g, dtype=torch.float64) * 3 for k in ys}
    acc = Accumulator(12, {0: 5, 1: 6}, bias=bias, weighted=True)
    for rows in (slice(0, 40), slice(40, 150)):
        acc.update(s[rows], {k: y[rows] for k, y in ys.items()}, {k: w[rows] for k, w in weights.items()})
    design = torch.cat([s, torch.ones(150, 1, dtype=torch.float64)], 1) if bias else s
    for key, (w, b) in acc.solve(1e-12).items():
        root = weights[key].sqrt()[:, None]
        want = torch.linalg.lstsq(design * root, ys[key] * root).solution  # (in [+1], out)
        torch.testing.assert_close(w, want[:12].T, rtol=0, atol=1e-8)
        if bias:
            torch.testing.assert_close(b, want[12], rtol=0, atol=1e-8)
    with pytest.raises(ValueError, match="needs weights for every key"):
        acc.update(s, ys)
    with pytest.raises(ValueError, match="must be \\(150,\\) and >= 0"):
        acc.update(s, ys, {0: -weights[0], 1: weights[1]})
    with pytest.raises(ValueError, match="an unweighted one none"):
        Accumulator(12, {0: 5, 1: 6}).update(s, ys, weights)
    # a weighted accumulator takes any subset of its keys, each with its own rows
    part = Accumulator(12, {0: 5, 1: 6}, bias=bias, weighted=True)
    part.update(s[:40], {0: ys[0][:40]}, {0: weights[0][:40]})
    with pytest.raises(CalibrationError, match=r"no calibration rows.*\(for 1\)"):
        part.solve(1e-12)
    part.update(s[40:], {0: ys[0][40:]}, {0: weights[0][40:]})
    part.update(s, {1: ys[1]}, {1: weights[1]})
    for (w_part, b_part), (w, b) in zip(part.solve(1e-12).values(), acc.solve(1e-12).values()):
        torch.testing.assert_close(w_part, w, rtol=0, atol=1e-8)
        assert (b_part is None) == (b is None) == (not bias)
    # blend: key 0's fit also counts key 1's rows (their first 5 target columns) at weight 0.5
    part.blend(0, 1, 0.5, slice(0, 5))
    root = torch.cat([weights[0], 0.5 * weights[1]]).sqrt()[:, None]
    rows = torch.cat([design, design]) * root
    want = torch.linalg.lstsq(rows, torch.cat([ys[0], ys[1][:, :5]]) * root).solution
    w, b = part.solve(1e-12)[0]
    torch.testing.assert_close(w, want[:12].T, rtol=0, atol=1e-8)
    with pytest.raises(ValueError, match="6 columns of 1 for 5 of 0"):
        part.blend(0, 1, 0.5)


def _nearly_collinear(n: int = 3000, d_in: int = 64, seed: int = 0):
    """Rows that are one large vector plus a little (like the pooled value rows), an affine target."""
    g = torch.Generator().manual_seed(seed)
    s = 3 * torch.randn(d_in, generator=g, dtype=torch.float64) + 0.05 * torch.randn(
        n, d_in, generator=g, dtype=torch.float64
    )
    w_true = torch.randn(8, d_in, generator=g, dtype=torch.float64)
    y = s @ w_true.T + 0.5 + 1e-3 * torch.randn(n, 8, generator=g, dtype=torch.float64)
    return s, y, torch.rand(n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_fp32_products_on_centred_rows_match_fp64(bias, weighted):
    """product_dtype=float32 centres rows and targets, so on nearly collinear rows its fit stays within
    ~1e-6 of the fp64 one where plain fp32 products of the same rows are off by ~4e-2; the result is
    the same inside a bf16 autocast region (calibration's bf16 pass), after copy(), and summed over
    accumulators (+) as over one."""
    s, y, w = _nearly_collinear()
    n = len(s)

    def accumulate(product_dtype, parts=1, autocast=False):
        accs = [
            Accumulator(64, {0: 8}, bias, weighted=weighted, product_dtype=product_dtype)
            for _ in range(parts)
        ]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for k, a in enumerate(range(0, n, 700)):
                rows = slice(a, a + 700)
                accs[k % parts].update(s[rows], {0: y[rows]}, {0: w[rows]} if weighted else None)
        return sum(accs[1:], accs[0])

    want = accumulate(torch.float64).solve(1e-8)[0][0]
    fp32 = accumulate(torch.float32)
    empty_first = Accumulator(64, {0: 8}, bias, weighted=weighted, product_dtype=torch.float32)
    empty_first.update(s[:0], {0: y[:0]}, {0: w[:0]} if weighted else None)  # no rows: no centre from them
    for a in range(0, n, 700):
        rows = slice(a, a + 700)
        empty_first.update(s[rows], {0: y[rows]}, {0: w[rows]} if weighted else None)
    torch.testing.assert_close(empty_first.solve(1e-8)[0][0], fp32.solve(1e-8)[0][0], rtol=0, atol=0)
    got = fp32.copy().solve(1e-8)[0][0]
    assert float((got - want).abs().max()) < 1e-5
    torch.testing.assert_close(fp32.solve(1e-8)[0][0], got, rtol=0, atol=0)  # copy() kept everything
    torch.testing.assert_close(
        accumulate(torch.float32, autocast=True).solve(1e-8)[0][0], got, rtol=0, atol=0
    )
    torch.testing.assert_close(accumulate(torch.float32, parts=2).solve(1e-8)[0][0], want, rtol=0, atol=1e-5)
    # what the centring buys: the same rows' plain fp32 products
    x = torch.cat([s, torch.ones(n, 1, dtype=torch.float64)], 1) if bias else s
    xw = x * (w if weighted else torch.ones_like(w))[:, None]
    blocks = range(0, n, 700)
    sts = sum((xw[a : a + 700].float().T @ x[a : a + 700].float()).double() for a in blocks)
    sty = sum((xw[a : a + 700].float().T @ y[a : a + 700].float()).double() for a in blocks)
    sts.diagonal()[:64] += 1e-8 * float(sts.diagonal()[:64].mean())
    plain = torch.linalg.solve(sts, sty)[:64].T
    assert float((plain - want).abs().max()) > 1e-3


def test_accumulator_refuses_another_product_dtype():
    with pytest.raises(ValueError, match="product_dtype must be torch.float64 or torch.float32"):
        Accumulator(4, {"k": 2}, product_dtype=torch.bfloat16)


def test_ridge_shrinks_weights_not_bias():
    """lam = ridge * mean(diag(S^T S)): with a huge ridge W -> 0 and the bias -> the mean of Y."""
    s, ys = _synthetic(300)
    acc = Accumulator(12, {0: 5, 1: 6}, bias=True)
    acc.update(s, ys)
    w, b = acc.solve(ridge=1e9)[0]
    assert float(w.abs().max()) < 1e-6
    torch.testing.assert_close(b, ys[0].mean(0), rtol=0, atol=1e-6)
    # repeating the data leaves the (relative) ridge solution unchanged
    twice = Accumulator(12, {0: 5, 1: 6}, bias=True)
    twice.update(s, ys)
    twice.update(s, ys)
    torch.testing.assert_close(twice.solve(0.1)[1][0], acc.solve(0.1)[1][0], rtol=0, atol=1e-10)


def test_accumulator_refuses_bad_input():
    acc = Accumulator(4, {"k": 2})
    with pytest.raises(CalibrationError, match="no calibration rows"):
        acc.solve()
    with pytest.raises(ValueError, match=r"s must be \(n, 4\)"):
        acc.update(torch.zeros(3, 5), {"k": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="target 'k'"):
        acc.update(torch.zeros(3, 4), {"k": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="targets for"):
        acc.update(torch.zeros(3, 4), {"v": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="all of them: they share"):
        Accumulator(4, {"k": 2, "v": 2}).update(torch.zeros(3, 4), {"k": torch.zeros(3, 2)})
    acc.update(torch.ones(3, 4), {"k": torch.zeros(3, 2)})  # rank 1
    with pytest.raises(CalibrationError, match="singular"):
        acc.solve(ridge=0)
    assert acc.num_rows == 3


def _random_batches(vocab: int, num: int, seed: int, lengths=(24, 17, 9)) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [
        Batch.from_sequences([torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths])
        for _ in range(num)
    ]


def _planted_teacher(name: str, big_l: int) -> SwiftKVForCausalLM:
    """A teacher whose layers >= L add nothing to the residual stream (o_proj and down_proj zero), so
    h_i = h_L and K_i = k_proj_i(w_i * rms(h_L)) is exactly linear in S = w_L * rms(h_L)."""
    model = tiny_model(tiny_config(**PLAIN_MODELS[name]), seed=3)
    with torch.no_grad():
        for layer in model.model.layers[big_l:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


@pytest.mark.parametrize("name", sorted(PLAIN_MODELS))
@pytest.mark.parametrize("group, weighting", [(1, "attention"), (1, "uniform"), (2, "uniform")])
def test_recovers_a_planted_projection(name, group, weighting):
    """Any positive weights recover an exact linear map; a group of G members that each have their
    own map gets the members' mean with uniform weights."""
    big_l = 2
    teacher = _planted_teacher(name, big_l)
    config, state = calibrate(
        teacher,
        _random_batches(teacher.config.vocab_size, 3, seed=0),
        big_l,
        group,
        ridge=1e-12,
        weighting=weighting,
        progress=False,
    )
    assert config.model_type.endswith("_swiftkv") and config.num_key_value_layers == big_l
    check_state_dict(config, state)
    teacher_state = teacher.state_dict()
    w_l = teacher_state[f"model.layers.{big_l}.input_layernorm.weight"]
    torch.testing.assert_close(state["model.norm_swiftkv.weight"], w_l, rtol=0, atol=0)
    for leader in range(big_l, config.num_hidden_layers, group):
        members = range(leader, leader + group)
        for proj in ("k_proj", "v_proj"):
            # K_i = W_i diag(w_i / w_L) S + b_i; the group's optimum is the members' mean
            want_w = (
                sum(
                    teacher_state[f"model.layers.{i}.self_attn.{proj}.weight"]
                    * (teacher_state[f"model.layers.{i}.input_layernorm.weight"] / w_l)
                    for i in members
                )
                / group
            )
            got_w = state[f"model.layers.{leader}.self_attn.{proj}_swiftkv.weight"]
            torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-5)
            if config.attention_bias:
                want_b = (
                    sum(teacher_state[f"model.layers.{i}.self_attn.{proj}.bias"] for i in members) / group
                )
                got_b = state[f"model.layers.{leader}.self_attn.{proj}_swiftkv.bias"]
                torch.testing.assert_close(got_b, want_b, rtol=0, atol=1e-5)
    # the rest is Snowflake's init, and the teacher's tensors are untouched
    _, init = swiftkv_init(teacher.config, teacher_state, big_l, group)
    for key, value in init.items():
        if "k_proj_swiftkv" not in key and "v_proj_swiftkv" not in key:
            assert torch.equal(state[key], value), key


@pytest.mark.parametrize("name", ["llama", "qwen2_hybrid_bias"])
def test_bf16_pass_recovers_a_planted_projection_to_bf16_accuracy(name):
    """precision="bf16": the teacher's pass under bf16 autocast, fp32 products. The planted map comes
    back to bf16's rounding (the pass's K/V and S carry it), not exactly; "auto" is refused."""
    big_l = 2
    teacher = _planted_teacher(name, big_l)
    batches = _random_batches(teacher.config.vocab_size, 3, seed=0)
    _, fp32 = calibrate(teacher, batches, big_l, ridge=1e-12, progress=False)
    _, bf16 = calibrate(teacher, batches, big_l, ridge=1e-12, progress=False, precision="bf16")
    for key, value in fp32.items():
        if "k_proj_swiftkv" in key or "v_proj_swiftkv" in key:
            assert bf16[key].dtype == value.dtype
            torch.testing.assert_close(
                bf16[key], value, rtol=0, atol=0.05 * float(value.abs().max()), msg=key
            )
            assert not torch.equal(bf16[key], value), key  # the pass did run in bf16
        else:
            assert torch.equal(bf16[key], value), key
    with pytest.raises(ValueError, match="must be resolved"):
        calibrate(teacher, batches, big_l, progress=False, precision="auto")


def test_group_target_is_the_mean_of_the_members():
    """On a general teacher with uniform weights, G = 2 fits the members' mean K/V: the fitted leader
    equals the mean of the two G = 1 fits (the normal equations are linear in Y and share S^T S)."""
    teacher = tiny_model(tiny_config(**PLAIN_MODELS["llama"]), seed=3)
    batches = _random_batches(teacher.config.vocab_size, 2, seed=1)
    _, g1 = calibrate(teacher, batches, 2, 1, weighting="uniform", progress=False)
    _, g2 = calibrate(teacher, batches, 2, 2, weighting="uniform", progress=False)
    for proj in ("k_proj_swiftkv", "v_proj_swiftkv"):
        mean = (
            g1[f"model.layers.2.self_attn.{proj}.weight"] + g1[f"model.layers.3.self_attn.{proj}.weight"]
        ) / 2
        torch.testing.assert_close(g2[f"model.layers.2.self_attn.{proj}.weight"], mean, rtol=0, atol=1e-5)


def test_answers_only_fits_on_answer_tokens():
    """answers_only fits on the answer tokens only (their K/V still see the prompt): another fit."""
    teacher = tiny_model(tiny_config(**PLAIN_MODELS["llama"]), seed=3)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (40, 30, 35)]
    batch = Batch.from_sequences(seqs, answer_starts=[10, 5, 20])
    _, every = calibrate(teacher, [batch], 2, progress=False)
    _, answers = calibrate(teacher, [batch], 2, answers_only=True, progress=False)
    key = "model.layers.2.self_attn.k_proj_swiftkv.weight"
    assert not torch.allclose(every[key], answers[key])


def _attention_weighted_fits(
    teacher, batch: Batch, big_l: int, group: int, prior_queries: int
) -> dict[str, torch.Tensor]:
    """The attention weighting's fits by brute force (calibrate's module docstring), one row at a time,
    each by torch.linalg.lstsq: keys weighted per kv head by the attention of the answer queries
    through its query heads; values from the attention-pooled S to the teacher's attention output, and
    every token's own V weighted as its key times prior_queries / (answer queries)."""
    cfg = teacher.config
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rep = heads // kv_heads
    seen = {}
    with torch.no_grad():
        out = training_forward(
            teacher,
            batch.input_ids,
            swiftkv=False,
            compute_logits=False,
            capture_from=big_l,
            attention_hook=lambda i, h, probs, attn: seen.__setitem__(i, (probs.double(), attn.double())),
        )
    norm = teacher.model.layers[big_l].input_layernorm
    prior = prior_queries / int(batch.answer_mask.sum())
    s = norm(out.residual).double()  # (B, T, hidden)
    fits = {}
    for leader in range(big_l, cfg.num_hidden_layers, group):
        for h in range(kv_heads):
            rows = {"k": ([], [], []), "v": ([], [], [])}  # (x, y, weight) per fit
            for i in range(leader, leader + group):
                probs, attn = seen[i]
                k, v = (x.double() for x in out.kv[i])
                for b in range(batch.input_ids.shape[0]):
                    answers = batch.answer_mask[b].nonzero().flatten().tolist()
                    for t in batch.attention_mask[b].nonzero().flatten().tolist():
                        mass = sum(
                            float(probs[b, j, q, t]) for j in range(h * rep, (h + 1) * rep) for q in answers
                        )
                        rows["k"][0].append(s[b, t])
                        rows["k"][1].append(k[b, t, h * d : (h + 1) * d])
                        rows["k"][2].append(mass)
                        rows["v"][0].append(s[b, t])
                        rows["v"][1].append(v[b, t, h * d : (h + 1) * d])
                        rows["v"][2].append(mass * prior)
                    for q in answers:
                        for j in range(h * rep, (h + 1) * rep):
                            rows["v"][0].append(probs[b, j, q] @ s[b])
                            rows["v"][1].append(attn[b, q, j * d : (j + 1) * d])
                            rows["v"][2].append(1.0)
            for part, (x, y, w) in rows.items():
                x, y, root = (
                    torch.stack(x),
                    torch.stack(y),
                    torch.tensor(w, dtype=torch.float64).sqrt()[:, None],
                )
                if cfg.attention_bias:
                    x = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], 1)
                sol = torch.linalg.lstsq(x * root, y * root).solution  # (hidden [+1], d)
                prefix = f"model.layers.{leader}.self_attn.{part}_proj_swiftkv"
                fits.setdefault(f"{prefix}.weight", []).append(sol[: cfg.hidden_size].T)
                if cfg.attention_bias:
                    fits.setdefault(f"{prefix}.bias", []).append(sol[cfg.hidden_size])
    return {name: torch.cat(parts) for name, parts in fits.items()}


@pytest.mark.parametrize("name", ["llama", "qwen2_hybrid_bias"])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("prior_queries", [0, 78, VALUE_PRIOR_QUERIES])
def test_attention_weighting_is_its_documented_least_squares(name, group, prior_queries, monkeypatch):
    """Two kv heads of two query heads each, answers after a prompt, an AcrossKV group of two or one;
    values pooled alone, evenly blended with their per-token fit (78 answer queries), and as shipped."""
    # the module by its sys.modules name: the package's `calibrate` attribute is the function
    monkeypatch.setattr(sys.modules["swiftkv_distill.calibrate"], "VALUE_PRIOR_QUERIES", prior_queries)
    overrides = dict(PLAIN_MODELS[name], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    teacher = tiny_model(tiny_config(**overrides, head_dim=16), seed=3)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (50, 38, 45)]
    batch = Batch.from_sequences(seqs, answer_starts=[20, 5, 30])
    _, state = calibrate(teacher, [batch], 2, group, ridge=1e-12, progress=False)
    assert int(batch.answer_mask.sum()) == 78
    want = _attention_weighted_fits(teacher, batch, 2, group, prior_queries)
    assert len(want) == (2 if group == 2 else 4) * (2 if teacher.config.attention_bias else 1)
    for key, value in want.items():
        torch.testing.assert_close(state[key].double(), value, rtol=0, atol=2e-4, msg=key)


def _agreement(teacher, student, batches) -> float:
    """Top-1 agreement of student (SwiftKV path) with teacher at the scored positions."""
    same = total = 0
    with torch.no_grad():
        for batch in batches:
            want = training_forward(teacher, batch.input_ids, swiftkv=False, logits_mask=batch.logits_mask)
            got = training_forward(student, batch.input_ids, swiftkv=True, logits_mask=batch.logits_mask)
            same += int((want.logits.argmax(-1) == got.logits.argmax(-1)).sum())
            total += want.logits.shape[0]
    return same / total


@pytest.mark.parametrize("name", sorted(PLAIN_MODELS))
def test_calibration_beats_snowflake_init_on_held_out_data(name):
    teacher = tiny_model(tiny_config(**PLAIN_MODELS[name]), seed=3)
    vocab, big_l = teacher.config.vocab_size, 1
    train, held_out = _random_batches(vocab, 12, seed=0), _random_batches(vocab, 4, seed=99)
    config, state = calibrate(teacher, train, big_l, progress=False)
    init_config, init_state = swiftkv_init(teacher.config, teacher.state_dict(), big_l)
    calibrated, init = SwiftKVForCausalLM(config).eval(), SwiftKVForCausalLM(init_config).eval()
    calibrated.load_state_dict(state)
    init.load_state_dict(init_state)
    got, baseline = _agreement(teacher, calibrated, held_out), _agreement(teacher, init, held_out)
    assert got > baseline + 0.05, f"{name}: calibrated {got:.3f} vs init {baseline:.3f}"


def test_bad_settings_are_refused_before_reading_data():
    teacher = tiny_model(tiny_config(num_hidden_layers=4))

    def no_batches():
        raise AssertionError("data was read")
        yield

    with pytest.raises(ConfigError, match="num_key_value_layers"):
        calibrate(teacher, no_batches(), 0)
    with pytest.raises(ConfigError, match="key_value_group_size"):
        calibrate(teacher, no_batches(), 1, 2)
    with pytest.raises(ValueError, match="ridge must be >= 0"):
        calibrate(teacher, no_batches(), 2, ridge=-1.0)
    with pytest.raises(ValueError, match="weighting must be one of attention, uniform"):
        calibrate(teacher, no_batches(), 2, weighting="mass")
    with pytest.raises(CalibrationError, match="< num_hidden_layers"):
        calibrate(teacher, no_batches(), 4)
    with pytest.raises(CheckpointError, match="already a SwiftKV model"):
        calibrate(
            tiny_model(tiny_config(model_type="llama_swiftkv", num_key_value_layers=2)), no_batches(), 2
        )
    with pytest.raises(CalibrationError, match="no calibration rows"):
        calibrate(teacher, [], 2, progress=False)


def test_statistics_larger_than_the_device_are_refused_before_reading_data(monkeypatch):
    """The attention weighting keeps 2 x kv_heads systems per cache layer: on a device too small for
    them calibrate says so, and what fits, before it reads any data."""
    teacher = tiny_model(tiny_config(num_hidden_layers=4))

    def no_batches():
        raise AssertionError("data was read")
        yield

    module = sys.modules["swiftkv_distill.calibrate"]
    # 2 leaders x (token + pooled) systems of 64^2 fp64, and their 2 x (64 + 32) target columns
    need = 8 * 64 * (4 * 64 + 2 * (64 + 32))
    monkeypatch.setattr(module, "device_memory_bytes", lambda device: need - 1)
    with pytest.raises(CalibrationError, match="keeps 0.0 GiB of fp64 statistics.*use weighting='uniform'"):
        calibrate(teacher, no_batches(), 2)
    monkeypatch.setattr(module, "device_memory_bytes", lambda device: need)
    with pytest.raises(CalibrationError, match="no calibration rows"):
        calibrate(teacher, [], 2, progress=False)


@pytest.mark.parametrize("name", ["llama", "qwen2_hybrid_bias"])
@pytest.mark.parametrize("group, weighting", [(1, "attention"), (2, "attention"), (2, "uniform")])
def test_statistics_of_parts_add_up_to_the_whole(name, group, weighting):
    """K-fold cross-validation's arithmetic: the statistics of disjoint parts of the data, added, fit
    what one pass over all of it fits (the value prior counts the sum's queries), and fitting leaves the
    statistics as they were (a sum is fitted once per fold)."""
    teacher = tiny_model(tiny_config(**PLAIN_MODELS[name]), seed=3)
    parts = [_random_batches(teacher.config.vocab_size, n, seed=i) for i, n in enumerate((2, 1, 3))]
    every = [b for part in parts for b in part]
    whole = calibrate(teacher, every, 2, group, weighting=weighting, progress=False)
    stats = [collect_statistics(teacher, p, 2, group, weighting=weighting, progress=False) for p in parts]
    total = sum(stats[1:], stats[0].empty()) + stats[0]
    assert total.num_tokens == sum(s.num_tokens for s in stats)
    assert total.num_queries == sum(s.num_queries for s in stats)
    before = total.accumulator.copy()
    for _ in range(2):
        config, state = fit(teacher, total)
        assert config == whole[0] and set(state) == set(whole[1])
        for key, value in whole[1].items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert torch.equal(total.accumulator.sts, before.sts) and torch.equal(total.accumulator.sty, before.sty)
    # one part's fit differs from the whole's: the sum above is not trivially one part
    one = fit(teacher, stats[2])[1]
    assert any(not torch.allclose(one[k], whole[1][k]) for k in whole[1] if "_swiftkv" in k)


def test_statistics_of_different_fits_do_not_add_up():
    teacher = tiny_model(tiny_config(num_hidden_layers=5), seed=3)
    data = _random_batches(teacher.config.vocab_size, 1, seed=0)
    a = collect_statistics(teacher, data, 2, progress=False)
    for other in (
        collect_statistics(teacher, data, 3, progress=False),
        collect_statistics(teacher, data, 2, weighting="uniform", progress=False),
    ):
        with pytest.raises(ValueError, match="do not add up"):
            a + other
    with pytest.raises(ValueError, match="same fits"):
        a.accumulator + Accumulator(3, {0: 2})
    with pytest.raises(CalibrationError, match="no calibration rows"):
        fit(teacher, a.empty())
