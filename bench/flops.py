"""Prefill FLOP count of one prompt, and the speedup limit SwiftKV can reach from it.

Shapes: hidden h, intermediate I, heads n_q, kv heads n_kv, head dim d, vocab V, layers N,
SwiftKV L (num_key_value_layers), G (key_value_group_size); a prompt of T tokens whose last token
is sampled (one row of logits). A matmul of (m x k) by (k x n) counts 2*m*k*n FLOPs; norms, RoPE,
activations and softmax are not counted (they are O(h) per token, under 1% here).

    per token, one layer, projections + MLP:
        P_kv  = 2 * h * (2 * n_kv * d)                 # k_proj + v_proj
        P_rest = 2 * h * (n_q * d) * 2 + 2 * h * I * 3  # q_proj + o_proj, gate + up + down
    attention of the query at position p (0-based, causal, full attention):
        A(p) = 2 * 2 * n_q * d * (p + 1)               # Q.K^T and P.V over p + 1 keys
    attention of a whole prompt:  A_T = sum_{p<T} A(p) = 2 * n_q * d * T * (T + 1)
    lm_head for the sampled token:  H = 2 * h * V

    F(L = N) = N * (T * (P_kv + P_rest) + A_T) + H
    F(L)     = L * (T * (P_kv + P_rest) + A_T)                  # first half: every token
             + T * ((N - L) / G) * P_kv                         # K/V of layers >= L (one per group)
             + (N - L) * (P_rest + A(T - 1))                    # second half: the last token only
             + H
    limit(L) = F(N) / F(L)

With a sliding window W the attention term of a layer uses min(p + 1, W) keys instead of p + 1.
For SmolLM2-135M (N=30, h=576, I=1536, 9/3 heads, d=64) and T = 2048, limit(15) is about 1.9.
"""

from __future__ import annotations

from typing import Any


def _shape(config: Any) -> dict[str, int]:
    get = config.get if isinstance(config, dict) else lambda k, default=None: getattr(config, k, default)
    n_q = get("num_attention_heads")
    h = get("hidden_size")
    return {
        "h": h,
        "I": get("intermediate_size"),
        "n_q": n_q,
        "n_kv": get("num_key_value_heads") or n_q,
        "d": get("head_dim") or h // n_q,
        "V": get("vocab_size"),
        "N": get("num_hidden_layers"),
    }


def _attention(n_q: int, d: int, num_tokens: int, window: int | None) -> int:
    """Sum over positions p < T of 4 * n_q * d * keys(p)."""
    if window is None or window >= num_tokens:
        keys = num_tokens * (num_tokens + 1) // 2
    else:
        keys = window * (window + 1) // 2 + (num_tokens - window) * window
    return 4 * n_q * d * keys


def prefill_flops(
    config: Any,
    num_tokens: int,
    num_key_value_layers: int | None = None,
    key_value_group_size: int = 1,
    window: int | None = None,
) -> int:
    """Matmul FLOPs to prefill one prompt of `num_tokens` tokens and sample its last token."""
    s = _shape(config)
    n_layers, T = s["N"], num_tokens
    L = n_layers if num_key_value_layers is None else num_key_value_layers
    G = key_value_group_size
    if not 0 < L <= n_layers or (n_layers - L) % G:
        raise ValueError(f"bad SwiftKV split L={L}, G={G} for N={n_layers}")
    p_kv = 2 * s["h"] * 2 * s["n_kv"] * s["d"]
    p_rest = 2 * s["h"] * s["n_q"] * s["d"] * 2 + 2 * s["h"] * s["I"] * 3
    last_keys = min(T, window) if window else T
    first_half = L * (T * (p_kv + p_rest) + _attention(s["n_q"], s["d"], T, window))
    kv_second_half = T * ((n_layers - L) // G) * p_kv
    second_half = (n_layers - L) * (p_rest + 4 * s["n_q"] * s["d"] * last_keys)
    return first_half + kv_second_half + second_half + 2 * s["h"] * s["V"]


def speedup_limit(
    config: Any,
    num_tokens: int,
    num_key_value_layers: int,
    key_value_group_size: int = 1,
    window: int | None = None,
) -> float:
    """F(L = N) / F(L): the prefill speedup if time were proportional to matmul FLOPs."""
    full = prefill_flops(config, num_tokens, None, 1, window)
    return full / prefill_flops(config, num_tokens, num_key_value_layers, key_value_group_size, window)
