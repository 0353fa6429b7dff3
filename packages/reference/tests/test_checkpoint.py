"""Checkpoint I/O, name matching, the SwiftKV conversion init rules, and bad checkpoints."""

import json
from pathlib import Path

import pytest
import torch
from swiftkv_reference import SwiftKVForCausalLM, checkpoint
from swiftkv_reference.checkpoint import (
    CheckpointError,
    check_state_dict,
    convert_to_swiftkv,
    expected_parameter_names,
    load_config,
    load_model,
    load_state_dict,
    save_checkpoint,
    swiftkv_init,
)
from swiftkv_reference.testing import (
    random_state_dict,
    save_snowflake_checkpoint,
    tiny_config,
    tiny_model,
)


def _ids():
    return torch.arange(3, 23)


@pytest.mark.parametrize("shard", [None, 40_000])
def test_round_trip(tmp_path, shard):
    config = tiny_config(
        model_type="qwen2_swiftkv",
        num_hidden_layers=4,
        num_key_value_layers=2,
        key_value_group_size=2,
        tie_word_embeddings=True,
    )
    model = tiny_model(config, seed=1)
    save_checkpoint(tmp_path, config, model.state_dict(), max_shard_bytes=shard)
    if shard:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    assert load_config(tmp_path) == config
    assert set(load_state_dict(tmp_path)) == set(expected_parameter_names(config))
    assert torch.equal(load_model(tmp_path)(_ids()), model(_ids()))


def test_names():
    config = tiny_config(num_hidden_layers=6, num_key_value_layers=2, key_value_group_size=2)
    names = expected_parameter_names(config)
    assert "model.norm_swiftkv.weight" in names and "lm_head.weight" in names
    assert [n for n in names if "k_proj_swiftkv" in n] == [
        "model.layers.2.self_attn.k_proj_swiftkv.weight",
        "model.layers.4.self_attn.k_proj_swiftkv.weight",
    ]
    assert [n for n in names if "q_proj_swiftkv" in n] == [
        f"model.layers.{i}.self_attn.q_proj_swiftkv.weight" for i in range(2, 6)
    ]
    assert sorted(names) == sorted(tiny_model(config).state_dict())
    assert "lm_head.weight" not in expected_parameter_names(tiny_config(tie_word_embeddings=True))
    qwen = expected_parameter_names(tiny_config(model_type="qwen2"))
    assert (
        "model.layers.0.self_attn.q_proj.bias" in qwen and "model.layers.0.self_attn.o_proj.bias" not in qwen
    )


def test_check_state_dict_names_every_problem():
    config = tiny_config(num_hidden_layers=4, num_key_value_layers=2, key_value_group_size=2)
    state = random_state_dict(config)
    check_state_dict(config, state)
    bad = dict(state)
    del bad["model.layers.2.self_attn.k_proj_swiftkv.weight"]  # the leader's
    bad["model.layers.3.self_attn.k_proj_swiftkv.weight"] = state["model.layers.2.self_attn.k_proj.weight"]
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError) as e:
        check_state_dict(config, bad)
    msg = str(e.value)
    assert "missing (1): ['model.layers.2.self_attn.k_proj_swiftkv.weight']" in msg
    assert "unexpected (1): ['model.layers.3.self_attn.k_proj_swiftkv.weight']" in msg
    assert "model.layers.0.self_attn.q_proj.weight: expected (64, 64), got (3, 3)" in msg
    # k_proj never stands in for k_proj_swiftkv
    renamed = {k.replace("k_proj_swiftkv", "k_proj_swift"): v for k, v in state.items()}
    with pytest.raises(CheckpointError, match="missing"):
        check_state_dict(config, renamed)


def test_conversion_init_rules(tmp_path):
    plain = tiny_config(model_type="qwen2", num_hidden_layers=6)
    state = random_state_dict(plain, seed=2)
    save_checkpoint(tmp_path / "src", plain, state)
    (tmp_path / "src" / "tokenizer.json").write_text("{}")
    dst = convert_to_swiftkv(
        tmp_path / "src", tmp_path / "dst", num_key_value_layers=2, key_value_group_size=2
    )
    config = load_config(dst)
    assert (config.model_type, config.num_key_value_layers, config.key_value_group_size) == (
        "qwen2_swiftkv",
        2,
        2,
    )
    assert (dst / "tokenizer.json").is_file()
    out = load_state_dict(dst)
    for name, t in state.items():  # the teacher is kept unchanged
        assert torch.equal(out[name], t)
    assert torch.equal(out["model.norm_swiftkv.weight"], state["model.layers.2.input_layernorm.weight"])
    for i in range(2, 6):
        for p in ("weight", "bias"):
            assert torch.equal(
                out[f"model.layers.{i}.self_attn.q_proj_swiftkv.{p}"],
                state[f"model.layers.{i}.self_attn.q_proj.{p}"],
            )
    for leader in (2, 4):
        for proj in ("k_proj", "v_proj"):
            for p in ("weight", "bias"):
                mean = (
                    state[f"model.layers.{leader}.self_attn.{proj}.{p}"]
                    + state[f"model.layers.{leader + 1}.self_attn.{proj}.{p}"]
                ) / 2
                got = out[f"model.layers.{leader}.self_attn.{proj}_swiftkv.{p}"]
                assert torch.allclose(got, mean, atol=1e-6)
    model = load_model(dst)
    # the teacher path of the converted model is the source model
    assert torch.equal(model(_ids(), swiftkv=False), load_model(tmp_path / "src")(_ids()))
    with pytest.raises(CheckpointError, match="already a SwiftKV"):
        swiftkv_init(config, out, 2, 2)


def test_bad_checkpoints(tmp_path):
    config = tiny_config()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_state_dict(tmp_path)
    save_checkpoint(tmp_path / "sharded", config, random_state_dict(config), max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    (tmp_path / "sharded" / next(iter(index["weight_map"].values()))).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_state_dict(tmp_path / "sharded")
    with pytest.raises(CheckpointError, match="missing"):
        save_checkpoint(tmp_path / "x", config, {})
    # a state dict of another config fails loudly at load
    save_checkpoint(tmp_path / "other", config, random_state_dict(config))
    tiny_config(num_hidden_layers=3).save(tmp_path / "other")
    with pytest.raises(CheckpointError, match="unexpected"):
        load_model(tmp_path / "other")


def _pickle_conversion_code(message: str) -> str:
    line = message.split("Convert them to safetensors once: ", 1)[1]
    assert line.startswith("cd ") and ' && python -c "' in line and line.endswith('"')
    return line.split(' && python -c "', 1)[1][:-1]


def test_pickle_is_refused_with_a_one_line_conversion(tmp_path, monkeypatch):
    config = tiny_config(tie_word_embeddings=True)
    state = random_state_dict(config)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: shares storage, as HF saves it
    up = "model.layers.0.mlp.up_proj.weight"
    state[up] = state[up].t().contiguous().t()  # not contiguous
    config.save(tmp_path)
    torch.save(state, tmp_path / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", None)  # never called
    with pytest.raises(CheckpointError, match=r"only pickle files \['pytorch_model.bin'\].*never") as e:
        load_model(tmp_path)
    monkeypatch.undo()
    assert "\n" not in str(e.value) and f"cd {tmp_path} && python -c" in str(e.value)
    monkeypatch.chdir(tmp_path)
    exec(_pickle_conversion_code(str(e.value)), {})  # the line the error prints, as a user runs it
    assert torch.equal(load_model(tmp_path)(_ids()), tiny_model(config)(_ids()))
    # sharded pickles: one line over all shards; other pickles (training_args.bin) are left out
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").unlink()
    names = list(state)
    torch.save({k: state[k] for k in names[:5]}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({k: state[k] for k in names[5:]}, tmp_path / "pytorch_model-00002-of-00002.bin")
    torch.save({"lr": 0.1}, tmp_path / "training_args.bin")
    with pytest.raises(CheckpointError) as e:
        load_state_dict(tmp_path)
    exec(_pickle_conversion_code(str(e.value)), {})
    assert torch.equal(load_model(tmp_path)(_ids()), tiny_model(config)(_ids()))


def test_a_snowflake_checkpoint_with_l_equal_n_loads(tmp_path):
    """Snowflake's LlamaSwiftKVModel always creates norm_swiftkv; at L == N it is saved but unused."""
    plain = tiny_config(num_hidden_layers=4)
    state = save_snowflake_checkpoint(tmp_path, plain, seed=3)
    assert "model.norm_swiftkv.weight" in load_state_dict(tmp_path)
    config = load_config(tmp_path)
    assert (config.model_type, config.num_key_value_layers, config.is_swiftkv) == ("llama_swiftkv", 4, False)
    model = SwiftKVForCausalLM(plain)
    model.load_state_dict(state)
    assert torch.equal(load_model(tmp_path)(_ids()), model.eval()(_ids()))


def _stale_sharded(path, seed):
    config = tiny_config(num_hidden_layers=4)
    save_checkpoint(path, config, random_state_dict(config, seed=seed), max_shard_bytes=40_000)
    (path / "tokenizer.json").write_text('{"stale": true}')
    return config


def _snapshot(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_convert_refuses_a_non_empty_output_and_overwrite_replaces_it(tmp_path):
    plain = tiny_config(num_hidden_layers=4)
    save_checkpoint(tmp_path / "src", plain, random_state_dict(plain, seed=1))
    dst = tmp_path / "dst"
    _stale_sharded(dst, seed=9)
    before = _snapshot(dst)
    with pytest.raises(CheckpointError, match="not empty.*overwrite"):
        convert_to_swiftkv(tmp_path / "src", dst, num_key_value_layers=2)
    assert _snapshot(dst) == before
    assert convert_to_swiftkv(tmp_path / "src", dst, num_key_value_layers=2, overwrite=True) == dst
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    assert dst.stat().st_mode == (tmp_path / "src").stat().st_mode  # not a private temporary's 0700
    fresh = convert_to_swiftkv(tmp_path / "src", tmp_path / "fresh", num_key_value_layers=2)
    assert torch.equal(load_model(dst)(_ids()), load_model(fresh)(_ids()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "fresh", "src"]  # no temporary left
    # an empty directory needs no overwrite; a non-checkpoint directory is never replaced
    (tmp_path / "empty").mkdir()
    convert_to_swiftkv(tmp_path / "src", tmp_path / "empty", num_key_value_layers=2)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="no config.json"):
        convert_to_swiftkv(tmp_path / "src", tmp_path / "home", num_key_value_layers=2, overwrite=True)
    assert (tmp_path / "home" / "notes.txt").read_text() == "mine"


def test_convert_never_writes_its_source(tmp_path, monkeypatch):
    plain = tiny_config(num_hidden_layers=4)
    src = tmp_path / "models" / "src"
    save_checkpoint(src, plain, random_state_dict(plain, seed=1))
    before = _snapshot(src)
    (tmp_path / "link").symlink_to(src)
    monkeypatch.chdir(tmp_path / "models")
    for dst in [src, "src", "./src/", tmp_path / "link", tmp_path / "models" / ".." / "models" / "src"]:
        with pytest.raises(CheckpointError, match="same directory"):
            convert_to_swiftkv(src, dst, num_key_value_layers=2, overwrite=True)
    with pytest.raises(CheckpointError, match="contains the source"):
        convert_to_swiftkv(src, tmp_path / "models", num_key_value_layers=2, overwrite=True)
    assert _snapshot(src) == before
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["src"]


@pytest.mark.parametrize("existing", [False, True])
def test_a_crashed_convert_leaves_the_destination_untouched(tmp_path, monkeypatch, existing):
    plain = tiny_config(num_hidden_layers=4)
    save_checkpoint(tmp_path / "src", plain, random_state_dict(plain, seed=1))
    dst = tmp_path / "dst"
    if existing:
        _stale_sharded(dst, seed=9)
    before = _snapshot(dst) if existing else None

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(OSError, match="No space"):
        convert_to_swiftkv(tmp_path / "src", dst, num_key_value_layers=2, overwrite=True)
    if existing:
        assert _snapshot(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == (["dst", "src"] if existing else ["src"])


def test_a_directory_with_both_layouts_is_refused(tmp_path):
    config = _stale_sharded(tmp_path, seed=0)
    from safetensors.torch import save_file

    save_file(random_state_dict(config, seed=1), str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"both model\.safetensors and model\.safetensors\.index\.json"):
        load_state_dict(tmp_path)


def _write(path, content):
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


def _config_with(**changes):
    return lambda path: _write(path, json.dumps({**json.loads(path.read_text()), **changes}))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


SHARDED, CONFIG, SINGLE, INDEX = 300_000, "config.json", "model.safetensors", "model.safetensors.index.json"


@pytest.mark.parametrize(
    "layout,damage,file,match",
    [
        (None, _truncate, SINGLE, "not a valid safetensors file"),
        (None, lambda p: _write(p, "garbage"), SINGLE, "not a valid safetensors file"),
        (None, lambda p: _write(p, "{'model_type': 'llama'"), CONFIG, "not valid JSON"),
        (None, lambda p: _write(p, b"\xff\xfe\x00"), CONFIG, "not valid JSON"),
        (None, lambda p: _write(p, "[1, 2]"), CONFIG, "must hold a JSON object, got a list"),
        (None, _config_with(rms_norm_eps="x"), CONFIG, "wrong type"),
        (None, _config_with(model_type="qwen2", layer_types=5), CONFIG, "wrong type"),
        (None, _config_with(rope_parameters=[1], rope_scaling=[2]), CONFIG, "rope_scaling must be"),
        (None, _config_with(num_hidden_layers="4"), CONFIG, "num_hidden_layers must be"),
        (None, _config_with(model_type="gpt2"), CONFIG, "unsupported model_type"),
        (SHARDED, _truncate, "model-00001-of-00002.safetensors", "not a valid safetensors file"),
        (SHARDED, lambda p: _write(p, "not json"), INDEX, "not valid JSON"),
        (SHARDED, lambda p: _write(p, "[]"), INDEX, "JSON object, got a list"),
        (SHARDED, lambda p: _write(p, "{}"), INDEX, "'weight_map' must be.*got nothing"),
        (SHARDED, lambda p: _write(p, '{"weight_map": ["a"]}'), INDEX, "weight_map"),
        (SHARDED, lambda p: _write(p, '{"weight_map": {"x": 3}}'), INDEX, "file names"),
        (SHARDED, lambda p: p.unlink(), "model-00002-of-00002.safetensors", "is missing"),
    ],
)
def test_unreadable_files_are_named(tmp_path, layout, damage, file, match):
    config = tiny_config()
    save_checkpoint(tmp_path, config, random_state_dict(config), max_shard_bytes=layout)
    if layout:
        assert (tmp_path / "model-00002-of-00002.safetensors").is_file()
    damage(tmp_path / file)
    with pytest.raises(ValueError, match=match) as e:
        load_model(tmp_path)
    assert file in str(e.value)


def test_tied_checkpoint_with_a_redundant_lm_head(tmp_path):
    config = tiny_config(tie_word_embeddings=True)
    state = random_state_dict(config)
    config.save(tmp_path)
    from safetensors.torch import save_file

    save_file(
        {**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()},
        str(tmp_path / "model.safetensors"),
    )
    assert torch.equal(load_model(tmp_path)(_ids()), tiny_model(config)(_ids()))


@pytest.mark.parametrize(
    "dtype, shard", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, 40_000)]
)
def test_stored_dtype_is_the_dtype_of_most_values_and_config_json_says_it(tmp_path, dtype, shard):
    config = tiny_config()
    state = {k: v.to(dtype) for k, v in random_state_dict(config, seed=2).items()}
    state = {k: v.float() if "norm" in k else v for k, v in state.items()}  # a few fp32 tensors beside
    src = tmp_path / "plain"
    save_checkpoint(src, config, state, max_shard_bytes=shard)
    name = str(dtype).removeprefix("torch.")
    assert checkpoint.stored_dtype(src) == dtype == checkpoint.state_dict_dtype(state)
    assert json.loads((src / "config.json").read_text())["torch_dtype"] == name
    out = convert_to_swiftkv(src, tmp_path / "swiftkv", 2)  # keeps the stored dtypes, and says so
    assert checkpoint.stored_dtype(out) == dtype
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == name
    assert load_state_dict(out, dtype=None)["model.layers.0.mlp.up_proj.weight"].dtype == dtype


def test_a_state_dict_without_floating_values_is_fp32():
    assert checkpoint.state_dict_dtype({"ids": torch.arange(3)}) == torch.float32


def test_stored_dtype_refuses_a_broken_file(tmp_path):
    config = tiny_config()
    save_checkpoint(tmp_path, config, random_state_dict(config))
    with open(tmp_path / "model.safetensors", "r+b") as f:  # truncated
        f.truncate(f.seek(0, 2) - 4096)
    with pytest.raises(CheckpointError, match="safetensors header of .*model.safetensors"):
        checkpoint.stored_dtype(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="safetensors header"):
        checkpoint.stored_dtype(tmp_path)


def test_stored_dtype_reads_the_index_as_the_loader_does(tmp_path):
    config = tiny_config()
    save_checkpoint(tmp_path, config, random_state_dict(config), max_shard_bytes=40_000)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="not a file name"):
        checkpoint.stored_dtype(tmp_path)
