"""Distillation: Snowflake's loss equals a brute-force computation, training lowers the KL and writes
only the SwiftKV parameters, the schedule, checkpoints that resume bit-for-bit, and refusals."""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import logging
import math

import pytest
import torch
from swiftkv_distill.batch import Batch
from swiftkv_distill.calibrate import calibrate
from swiftkv_distill.distill import (
    DistillConfig,
    TeacherCache,
    distill,
    distill_loss,
    trainable_parameters,
)
from swiftkv_distill.forward import training_forward
from swiftkv_distill.precision import resolve_precision
from swiftkv_distill.trainer_state import META_FILE, TENSORS_FILE, list_checkpoints
from swiftkv_reference.checkpoint import swiftkv_init
from swiftkv_reference.model import SwiftKVForCausalLM
from swiftkv_reference.testing import tiny_config, tiny_model
from tiny_models import PLAIN_MODELS

distill_module = importlib.import_module("swiftkv_distill.distill")  # the package exports the function
precision_module = importlib.import_module("swiftkv_distill.precision")
SWIFTKV_NAMES = ("norm_swiftkv", "q_proj_swiftkv", "k_proj_swiftkv", "v_proj_swiftkv")


def _student(name: str = "llama", big_l: int = 1, group: int = 1) -> SwiftKVForCausalLM:
    """Snowflake's initialisation of a tiny random teacher."""
    teacher = tiny_model(tiny_config(**PLAIN_MODELS[name]), seed=3)
    config, state = swiftkv_init(teacher.config, teacher.state_dict(), big_l, group)
    model = SwiftKVForCausalLM(config).eval()
    model.load_state_dict(state)
    return model


def _batches(num: int, seed: int = 0, vocab: int = 128) -> list[Batch]:
    """Right-padded prompt + answer batches of uneven lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        lengths = torch.randint(8, 25, (3,), generator=g).tolist()
        seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
        out.append(Batch.from_sequences(seqs, answer_starts=[n // 2 for n in lengths]))
    return out


def _mean_kl(model: SwiftKVForCausalLM, batches: list[Batch], temperature: float = 1.0) -> float:
    """Mean KL(teacher || student) per scored position."""
    total = count = 0.0
    with torch.no_grad():
        for b in batches:
            t = training_forward(model, b.input_ids, swiftkv=False, logits_mask=b.logits_mask).logits
            s = training_forward(model, b.input_ids, swiftkv=True, logits_mask=b.logits_mask).logits
            log_t, log_s = t.log_softmax(-1), s.log_softmax(-1)
            total += float((log_t.exp() * (log_t - log_s)).sum())
            count += t.shape[0]
    return total / count


def _snapshot(model) -> dict[str, bytes]:
    return {k: v.detach().numpy().tobytes() for k, v in model.state_dict().items()}


def _brute_kl_mse(s_logits, t_logits, s_hidden, t_hidden, temperature, mult):
    """The loss by its definition, one position and one unit at a time, in fp64."""
    kl = 0.0
    for s_row, t_row in zip(s_logits.double().tolist(), t_logits.double().tolist()):
        zs = sum(math.exp(x / temperature) for x in s_row)
        zt = sum(math.exp(x / temperature) for x in t_row)
        for xs, xt in zip(s_row, t_row):
            p, q = math.exp(xt / temperature) / zt, math.exp(xs / temperature) / zs
            kl += p * math.log(p / q)
    logits_loss = kl / max(len(s_logits), 1) * temperature**2
    diffs = [(a - b) ** 2 for a, b in zip(s_hidden.flatten().tolist(), t_hidden.flatten().tolist())]
    hidden_loss = sum(diffs) / len(diffs)
    return logits_loss + mult * hidden_loss, logits_loss, hidden_loss


def test_loss_function_is_its_definition():
    g = torch.Generator().manual_seed(0)
    s_logits, t_logits = 3 * torch.randn(5, 11, generator=g), 3 * torch.randn(5, 11, generator=g)
    s_hidden, t_hidden = torch.randn(7, 6, generator=g), torch.randn(7, 6, generator=g)
    for temperature, mult in [(2.0, 1.0), (1.0, 0.0), (0.5, 3.0)]:
        got = distill_loss(s_logits, t_logits, s_hidden, t_hidden, temperature, mult)
        want = _brute_kl_mse(s_logits, t_logits, s_hidden, t_hidden, temperature, mult)
        for a, b in zip(got, want):
            assert float(a) == pytest.approx(b, rel=1e-5, abs=1e-7)
    empty = distill_loss(s_logits[:0], t_logits[:0], s_hidden, t_hidden)  # no scored position
    assert float(empty[1]) == 0.0 and float(empty[0]) == float(empty[2])


def test_loss_gradient_equals_autograd_of_the_formula_across_chunks(monkeypatch):
    """The KL's gradient (computed with the loss, a few rows at a time) equals autograd's gradient of
    the plain formula, whether the rows fit one chunk or span several."""
    from swiftkv_distill.distill import _ChunkedKL

    g = torch.Generator().manual_seed(1)
    t_logits = 3 * torch.randn(9, 13, generator=g)
    s0 = 3 * torch.randn(9, 13, generator=g)
    hidden = torch.randn(4, 6, generator=g)
    for chunk_bytes in (1 << 20, 4 * 13 * 2):  # one chunk; two rows per chunk
        monkeypatch.setattr(_ChunkedKL, "CHUNK_BYTES", chunk_bytes)
        # T = 1 and an upstream factor of 1 skip their (exact) divisions and multiplication
        for temperature, factor in ((2.0, 3.0), (0.7, 3.0), (1.0, 3.0), (1.0, 1.0)):
            s_ref, s_got = s0.clone().requires_grad_(), s0.clone().requires_grad_()
            log_t = torch.log_softmax(t_logits / temperature, -1)
            log_s = torch.log_softmax(s_ref / temperature, -1)
            want = (log_t.exp() * (log_t - log_s)).sum() / 9 * temperature**2
            want.backward()
            got = distill_loss(s_got, t_logits, hidden, hidden, temperature, 1.0)[0]
            (factor * got).backward()  # an upstream factor reaches the gradient
            assert float(got) == pytest.approx(float(want), rel=1e-6)
            torch.testing.assert_close(s_got.grad, factor * s_ref.grad, rtol=1e-5, atol=1e-8)


def test_bf16_logits_give_the_kl_of_their_fp32_values_and_a_bf16_gradient(monkeypatch):
    """Under bf16 autocast the logits reach the KL in bf16: each chunk is upcast on its own, so the loss
    is that of the fp32 values, and the gradient comes back in bf16, the fp32 one rounded once (what
    autocast's cast of an fp32 gradient gives the output projection's backward)."""
    from swiftkv_distill.distill import _ChunkedKL

    g = torch.Generator().manual_seed(2)
    t_logits = (3 * torch.randn(9, 13, generator=g)).bfloat16()
    s0 = (3 * torch.randn(9, 13, generator=g)).bfloat16()
    hidden = torch.randn(4, 6, generator=g)
    monkeypatch.setattr(_ChunkedKL, "CHUNK_BYTES", 4 * 13 * 2)  # two rows per chunk
    for temperature in (1.0, 2.0):
        s_fp32, s_bf16 = s0.float().requires_grad_(), s0.clone().requires_grad_()
        want = distill_loss(s_fp32, t_logits.float(), hidden, hidden, temperature, 1.0)[1]
        got = distill_loss(s_bf16, t_logits, hidden, hidden, temperature, 1.0)[1]
        want.backward()
        got.backward()
        assert got.dtype == torch.float32 and float(got) == float(want)
        assert s_bf16.grad.dtype == torch.bfloat16
        assert torch.equal(s_bf16.grad, s_fp32.grad.bfloat16())


def _layer_input(model: SwiftKVForCausalLM, layer: int, ids: torch.Tensor, swiftkv: bool) -> torch.Tensor:
    """h_layer, read by a hook on the input of its input_layernorm: (B, T, hidden)."""
    seen = []
    norm = model.model.layers[layer].input_layernorm
    handle = norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            training_forward(model, ids, swiftkv=swiftkv, compute_logits=False)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("hidden_loss_layer", [-2, -1])
def test_first_step_loss_is_snowflakes_loss_of_the_initial_model(hidden_loss_layer):
    """The logged loss of step 1 (two micro-batches) is the brute-force loss of the untrained model:
    KL at T = 2 over logits_mask, scaled by T^2, plus the MSE of h_{N-1} (-2, ArcticTraining's
    default) or of the final norm's output (-1) over the real tokens, averaged over the micro-batches."""
    model = _student()
    batches = _batches(2)
    n = model.config.num_hidden_layers
    want = []
    for b in batches:
        with torch.no_grad():
            t = training_forward(model, b.input_ids, swiftkv=False)
            s = training_forward(model, b.input_ids, swiftkv=True)
        if hidden_loss_layer == -2:
            t_h = _layer_input(model, n - 1, b.input_ids, swiftkv=False)
            s_h = _layer_input(model, n - 1, b.input_ids, swiftkv=True)
        else:
            with torch.no_grad():
                t_h, s_h = model.model.norm(t.hidden), model.model.norm(s.hidden)
        m, rows = b.logits_mask, b.attention_mask
        want.append(_brute_kl_mse(s.logits[m], t.logits[m], s_h[rows], t_h[rows], 2.0, 1.0))
    config = DistillConfig(
        steps=1, gradient_accumulation_steps=2, hidden_loss_layer=hidden_loss_layer, precision="fp32"
    )
    result = distill(model, batches, config, progress=False)
    assert result.losses[0] == pytest.approx(sum(w[0] for w in want) / 2, rel=1e-5)
    assert result.logits_losses[0] == pytest.approx(sum(w[1] for w in want) / 2, rel=1e-5)
    assert result.hidden_losses[0] == pytest.approx(sum(w[2] for w in want) / 2, rel=1e-5)
    assert result.hidden_losses[0] > 0


def test_kl_only_runs_the_late_layers_on_the_scored_positions_and_trains_the_same():
    """hidden_loss_mult = 0: the student's layers >= L run only the scored positions, the hidden loss is
    reported (not trained on) there, and the steps equal those of the full forward (a hidden loss of
    weight 1e-30 keeps it) up to float reassociation."""
    batches, n = _batches(2), _student().config.num_hidden_layers
    model = _student()
    want = []
    for b in batches:
        with torch.no_grad():
            t = training_forward(model, b.input_ids, swiftkv=False)
            s = training_forward(model, b.input_ids, swiftkv=True)
        t_h = _layer_input(model, n - 1, b.input_ids, swiftkv=False)
        s_h = _layer_input(model, n - 1, b.input_ids, swiftkv=True)
        m = b.logits_mask
        want.append(_brute_kl_mse(s.logits[m], t.logits[m], s_h[m], t_h[m], 1.0, 0.0))
    results, states = [], []
    for mult in (0.0, 1e-30):
        model = _student()
        config = DistillConfig(
            steps=3,
            lr=1e-2,
            gradient_accumulation_steps=2,
            logits_loss_temp=1.0,
            hidden_loss_mult=mult,
            precision="fp32",
        )
        calls = []

        def recording(*args, calls=calls, real=distill_module.training_forward, **kwargs):
            calls.append(kwargs)
            return real(*args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(distill_module, "training_forward", recording)
            results.append(distill(model, batches, config, progress=False))
        assert {k.get("scored_only", False) for k in calls if k["swiftkv"]} == {mult == 0}
        states.append({k: v.clone() for k, v in trainable_parameters(model).items()})
    kl_only = results[0]
    assert kl_only.losses[0] == pytest.approx(sum(w[0] for w in want) / 2, rel=1e-5)
    assert kl_only.hidden_losses[0] == pytest.approx(sum(w[2] for w in want) / 2, rel=1e-5)
    assert kl_only.logits_losses == pytest.approx(results[1].logits_losses, rel=1e-5)
    # AdamW moves a weight whose gradient is at rounding level by up to lr per step whatever its size, so
    # reassociation can move a rare weight by ~1e-5 here (seen: 1 of 2,048 by 7e-6); a wrong forward
    # moves most of them by ~lr = 1e-2
    for key, value in states[0].items():
        torch.testing.assert_close(value, states[1][key], rtol=1e-4, atol=5e-5, msg=key)


@pytest.mark.parametrize("name, big_l, group", [("llama", 1, 1), ("qwen2_hybrid_bias", 2, 2)])
def test_lowers_the_kl_and_writes_only_swiftkv_parameters(name, big_l, group):
    model = _student(name, big_l, group)
    model.model.embed_tokens.weight.requires_grad_(False)  # a caller's flag, restored on return
    batches, held_out = _batches(6), _batches(3, seed=1)
    before, kl_train, kl_held = _snapshot(model), _mean_kl(model, batches), _mean_kl(model, held_out)
    config = DistillConfig(steps=12, lr=1e-2, warmup_ratio=0.25, gradient_accumulation_steps=2)
    result = distill(model, batches, config, progress=False)
    assert len(result.losses) == 12 and all(math.isfinite(x) for x in result.losses)
    assert result.learning_rates == [config.lr_at(s) for s in range(12)]
    assert _mean_kl(model, batches) < 0.8 * kl_train
    assert _mean_kl(model, held_out) < kl_held
    after = _snapshot(model)
    trainable = set(trainable_parameters(model))
    assert trainable == {k for k in before if any(n in k.split(".") for n in SWIFTKV_NAMES)}
    assert any(k.endswith(".bias") for k in trainable) == model.config.attention_bias
    for key in before:
        assert (before[key] == after[key]) == (key not in trainable), key
    flags = {k: p.requires_grad for k, p in model.named_parameters()}
    assert flags.pop("model.embed_tokens.weight") is False and all(flags.values())
    assert all(p.grad is None for k, p in model.named_parameters() if k not in trainable)


def test_warmup_then_cosine_schedule():
    config = DistillConfig(steps=10, lr=1.0, warmup_ratio=0.2)  # 2 warm-up steps
    cos = [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]
    assert config.warmup_steps == 2
    assert [config.lr_at(s) for s in range(10)] == pytest.approx([0.5, 1.0] + cos, rel=1e-12)
    no_warmup = DistillConfig(steps=4, lr=2e-4, warmup_ratio=0.0)
    assert [no_warmup.lr_at(s) for s in range(4)] == pytest.approx(
        [2e-4, 2e-4 * (1 + math.cos(math.pi / 4)) / 2, 1e-4, 2e-4 * (1 + math.cos(3 * math.pi / 4)) / 2]
    )
    assert DistillConfig(steps=100).warmup_steps == 5  # Snowflake's warmup_ratio 0.05
    assert DistillConfig(steps=3, warmup_ratio=1.0).lr_at(2) == DistillConfig(steps=3).lr


class _Crashing:
    """Re-iterable batches that raise after `limit` batches have been read in all (a killed run)."""

    def __init__(self, batches: list[Batch], limit: int):
        self.batches, self.limit, self.read = batches, limit, 0

    def __iter__(self):
        for b in self.batches:
            if self.read == self.limit:
                raise KeyboardInterrupt("killed")
            self.read += 1
            yield b


def test_teacher_cache_changes_nothing_but_the_work(caplog):
    """Later epochs reuse the teacher's outputs: the same losses and tensors, bit for bit, as a run
    that recomputes the teacher every step."""
    init = _student("qwen2_hybrid_bias", 2, 2)
    batches = _batches(3)
    runs = {}
    for gib in (0.0, 1.0):
        model = copy.deepcopy(init)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="swiftkv_distill.distill"):
            config = DistillConfig(steps=5, lr=3e-3, teacher_cache_gib=gib)
            result = distill(model, batches, config, progress=False)
        runs[gib] = (model.state_dict(), result, caplog.text)
    assert "3 computed, 2 reused" in runs[1.0][2] and "reused" not in runs[0.0][2]
    assert runs[1.0][1].losses == runs[0.0][1].losses
    assert all(torch.equal(runs[1.0][0][k], runs[0.0][0][k]) for k in runs[0.0][0])


@pytest.mark.parametrize(
    "hidden_loss_mult, hidden_loss_layer", [(1.0, -2), (0.0, -2), (1.0, 1), (1.0, -1)]
)  # the MSE at layer 3, none (scored rows only), below L (the student starts there), after the final norm
def test_calibrations_teacher_pass_fills_the_first_epoch(caplog, hidden_loss_mult, hidden_loss_layer):
    """Calibration's teacher pass over the same batches (in another order) fills a TeacherCache: the
    distillation then runs no teacher forward, and its losses and tensors equal a run that computes
    the teacher itself (calibration attends explicitly, not with SDPA: equal up to reassociation).
    Batches distillation will not read are not kept."""
    teacher = tiny_model(tiny_config(**PLAIN_MODELS["qwen2_hybrid_bias"]), seed=3)
    batches = _batches(4)
    shuffled = [batches[i] for i in (2, 0, 3, 1)]
    config, state = calibrate(teacher, batches, 2, progress=False)
    init = SwiftKVForCausalLM(config).eval()
    init.load_state_dict(state)
    distill_config = DistillConfig(
        steps=6,
        lr=3e-3,
        hidden_loss_mult=hidden_loss_mult,
        hidden_loss_layer=hidden_loss_layer,
        precision="fp32",
    )
    cache = TeacherCache(config, distill_config)
    cache.expect(shuffled[:3])  # the fourth batch is not read by this distillation
    calibrate(
        teacher,
        batches,
        2,
        progress=False,
        keep_states=cache.keep_states,
        on_batch=lambda batch, out: cache.offer(teacher, batch, out),
    )
    assert len(cache.outputs) == 3 and cache.num_misses == 0
    runs = {}
    for name, teacher_cache in (("own", None), ("calibration's", cache)):
        model = copy.deepcopy(init)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="swiftkv_distill.distill"):
            result = distill(model, shuffled[:3], distill_config, progress=False, teacher_cache=teacher_cache)
        runs[name] = (model.state_dict(), result, caplog.text)
    assert "0 computed, 6 reused" in runs["calibration's"][2] and "3 computed, 3 reused" in runs["own"][2]
    for key in ("losses", "logits_losses", "hidden_losses", "grad_norms"):
        torch.testing.assert_close(
            getattr(runs["calibration's"][1], key), getattr(runs["own"][1], key), rtol=1e-4, atol=1e-6
        )
    for k, v in runs["own"][0].items():
        torch.testing.assert_close(runs["calibration's"][0][k], v, rtol=1e-4, atol=1e-4)  # Adam: ~sign steps


@pytest.mark.parametrize(
    "made_for, run",
    [
        (dict(hidden_loss_mult=0.0), dict()),  # scored rows only against every row
        (dict(hidden_loss_layer=-1), dict(hidden_loss_layer=2)),  # the MSE's targets: norm(h_4) against h_2
    ],
)
def test_a_teacher_cache_for_another_loss_is_refused(made_for, run):
    model = _student("llama", 2)
    before = copy.deepcopy(model.state_dict())
    cache = TeacherCache(model.config, DistillConfig(steps=1, **made_for))
    with pytest.raises(ValueError, match="teacher_cache was made for another model or loss"):
        distill(model, _batches(2), DistillConfig(steps=1, **run), progress=False, teacher_cache=cache)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_resume_equals_an_uninterrupted_run(tmp_path):
    """Killed in step 4 (5 batches cycled, 2 per step, a checkpoint every 2 steps), resumed on a fresh
    copy of the initial model: the same tensors and history, bit for bit, as a run never stopped."""
    init = _student("qwen2_hybrid_bias", 2, 2)
    batches = _batches(5)
    config = DistillConfig(
        steps=6,
        lr=3e-3,
        warmup_ratio=0.5,
        gradient_accumulation_steps=2,
        checkpoint_every=2,
        keep_checkpoints=1,
    )
    whole = copy.deepcopy(init)
    want = distill(whole, batches, config, checkpoint_dir=tmp_path / "a", progress=False)

    crashed = copy.deepcopy(init)
    with pytest.raises(KeyboardInterrupt):
        distill(
            crashed, _Crashing(batches, limit=1 + 7), config, checkpoint_dir=tmp_path / "b", progress=False
        )
    assert [step for step, _ in list_checkpoints(tmp_path / "b")] == [2]  # keep_checkpoints=1
    resumed = copy.deepcopy(init)
    got = distill(resumed, batches, config, checkpoint_dir=tmp_path / "b", resume=True, progress=False)

    assert got.start_step == 2 and want.start_step == 0
    for key in ("losses", "logits_losses", "hidden_losses", "learning_rates", "grad_norms"):
        assert getattr(got, key) == getattr(want, key), key
    state, want_state = resumed.state_dict(), whole.state_dict()
    assert all(torch.equal(state[k], want_state[k]) for k in state)
    assert got.checkpoint.name == "step-00000006" and sorted(p.name for p in got.checkpoint.iterdir()) == [
        META_FILE,
        TENSORS_FILE,
    ]
    again = distill(
        copy.deepcopy(init), batches, config, checkpoint_dir=tmp_path / "b", resume=True, progress=False
    )
    assert again.start_step == 6 and again.losses == want.losses  # nothing left to do


class _NeverRead:
    def __iter__(self):
        raise AssertionError("the batches were read")


@pytest.mark.parametrize(
    "field, value",
    [
        ("steps", 0),
        ("steps", 2.0),
        ("steps", True),
        ("lr", 0.0),
        ("lr", float("nan")),
        ("warmup_ratio", 1.5),
        ("gradient_accumulation_steps", 0),
        ("weight_decay", -0.1),
        ("betas", (0.9, 1.0)),
        ("betas", (0.9,)),
        ("eps", 0.0),
        ("max_grad_norm", 0.0),
        ("logits_loss_temp", -2.0),
        ("hidden_loss_mult", float("inf")),
        ("hidden_loss_layer", 1.5),
        ("teacher_cache_gib", -1.0),
        ("checkpoint_every", 0),
        ("keep_checkpoints", 0),
        ("precision", "fp16"),
    ],
)
def test_bad_settings_name_their_field(field, value):
    kwargs = {"steps": 3, field: value}
    with pytest.raises(ValueError, match=rf"DistillConfig\.{field} must be"):
        DistillConfig(**kwargs)


def test_bad_input_is_refused_before_any_work(tmp_path):
    model = _student()
    before = _snapshot(model)
    config = DistillConfig(steps=2)
    plain = tiny_model(tiny_config(num_hidden_layers=4))
    with pytest.raises(ValueError, match="needs a SwiftKV model"):
        distill(plain, _NeverRead(), config)
    with pytest.raises(ValueError, match=r"hidden_loss_layer must be in \[-5, 4\]"):
        distill(model, _NeverRead(), DistillConfig(steps=2, hidden_loss_layer=5))
    with pytest.raises(TypeError, match="must be re-iterable"):
        distill(model, iter(_batches(2)), config)
    with pytest.raises(TypeError, match="DistillConfig"):
        distill(model, _NeverRead(), {"steps": 2})
    with pytest.raises(ValueError, match="resume=True needs a checkpoint_dir"):
        distill(model, _NeverRead(), config, resume=True)
    with pytest.raises(ValueError, match="batches is empty"):
        distill(model, [], config)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        distill(model, _NeverRead(), config, checkpoint_dir=tmp_path / "file")
    assert _snapshot(model) == before

    done = copy.deepcopy(model)
    distill(done, _batches(2), config, checkpoint_dir=tmp_path / "ckpt", progress=False)
    with pytest.raises(ValueError, match="already holds distillation checkpoints"):
        distill(model, _NeverRead(), config, checkpoint_dir=tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"settings differ \(lr: saved 0.0002, now 0.001\)"):
        distill(
            model,
            _NeverRead(),
            DistillConfig(steps=2, lr=1e-3),
            checkpoint_dir=tmp_path / "ckpt",
            resume=True,
        )
    with pytest.raises(ValueError, match="it was made for"):
        distill(_student(big_l=2), _NeverRead(), config, checkpoint_dir=tmp_path / "ckpt", resume=True)
    assert _snapshot(model) == before
    # checkpoint_every and keep_checkpoints may change on resume
    distill(
        model,
        _batches(2),
        DistillConfig(steps=2, keep_checkpoints=None),
        checkpoint_dir=tmp_path / "ckpt",
        resume=True,
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_autocast_lowers_the_kl():
    model = _student()
    batches = _batches(4)
    kl = _mean_kl(model, batches)
    result = distill(model, batches, DistillConfig(steps=10, lr=3e-3), device="cuda", progress=False)
    assert all(math.isfinite(x) for x in result.losses)
    assert next(model.parameters()).dtype == torch.float32
    assert _mean_kl(model.cpu(), batches) < 0.7 * kl


def test_bf16_autocast_on_cpu_trains_fp32_weights_and_lowers_the_kl():
    """precision="bf16" runs the forwards under CPU autocast (other losses than fp32's), keeps the
    weights fp32, writes only the SwiftKV parameters and still lowers the KL."""
    init = _student("qwen2_hybrid_bias", 2, 2)
    batches = _batches(4)
    kl = _mean_kl(init, batches)
    runs = {}
    for precision in ("fp32", "bf16"):
        model = copy.deepcopy(init)
        config = DistillConfig(steps=10, lr=1e-2, warmup_ratio=0.2, precision=precision)
        runs[precision] = (model, distill(model, batches, config, progress=False))
    model, result = runs["bf16"]
    assert result.precision == "bf16" and runs["fp32"][1].precision == "fp32"
    assert all(math.isfinite(x) for x in result.losses) and result.losses != runs["fp32"][1].losses
    assert result.losses[0] == pytest.approx(runs["fp32"][1].losses[0], rel=0.05)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert _mean_kl(model, batches) < 0.8 * kl
    trainable = set(trainable_parameters(model))
    before, after = _snapshot(init), _snapshot(model)
    assert all((before[k] == after[k]) == (k not in trainable) for k in before)


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_copies_of_the_frozen_weights_give_autocasts_steps_bit_for_bit(tied, monkeypatch, caplog):
    """On CPU in bf16, distill holds bf16 copies of the frozen Linear weights and of the output projection
    (frozen_weights_in_bf16) instead of letting autocast cast them on every use: the same steps, bit for
    bit; the model's own fp32 Parameters (the same objects) are back on return, and after a failure."""
    plain = tiny_config(**PLAIN_MODELS["qwen2_hybrid_bias"], tie_word_embeddings=tied)
    config, state = swiftkv_init(plain, tiny_model(plain, seed=3).state_dict(), 2, 1)
    batches = _batches(3)

    def student():
        model = SwiftKVForCausalLM(config).eval()
        model.load_state_dict(state)
        return model, dict(model.named_parameters())

    def weight_dtypes(model):
        seen = []
        model.model.layers[-1].mlp.down_proj.register_forward_pre_hook(
            lambda m, a: seen.append(m.weight.dtype)
        )
        return seen

    runs = []
    caplog.set_level(logging.INFO, logger="swiftkv_distill.precision")
    for copies in (True, False):
        model, params = student()
        seen = weight_dtypes(model)
        trainable = trainable_parameters(model)
        linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        frozen = [p for m in linear for p in m.parameters() if all(p is not t for t in trainable.values())]
        caplog.clear()
        with pytest.MonkeyPatch.context() as mp:
            if not copies:
                mp.setattr(distill_module, "frozen_weights_in_bf16", lambda *a: contextlib.nullcontext())
            result = distill(
                model, batches, DistillConfig(steps=4, lr=1e-2, precision="bf16"), progress=False
            )
        assert set(seen) == {torch.bfloat16 if copies else torch.float32}
        if copies:  # the frozen Linear tensors, and the output projection once more only when tied
            assert f"bf16 copies of {len(frozen) + int(tied)} frozen weights" in caplog.text
        assert all(p is params[k] and p.dtype == torch.float32 for k, p in model.named_parameters())
        runs.append((result.losses, _snapshot(model)))
    assert runs[0] == runs[1]

    model, params = student()
    before = _snapshot(model)
    calls = []
    real = distill_module._micro_batch_loss

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return real(*args, **kwargs)

    monkeypatch.setattr(distill_module, "_micro_batch_loss", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        distill(model, batches, DistillConfig(steps=4, lr=1e-2, precision="bf16"), progress=False)
    assert all(p is params[k] and p.dtype == torch.float32 for k, p in model.named_parameters())
    after = _snapshot(model)
    trainable = set(trainable_parameters(model))
    assert all(before[k] == after[k] for k in before if k not in trainable)


def test_auto_precision_is_measured_once_per_shape(monkeypatch):
    """ "auto" takes bf16 on CPU only when the measured layer is BF16_MIN_SPEEDUP times as fast, asks the
    clock once per model shape in a process, and takes bf16 on CUDA without measuring."""
    monkeypatch.setattr(precision_module, "_chosen", {})
    timings = iter([(2.0, 1.0), (1.0, 2.0)])  # (fp32, bf16) seconds of the first and second measurement
    calls = []

    def fake_time_layer(model, device):
        calls.append(model.config.hidden_size)
        return next(timings)

    monkeypatch.setattr(precision_module, "_time_layer", fake_time_layer)
    small, large = _student(), tiny_model(tiny_config(num_hidden_layers=4, hidden_size=96, head_dim=48))
    cpu = torch.device("cpu")
    assert resolve_precision("auto", small, cpu) == "bf16"
    assert resolve_precision("auto", copy.deepcopy(small), cpu) == "bf16"  # remembered, not re-measured
    assert resolve_precision("auto", large, cpu) == "fp32"
    assert calls == [small.config.hidden_size, large.config.hidden_size]
    assert resolve_precision("fp32", small, cpu) == "fp32" and resolve_precision("bf16", large, cpu) == "bf16"
    assert resolve_precision("auto", small, torch.device("cuda")) == "bf16" and len(calls) == 2
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, bf16, got 'fp16'"):
        resolve_precision("fp16", small, cpu)


def test_layer_timing_changes_nothing():
    """The measurement runs a real layer both ways and leaves the weights, their gradients and the
    RNG state as they were."""
    model = _student("qwen2_hybrid_bias", 2, 2)
    before, rng = _snapshot(model), torch.get_rng_state()
    fp32, bf16 = precision_module._time_layer(model, torch.device("cpu"))
    assert 0 < fp32 < math.inf and 0 < bf16 < math.inf
    assert _snapshot(model) == before and torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


def test_a_resumed_run_keeps_the_precision_it_started_with(tmp_path, monkeypatch):
    """The checkpoint records what "auto" resolved to; resuming with "auto" reuses it without
    measuring (bit-for-bit resumption), and an explicit other precision is refused before any work."""
    init = _student()
    batches = _batches(2)
    bf16 = DistillConfig(steps=3, checkpoint_every=1, precision="bf16")
    with pytest.raises(KeyboardInterrupt):  # killed in step 3
        crashing = _Crashing(batches, limit=1 + 2)  # the emptiness check reads one
        distill(copy.deepcopy(init), crashing, bf16, checkpoint_dir=tmp_path, progress=False)

    def no_measuring(*args):
        raise AssertionError("a resumed run must not measure again")

    monkeypatch.setattr(precision_module, "resolve_precision", no_measuring)
    monkeypatch.setattr(distill_module, "resolve_precision", no_measuring)
    auto = DistillConfig(steps=3, checkpoint_every=1)
    got = distill(copy.deepcopy(init), batches, auto, checkpoint_dir=tmp_path, resume=True, progress=False)
    assert got.precision == "bf16" and got.start_step == 2
    model = copy.deepcopy(init)
    with pytest.raises(ValueError, match=r"settings differ \(precision: saved 'bf16', now 'fp32'\)"):
        fp32 = DistillConfig(steps=3, checkpoint_every=1, precision="fp32")
        distill(model, _NeverRead(), fp32, checkpoint_dir=tmp_path, resume=True)
    assert _snapshot(model) == _snapshot(init)
    meta_file = got.checkpoint / META_FILE  # a checkpoint from before `precision`: those ran fp32 on CPU
    meta = json.loads(meta_file.read_text())
    del meta["precision"]
    meta_file.write_text(json.dumps(meta))
    old = distill(copy.deepcopy(init), batches, auto, checkpoint_dir=tmp_path, resume=True, progress=False)
    assert old.precision == "fp32" and old.start_step == 3
