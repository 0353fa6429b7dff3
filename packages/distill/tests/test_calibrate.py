"""Closed-form calibration: the accumulated ridge fit is least squares, recovers a planted SwiftKV
projection, and beats Snowflake's initialisation on held-out data."""

from __future__ import annotations

import pytest
import torch
from swiftkv_distill.batch import Batch
from swiftkv_distill.calibrate import Accumulator, CalibrationError, calibrate
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
