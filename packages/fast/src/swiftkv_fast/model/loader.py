"""Checkpoint -> fused weights. Config and checkpoint I/O, the RoPE frequencies and the tokenizer are the
reference package's: this module is the only one of swiftkv_fast that imports swiftkv_reference (lazily:
importing swiftkv_fast stays light)."""

from __future__ import annotations

from pathlib import Path

import torch

from swiftkv_fast.config import EngineConfig
from swiftkv_fast.kernels.linear_kernels import LinearKernelChooser, row_buckets, weights_exceed_cache
from swiftkv_fast.logger import init_logger
from swiftkv_fast.model.kv_cache_layout import KVCacheLayout
from swiftkv_fast.model.layers import Linear, RowOps
from swiftkv_fast.model.swiftkv_model import LayerWeights, ModelWeights

logger = init_logger(__name__)


def load_checkpoint(
    model: str | Path | None, num_key_value_layers: int | None, key_value_group_size: int | None
):
    """-> (config, state_dict, model_dir). `model=None` is the embedded SmolLM2-135M-Instruct. The config
    is read and checked before the weights. The weights keep the dtype they are stored in (a bf16
    checkpoint takes its own bytes in memory, not fp32's): `build_weights` converts each one."""
    from swiftkv_reference.checkpoint import load_config, load_state_dict

    if model is None:
        from swiftkv_reference.default_model import default_model_dir

        model = default_model_dir()
    model_dir = Path(model)
    if not model_dir.exists():
        raise FileNotFoundError(
            f"model directory {str(model)!r} does not exist (a local checkpoint directory: config.json + "
            "*.safetensors; hub ids are not downloaded)"
        )
    if not model_dir.is_dir():
        raise NotADirectoryError(
            f"model must be a checkpoint directory (config.json + *.safetensors), got the file {str(model)!r}"
        )
    config = load_config(model_dir)
    state_dict = load_state_dict(model_dir, dtype=None)
    config, state_dict = apply_swiftkv_options(config, state_dict, num_key_value_layers, key_value_group_size)
    return config, state_dict, model_dir


def checkpoint_dtype(source: str | Path | dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype most of a checkpoint's weights are stored in (what dtype="auto" follows): a checkpoint
    directory's (read from its safetensors headers) or an in-memory state dict's."""
    from swiftkv_reference.checkpoint import state_dict_dtype, stored_dtype

    return state_dict_dtype(source) if isinstance(source, dict) else stored_dtype(source)


def apply_swiftkv_options(config, state_dict, num_key_value_layers, key_value_group_size):
    """Normalize and check the checkpoint, then convert a plain one on the fly when SwiftKV is asked for."""
    from swiftkv_reference.checkpoint import check_state_dict, normalize_state_dict, swiftkv_init

    state_dict = normalize_state_dict(config, state_dict)
    check_state_dict(config, state_dict)
    n = config.num_hidden_layers
    if config.is_swiftkv and not config.swiftkv:
        # Snowflake's trainer saves its runtime switch (default false); serving engines ignore it, and
        # so do we: the checkpoint's SwiftKV path runs. num_key_value_layers=N selects the original one.
        logger.info(
            "config.json has swiftkv=false (a training-time switch): serving the SwiftKV path; "
            "pass num_key_value_layers=%d for the original (teacher) path",
            n,
        )
        config = config.replace(swiftkv=True)
    want_l = num_key_value_layers if num_key_value_layers is not None else config.num_key_value_layers
    want_g = key_value_group_size if key_value_group_size is not None else config.key_value_group_size
    if (want_l, want_g) == (config.num_key_value_layers, config.key_value_group_size):
        return config, state_dict
    if config.is_swiftkv:
        if want_l == n:
            logger.info("num_key_value_layers=%d: running the original (teacher) path of the checkpoint", n)
            return config.replace(num_key_value_layers=n, key_value_group_size=1), state_dict
        raise ValueError(
            f"the checkpoint is SwiftKV (L={config.num_key_value_layers}, G={config.key_value_group_size}); "
            f"it cannot be run with num_key_value_layers={want_l}, key_value_group_size={want_g}"
        )
    if want_l == n:
        return config, state_dict
    logger.info(
        "converting the plain checkpoint to SwiftKV on the fly (L=%d of %d, G=%d, Snowflake's init); "
        "output quality needs distillation",
        want_l,
        n,
        want_g,
    )
    # the group means in fp32, whatever the checkpoint's dtype (each engine dtype rounds them once)
    state_dict = {k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}
    return swiftkv_init(config, state_dict, want_l, want_g)


def build_weights(
    config,
    sd: dict[str, torch.Tensor],
    econf: EngineConfig,
    layout: KVCacheLayout,
    ops: RowOps | None = None,
    decode_stack: bool = False,
    forms: bool = True,
    linear_kernel: str | None = None,
) -> tuple[ModelWeights, LinearKernelChooser]:
    """Fuse q/k/v, gate/up, and all group leaders' k/v_proj_swiftkv; drop unused teacher weights. Each
    Linear's kernels are chosen by econf.linear_kernel (kernels/linear_kernels.py): layers < L and the
    fused K/V projection run up to max_num_batched_tokens rows a step, layers >= L and lm_head one row
    per running request. `ops`: the row ops the plan chose (the norm / SiLU fused in front of a
    linear); `decode_stack`: the decoder layers' linears keep a panel layout for the decode stack
    (model/decode_stack.py) until worker/stack_timing.py has timed it; `forms`: weights exactly in a
    compact form (kernels/weight_forms.py) may get its layouts; `linear_kernel`: overrides
    econf.linear_kernel. Returns the weights and the chooser (its choices, memory and timing, for the
    kernel plan)."""
    L, n = config.num_key_value_layers, config.num_hidden_layers
    device = econf.device
    # what the layers hold and compute in; where that is wider than econf.dtype (bf16 weights on a CPU
    # without bf16 units, EngineConfig.compute_dtype), each weight is rounded to econf.dtype first and
    # its linear keeps it in a layout of those bytes (`widened`)
    dtype = econf.compute_dtype
    widened = dtype != econf.dtype
    kernels = LinearKernelChooser(
        linear_kernel or econf.linear_kernel,
        device,
        row_buckets(econf.max_num_seqs, econf.max_num_batched_tokens),
        cache_dir=kernel_cache_dir(),
        cold=weights_exceed_cache(sd, econf.dtype),
        precision=econf.matmul_precision,
        forms=forms,
        widened=widened,
    )
    every_row = econf.max_num_batched_tokens
    sampled_rows = min(econf.max_num_seqs, econf.max_num_batched_tokens)

    def as_weight(x: torch.Tensor, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        return x.to(device=device, dtype=econf.dtype).to(as_dtype).contiguous()

    def t(name):
        return as_weight(sd[name])

    def opt(name):
        return t(name) if name in sd else None

    def cat(names):
        return as_weight(torch.cat([sd[x] for x in names]))

    def cat_opt(names):
        return cat(names) if all(x in sd for x in names) else None

    stack_spare = "panel" if decode_stack else None

    def linear(name, weight, bias=None, rows=every_row, shared=False, spare=None, copied=0):
        choice = kernels.choose(name, weight, bias, rows, shared=shared, spare=spare, copied=copied)
        return Linear(weight, bias, choice, ops)

    layers = []
    for i in range(n):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        rows = every_row if i < L else sampled_rows
        if i < L:
            qkv = cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"])
            bias = cat_opt([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])
            qkv = linear("qkv", qkv, bias, spare=stack_spare)
        else:
            w, b = t(a + "q_proj_swiftkv.weight"), opt(a + "q_proj_swiftkv.bias")
            qkv = linear("q_swiftkv", w, b, rows=rows, spare=stack_spare)
        c = config.cache_layer(i)
        layers.append(
            LayerWeights(
                input_norm=t(p + "input_layernorm.weight"),
                post_norm=t(p + "post_attention_layernorm.weight"),
                qkv=qkv,
                o=linear("o", t(a + "o_proj.weight"), rows=rows, spare=stack_spare),
                gate_up=linear(
                    "gate_up",
                    cat([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    rows=rows,
                    spare=stack_spare,
                ),
                down=linear("down", t(p + "mlp.down_proj.weight"), rows=rows, spare=stack_spare),
                window=config.window(i),
                cache_layer=c,
                group=layout.group_of_cache_layer[c],
            )
        )
    embed = as_weight(sd["model.embed_tokens.weight"], econf.dtype)  # looked up, never multiplied
    tied = "lm_head.weight" not in sd
    # the logits in fp32 whatever the weights' dtype: bf16 logits round to 8 bits, so that near ties
    # between the best tokens become exact ones. On CPU the libraries give no bf16 product with an fp32
    # output, so a bf16 lm_head (and the norm in front of it) keeps fp32 weights, unless its layouts
    # multiply bf16 weights in fp32 anyway (`widened`); the kernel plan reports the memory this costs.
    head_dtype = torch.float32 if torch.device(device).type == "cpu" else dtype
    head = sd["model.embed_tokens.weight" if tied else "lm_head.weight"]
    head = (as_weight(head) if widened else head.to(device=device, dtype=head_dtype)).contiguous()
    # a tied head held in another dtype than the embedding is a copy of it
    shared = tied and head.dtype == embed.dtype
    held = embed.element_size() if widened else head.element_size()  # bytes a value of the copy
    copied = head.numel() * held if tied and not shared else 0
    lm_head = linear("lm_head", head, rows=sampled_rows, shared=shared, copied=copied)
    final_norm = t("model.norm.weight") if widened else sd["model.norm.weight"].to(device, head_dtype)
    weights = ModelWeights(
        embed=embed,
        norm=final_norm.contiguous(),
        lm_head=lm_head,
        layers=layers,
        rope_inv_freq=rope_inv_freq(config),
    )
    if L < n:
        leaders = list(range(L, n, config.key_value_group_size))
        names = [f"model.layers.{g}.self_attn.{kind}_proj_swiftkv." for kind in ("k", "v") for g in leaders]
        weights.norm_swiftkv = t("model.norm_swiftkv.weight")
        weights.kv_swiftkv = linear(
            "kv_swiftkv", cat([x + "weight" for x in names]), cat_opt([x + "bias" for x in names])
        )
    kernels.finish()
    return weights, kernels


def kernel_cache_dir() -> Path:
    """Where the linear-kernel timings of this machine are cached: the user's SwiftKV cache dir."""
    from swiftkv_reference.default_model import cache_dir

    return cache_dir() / "linear_kernels"


def load_tokenizer(model_dir):
    """The checkpoint's tokenizer (a `transformers` tokenizer with a chat template)."""
    from swiftkv_reference.tokenizer import load_tokenizer as load

    return load(model_dir)


def chat_token_ids(tokenizer, messages, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` (a list of {"role", "content"}, or one user text) through the chat
    template."""
    from swiftkv_reference.tokenizer import chat_token_ids as apply_template

    return apply_template(tokenizer, messages, add_generation_prompt=add_generation_prompt)


def convert_to_swiftkv(src, dst, num_key_value_layers: int, key_value_group_size: int, overwrite: bool):
    """A plain checkpoint directory written as a SwiftKV one (swiftkv convert); -> the output path."""
    from swiftkv_reference.checkpoint import convert_to_swiftkv as convert

    return convert(src, dst, num_key_value_layers, key_value_group_size, overwrite=overwrite)


def rope_inv_freq(config) -> torch.Tensor:
    """(head_dim // 2,) fp32 RoPE frequencies, llama3 scaling applied (the reference's one definition)."""
    from swiftkv_reference.rope import rope_inv_freq as inv_freq

    return inv_freq(config)
