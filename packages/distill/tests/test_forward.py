"""The training forward equals the reference's `forward` (fp32, every position, both paths) and is
differentiable in the SwiftKV parameters."""

from __future__ import annotations

import pytest
import torch
from swiftkv_distill.batch import Batch
from swiftkv_distill.forward import _scored_positions, training_forward
from swiftkv_reference.testing import fp32_atol, tiny_config, tiny_model
from tiny_models import FORWARD_MODELS, PLAIN_MODELS

LENGTHS = [20, 13, 1, 17]  # right-padded to 20; longer than the sliding windows (8)


def _batch(vocab: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch.from_sequences([torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS])


CASES = [(name, False) for name in FORWARD_MODELS] + [
    (name, True) for name in FORWARD_MODELS if name not in PLAIN_MODELS
]


@pytest.mark.parametrize("name, swiftkv", CASES)
def test_equals_reference_forward(name, swiftkv):
    config = tiny_config(**FORWARD_MODELS[name])
    model = tiny_model(config, seed=1)
    batch = _batch(config.vocab_size)
    got = training_forward(model, batch.input_ids, swiftkv=swiftkv).logits.detach()  # (B, T, vocab)
    selected = training_forward(model, batch.input_ids, swiftkv=swiftkv, logits_mask=batch.attention_mask)
    torch.testing.assert_close(selected.logits, got[batch.attention_mask], rtol=0, atol=0)
    for b, n in enumerate(LENGTHS):
        want = model.forward(batch.input_ids[b, :n], swiftkv=swiftkv)  # (n, vocab)
        err = float((got[b, :n] - want).abs().max())
        atol = fp32_atol(want, depth=config.num_hidden_layers)
        assert err <= atol, f"{name} swiftkv={swiftkv} row {b}: max abs err {err:.2e} > {atol:.2e}"


def test_capture_gives_pre_rope_kv_and_residual():
    """The captured K/V are the projections of each layer's own normed input, before RoPE, and the
    SwiftKV path's members of a group share the leader's."""
    config = tiny_config(**FORWARD_MODELS["swiftkv_g2"])  # L = 1, G = 2, N = 5
    model = tiny_model(config, seed=1)
    ids = _batch(config.vocab_size).input_ids
    teacher = training_forward(model, ids, swiftkv=False, capture_from=1, compute_logits=False)
    assert teacher.logits is None and sorted(teacher.kv) == [1, 2, 3, 4]
    layer1 = model.model.layers[1]
    x = layer1.input_layernorm(teacher.residual)
    torch.testing.assert_close(teacher.kv[1][0], layer1.self_attn.k_proj(x))
    torch.testing.assert_close(teacher.kv[1][1], layer1.self_attn.v_proj(x))
    student = training_forward(model, ids, swiftkv=True, capture_from=1, compute_logits=False)
    s = model.model.norm_swiftkv(student.residual)
    torch.testing.assert_close(student.kv[3][0], model.model.layers[3].self_attn.k_proj_swiftkv(s))
    assert torch.equal(student.kv[4][0], student.kv[3][0]) and torch.equal(student.kv[2][1], student.kv[1][1])


@pytest.mark.parametrize("swiftkv", [False, True])
def test_start_from_a_kept_state_equals_the_full_forward(swiftkv):
    """Distillation runs the student from the teacher's h_L: the same logits and states, bit for bit."""
    config = tiny_config(**FORWARD_MODELS["qwen2_hybrid_swiftkv"])  # L = 1, AcrossKV, sliding layers
    model = tiny_model(config, seed=1)
    batch = _batch(config.vocab_size)
    n, big_l = config.num_hidden_layers, config.num_key_value_layers
    full = training_forward(
        model, batch.input_ids, swiftkv=swiftkv, logits_mask=batch.logits_mask, keep_states=(0, big_l, n - 1)
    )
    torch.testing.assert_close(full.states[0], model.model.embed_tokens(batch.input_ids), rtol=0, atol=0)
    resumed = training_forward(
        model,
        batch.input_ids,
        swiftkv=swiftkv,
        logits_mask=batch.logits_mask,
        keep_states=(n - 1,),
        start=(big_l, full.states[big_l]),
    )
    assert sorted(resumed.states) == [n - 1]
    torch.testing.assert_close(resumed.logits, full.logits, rtol=0, atol=0)
    torch.testing.assert_close(resumed.states[n - 1], full.states[n - 1], rtol=0, atol=0)


def test_attention_hook_sees_each_layers_stream_probabilities_and_output():
    config = tiny_config(**FORWARD_MODELS["qwen2_hybrid_swiftkv"])  # sliding and full layers
    model = tiny_model(config, seed=1)
    batch = _batch(config.vocab_size)
    seen = {}

    def hook(i, h, probs, attn):
        seen[i] = (h.clone(), probs.clone(), attn.clone())

    with torch.no_grad():
        plain = training_forward(model, batch.input_ids, swiftkv=False, capture_from=2, keep_states=(3,))
        out = training_forward(model, batch.input_ids, swiftkv=False, capture_from=2, attention_hook=hook)
    assert sorted(seen) == list(range(2, config.num_hidden_layers))
    torch.testing.assert_close(out.logits, plain.logits)  # the explicit attention is the same attention
    torch.testing.assert_close(seen[2][0], plain.residual, rtol=0, atol=0)
    torch.testing.assert_close(seen[3][0], plain.states[3])
    heads, d, rep = (
        config.num_attention_heads,
        config.head_dim,
        config.num_attention_heads // config.num_key_value_heads,
    )
    num_tokens = batch.input_ids.shape[1]
    for i, (_, probs, attn) in seen.items():
        assert probs.shape == (len(LENGTHS), heads, num_tokens, num_tokens)
        torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs[..., 0]))
        assert float(probs.triu(1).abs().max()) == 0  # causal
        window = config.window(i)
        if window is not None:  # nothing older than the window
            assert float(probs.tril(-window).abs().max()) == 0
        v = out.kv[i][1].view(len(LENGTHS), num_tokens, -1, d).repeat_interleave(rep, 2)  # (B, T, heads, d)
        want = torch.einsum("bhqt,bthd->bqhd", probs, v).reshape(attn.shape)
        torch.testing.assert_close(attn, want)
    with pytest.raises(ValueError, match="attention_hook needs capture_from"):
        training_forward(model, batch.input_ids, swiftkv=False, attention_hook=hook)


@pytest.mark.parametrize("name", [name for name in FORWARD_MODELS if name not in PLAIN_MODELS])
def test_scored_only_equals_the_full_forward_at_the_scored_positions(name):
    """Layers >= L on the scored positions only: the same logits, states and gradients (a row with no
    scored position included: LENGTHS has a 1-token row)."""
    config = tiny_config(**FORWARD_MODELS[name])
    model = tiny_model(config, seed=1)
    batch = _batch(config.vocab_size)
    n, big_l = config.num_hidden_layers, config.num_key_value_layers
    mask = batch.logits_mask
    assert not mask[LENGTHS.index(1)].any()
    outs, grads = [], []
    for scored_only in (False, True):
        model.zero_grad(set_to_none=True)
        out = training_forward(
            model,
            batch.input_ids,
            swiftkv=True,
            logits_mask=mask,
            keep_states=(big_l, n - 1),
            scored_only=scored_only,
        )
        hidden = out.hidden if scored_only else out.hidden[mask]  # (P, hidden)
        (out.logits.logsumexp(-1).sum() + hidden.square().sum()).backward()
        outs.append(out)
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    full, scored = outs
    assert scored.logits.shape == full.logits.shape == (int(mask.sum()), config.vocab_size)
    torch.testing.assert_close(scored.logits, full.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scored.hidden, full.hidden[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scored.states[n - 1], full.states[n - 1][mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scored.states[big_l], full.states[big_l], rtol=0, atol=0)
    assert grads[0].keys() == grads[1].keys()
    for key in grads[0]:
        scale = float(grads[0][key].abs().max())  # sums over the rows reassociate: relative to the largest
        torch.testing.assert_close(grads[1][key], grads[0][key], rtol=1e-5, atol=1e-5 * scale, msg=key)


def test_scored_only_positions_pad_short_rows():
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    positions, valid = _scored_positions(mask)
    assert positions.tolist() == [[1, 2], [0, 3], [3, 3]]
    assert valid.tolist() == [[True, True], [True, False], [False, False]]


def test_gradients_reach_swiftkv_parameters():
    config = tiny_config(**FORWARD_MODELS["qwen2_hybrid_swiftkv"])  # bias, AcrossKV, sliding layers
    model = tiny_model(config, seed=1)
    batch = _batch(config.vocab_size)
    out = training_forward(model, batch.input_ids, swiftkv=True, logits_mask=batch.logits_mask)
    (out.logits.logsumexp(-1).sum() + out.hidden.square().mean()).backward()
    names = ["model.norm_swiftkv.weight"] + [
        f"model.layers.{i}.self_attn.{p}.{t}"
        for i, p in [
            (1, "q_proj_swiftkv"),
            (4, "q_proj_swiftkv"),
            (1, "k_proj_swiftkv"),
            (3, "v_proj_swiftkv"),
        ]
        for t in ("weight", "bias")
    ]
    params = dict(model.named_parameters())
    for name in names:
        grad = params[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    # the teacher path never reads the SwiftKV parameters
    model.zero_grad(set_to_none=True)
    training_forward(model, batch.input_ids, swiftkv=False).logits.sum().backward()
    assert params["model.norm_swiftkv.weight"].grad is None
    assert params["model.layers.1.self_attn.k_proj_swiftkv.weight"].grad is None


def test_bad_input_is_refused():
    model = tiny_model(tiny_config())
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="needs a SwiftKV model"):
        training_forward(model, ids, swiftkv=True)
    with pytest.raises(ValueError, match="logits_mask shape"):
        training_forward(model, ids, swiftkv=False, logits_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="capture_from"):
        training_forward(model, ids, swiftkv=False, capture_from=4)
    with pytest.raises(ValueError, match="scored_only needs"):
        every = torch.ones(2, 5, dtype=torch.bool)
        training_forward(model, ids, swiftkv=False, logits_mask=every, scored_only=True)
    with pytest.raises(ValueError, match="scored_only needs"):
        training_forward(tiny_model(tiny_config(num_key_value_layers=1)), ids, swiftkv=True, scored_only=True)
    with pytest.raises(ValueError, match="batch, num_tokens"):
        training_forward(model, ids[0], swiftkv=False)
    h = torch.zeros(2, 5, model.config.hidden_size)
    with pytest.raises(ValueError, match="start layer"):
        training_forward(model, ids, swiftkv=False, start=(model.config.num_hidden_layers, h))
    with pytest.raises(ValueError, match="start state must be"):
        training_forward(model, ids, swiftkv=False, start=(1, h[:, :4]))
    with pytest.raises(ValueError, match=r"keep_states / capture_from \[0\]"):
        training_forward(model, ids, swiftkv=False, start=(1, h), keep_states=(0,))
