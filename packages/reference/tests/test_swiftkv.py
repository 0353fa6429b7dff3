"""SwiftKV semantics: SingleInputKV, AcrossKV, early exit, the teacher path."""

import math

import pytest
import torch
import torch.nn.functional as F
from swiftkv_reference.checkpoint import swiftkv_init
from swiftkv_reference.model import SwiftKVForCausalLM
from swiftkv_reference.rope import rope_inv_freq
from swiftkv_reference.testing import fp32_atol, random_state_dict, tiny_config, tiny_model

N = 6


def _ids(n=24, seed=0, vocab=128):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _model(config, state):
    model = SwiftKVForCausalLM(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


def _independent_swiftkv_logits(config, state, ids):
    """A from-scratch dense SwiftKV forward (full attention only): every token runs every layer,
    SDPA for attention. Written from anchors/swiftkv-facts.md §1.3, independent of model.py."""
    w = state
    hd, nh, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    big_l, g, t = config.num_key_value_layers, config.key_value_group_size, len(ids)

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    ang = torch.arange(t).float()[:, None] * rope_inv_freq(config)[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(x):  # (heads, t, hd)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def heads(x, n):
        return x.view(t, n, hd).transpose(0, 1)

    h = w["model.embed_tokens.weight"][ids]
    s = None
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        if i < big_l:
            q, k, v = (x @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        else:
            if s is None:
                s = rms(h, w["model.norm_swiftkv.weight"])
            lead = f"model.layers.{big_l + ((i - big_l) // g) * g}.self_attn."
            q = x @ w[p + "self_attn.q_proj_swiftkv.weight"].T
            k, v = s @ w[lead + "k_proj_swiftkv.weight"].T, s @ w[lead + "v_proj_swiftkv.weight"].T
        q, k, v = rope(heads(q, nh)), rope(heads(k, nkv)), heads(v, nkv)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(hd))
        h = h + a.transpose(0, 1).reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return rms(h, w["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("big_l,g", [(2, 1), (2, 2), (3, 3), (1, 5)])
def test_matches_independent_derivation(big_l, g):
    config = tiny_config(
        num_hidden_layers=N,
        num_key_value_layers=big_l,
        key_value_group_size=g,
        model_type="llama_swiftkv",
        tie_word_embeddings=True,
    )
    state = random_state_dict(config, seed=1)
    ids = _ids()
    ours = _model(config, state)(ids)
    want = _independent_swiftkv_logits(config, state, ids)
    assert (ours - want).abs().max() <= fp32_atol(want, N)
    # sensitivity: using layer L's input_layernorm instead of norm_swiftkv changes the answer
    wrong = dict(state)
    wrong["model.norm_swiftkv.weight"] = state[f"model.layers.{big_l}.input_layernorm.weight"]
    assert (ours - _model(config, wrong)(ids)).abs().max() > 1e-2


def test_l_equals_n_is_the_plain_model():
    plain = tiny_config(num_hidden_layers=N)
    state = random_state_dict(plain, seed=2)
    ids = _ids()
    swift_config, swift_state = swiftkv_init(plain, state, N, 1)
    assert swift_config.num_cache_layers == N and not swift_config.is_swiftkv
    assert set(swift_state) == set(state)
    assert torch.equal(_model(plain, state)(ids), _model(swift_config, swift_state)(ids))


def test_teacher_path_is_the_original_model():
    plain = tiny_config(num_hidden_layers=N)
    state = random_state_dict(plain, seed=3)
    config, swift_state = swiftkv_init(plain, state, 2, 2)
    ids = _ids()
    model = _model(config, swift_state)
    assert torch.equal(model(ids, swiftkv=False), _model(plain, state)(ids))
    assert (model(ids) - model(ids, swiftkv=False)).abs().max() > 1e-3


def _swiftkv_kv(model, ids):
    """The K/V caches of layers >= L after a prefill (only the last token runs layers >= L)."""
    cache = model.new_cache()
    model.step(ids, torch.arange(len(ids)), cache, [len(ids) - 1])
    first = model.config.num_key_value_layers
    return [torch.cat([cache.k[c], cache.v[c]]) for c in range(first, cache.num_layers)]


def test_swiftkv_kv_depends_only_on_layer_l_input():
    config = tiny_config(
        num_hidden_layers=N, num_key_value_layers=3, key_value_group_size=1, model_type="llama_swiftkv"
    )
    state = random_state_dict(config, seed=4)
    ids = _ids()
    base = _swiftkv_kv(_model(config, state), ids)
    # weights of layers >= L (except the swiftkv k/v projections) do not change the K/V
    changed = dict(state)
    for name in state:
        parts = name.split(".")
        if (
            parts[:2] == ["model", "layers"]
            and int(parts[2]) >= 3
            and parts[4] not in ("k_proj_swiftkv", "v_proj_swiftkv")
        ):
            changed[name] = state[name] + 0.5
    changed["model.norm.weight"] = state["model.norm.weight"] * 2
    for a, b in zip(base, _swiftkv_kv(_model(config, changed), ids)):
        assert torch.equal(a, b)
    # the input of layer L (through the weights of layer L-1) does change them
    changed = dict(state)
    changed["model.layers.2.mlp.down_proj.weight"] = state["model.layers.2.mlp.down_proj.weight"] * 1.5
    for a, b in zip(base, _swiftkv_kv(_model(config, changed), ids)):
        assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_key_value_layers=2, key_value_group_size=2),
        dict(num_key_value_layers=3, key_value_group_size=1, tie_word_embeddings=True),
        dict(
            model_type="qwen2_swiftkv",
            num_key_value_layers=2,
            key_value_group_size=2,
            sliding_window=5,
            layer_types=["full_attention"] * 2 + ["sliding_attention"] * 4,
        ),
    ],
)
def test_early_exit_equals_full_forward(overrides):
    overrides.setdefault("model_type", "llama_swiftkv")
    model = tiny_model(tiny_config(num_hidden_layers=N, **overrides), seed=5)
    ids = _ids(30)
    full = model(ids)
    for positions in ([29], [0, 7, 29], list(range(30))):
        assert (model(ids, logits_positions=positions) - full[positions]).abs().max() <= fp32_atol(full, N)


def test_acrosskv_members_share_one_cache():
    config = tiny_config(
        num_hidden_layers=N, num_key_value_layers=2, key_value_group_size=2, model_type="llama_swiftkv"
    )
    assert config.num_cache_layers == 2 + (N - 2) // 2 == 4
    assert [config.cache_layer(i) for i in range(N)] == [0, 1, 2, 2, 3, 3]
    assert [config.group_leader(i) for i in range(N)] == [0, 1, 2, 2, 4, 4]
    model = tiny_model(config, seed=6)
    cache = model.new_cache()
    assert cache.num_layers == 4
    ids = _ids()
    model.step(ids, torch.arange(len(ids)), cache, [len(ids) - 1])
    assert all(cache.num_tokens(c) == len(ids) for c in range(4))
    # sharing is semantic: a G=1 model whose followers copy their leader's k/v projections is the same
    state = random_state_dict(config, seed=6)
    g1 = config.replace(key_value_group_size=1)
    state1 = dict(state)
    for follower, leader in [(3, 2), (5, 4)]:
        for proj in ("k_proj_swiftkv", "v_proj_swiftkv"):
            state1[f"model.layers.{follower}.self_attn.{proj}.weight"] = state[
                f"model.layers.{leader}.self_attn.{proj}.weight"
            ]
    want = _model(g1, state1)(ids)
    assert (model(ids) - want).abs().max() <= fp32_atol(want, N)
    assert model.new_cache(swiftkv=False).num_layers == N
