"""The generic loader: formats (single/sharded safetensors, single/sharded .bin, dummy), dtype
conversion by value, tied embeddings, and every error a bad checkpoint can cause, with the file
and key named in the message."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from fixtures.checkpoints import make_variant
from foretell.ops.attention.reference import TorchAttentionBackend
from foretell.loader import CheckpointError, iter_checkpoint_tensors, load_weights
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.registry import resolve_model_class


def new_model(folder: str, dtype=torch.float32):
    config = HFConfig.from_folder(folder)
    options = ModelOptions(dtype, torch.device("cpu"), TorchAttentionBackend())
    return resolve_model_class(config)(config, options)


def load(folder: str, dtype=torch.float32, load_format="auto", model_folder=None):
    model = new_model(model_folder or folder, dtype)
    load_weights(model, folder, load_format=load_format)
    return model


def params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def assert_same_params(a, b):
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


# ------------------------------------------------------------------------------------ formats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_checkpoint_loads_by_value(qwen3_checkpoint, dtype):
    state = load_file(os.path.join(qwen3_checkpoint, "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    p = params(load(qwen3_checkpoint, dtype))
    layer = "model.layers.1"
    qkv = p[f"{layer}.self_attn.qkv_proj.weight"]
    q, k, v = (state[f"{layer}.self_attn.{n}_proj.weight"] for n in "qkv")
    assert qkv.dtype == dtype
    assert torch.equal(qkv, torch.cat([q, k, v]).to(dtype))
    gate, up = state[f"{layer}.mlp.gate_proj.weight"], state[f"{layer}.mlp.up_proj.weight"]
    assert torch.equal(p[f"{layer}.mlp.gate_up_proj.weight"], torch.cat([gate, up]).to(dtype))
    for key in ("model.embed_tokens.weight", "lm_head.weight", f"{layer}.self_attn.k_norm.weight"):
        assert torch.equal(p[key], state[key].to(dtype)), key


def test_qwen2_biases_are_fused(qwen2_checkpoint):
    state = load_file(os.path.join(qwen2_checkpoint, "model.safetensors"))
    p = params(load(qwen2_checkpoint))
    bias = p["model.layers.0.self_attn.qkv_proj.bias"]
    expected = torch.cat([state[f"model.layers.0.self_attn.{n}_proj.bias"] for n in "qkv"])
    assert torch.equal(bias, expected.float())
    assert "model.layers.0.self_attn.o_proj.bias" not in p


def test_tied_checkpoint(qwen3_tied_checkpoint, tmp_path):
    state = load_file(os.path.join(qwen3_tied_checkpoint, "model.safetensors"))
    assert "lm_head.weight" not in state
    model = load(qwen3_tied_checkpoint)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"].float())
    # A tied checkpoint that also stores lm_head.weight: ignored, the embedding stays the head.
    folder = make_variant(
        qwen3_tied_checkpoint, str(tmp_path / "with_head"),
        add={"lm_head.weight": torch.zeros(512, 64, dtype=torch.bfloat16)},
    )
    model = load(folder)
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"].float())


def test_sharded_safetensors_equals_single_file(qwen3_checkpoint, qwen3_sharded_checkpoint):
    sharded = new_model(qwen3_sharded_checkpoint)
    files = load_weights(sharded, qwen3_sharded_checkpoint)
    assert [os.path.basename(f) for f in files] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    ]
    assert_same_params(sharded, load(qwen3_checkpoint))


def test_pytorch_bin_fp16_with_inv_freq(llama2_bin_checkpoint):
    state = torch.load(os.path.join(llama2_bin_checkpoint, "pytorch_model.bin"), weights_only=True)
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in state  # old layout, ignored
    p = params(load(llama2_bin_checkpoint))
    for key in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
        assert state[key].dtype == torch.float16
        assert torch.equal(p[key], state[key].float())


def test_sharded_pytorch_bin(llama2_bin_checkpoint, tmp_path):
    state = torch.load(os.path.join(llama2_bin_checkpoint, "pytorch_model.bin"), weights_only=True)
    folder = make_variant(llama2_bin_checkpoint, str(tmp_path / "bin_sharded"),
                          delete_files=("pytorch_model.bin",))
    keys = sorted(state)
    weight_map = {}
    for i, part in enumerate((keys[::2], keys[1::2])):
        name = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: state[k] for k in part}, os.path.join(folder, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(folder, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    assert_same_params(load(folder), load(llama2_bin_checkpoint))


def test_explicit_load_format(qwen3_checkpoint, llama2_bin_checkpoint):
    load(qwen3_checkpoint, load_format="safetensors")
    load(llama2_bin_checkpoint, load_format="pt")
    looked_for = r"pytorch_model\.bin\.index\.json, pytorch_model\.bin"
    with pytest.raises(CheckpointError, match=looked_for):
        load(qwen3_checkpoint, load_format="pt")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load(llama2_bin_checkpoint, load_format="safetensors")
    with pytest.raises(ValueError, match="load_format 'gguf'"):
        load(qwen3_checkpoint, load_format="gguf")


def test_iter_checkpoint_tensors_yields_key_tensor_file(qwen3_sharded_checkpoint):
    seen = {key: path for key, _, path in iter_checkpoint_tensors(qwen3_sharded_checkpoint)}
    index = json.load(open(os.path.join(qwen3_sharded_checkpoint, "model.safetensors.index.json")))
    assert {k: os.path.basename(p) for k, p in seen.items()} == index["weight_map"]


def test_dummy_weights(qwen3_checkpoint, tmp_path):
    missing_folder = str(tmp_path / "nothing_here")  # dummy reads no file
    a, b = new_model(qwen3_checkpoint), new_model(qwen3_checkpoint)
    assert load_weights(a, missing_folder, load_format="dummy", seed=0) == []
    load_weights(b, missing_folder, load_format="dummy", seed=0)
    assert_same_params(a, b)
    c = new_model(qwen3_checkpoint)
    load_weights(c, missing_folder, load_format="dummy", seed=1)
    embed = "model.embed_tokens.weight"
    assert not torch.equal(params(a)[embed], params(c)[embed])
    for name, p in params(a).items():
        if name.endswith("norm.weight") or ".kv_scales." in name:  # norms and FP8 KV scales start at 1
            assert torch.all(p == 1.0), name
        else:
            assert 0.015 < p.std().item() < 0.025, name
    # bf16 dummy weights are the float32 ones rounded: values do not depend on the dtype
    d = new_model(qwen3_checkpoint, torch.bfloat16)
    load_weights(d, missing_folder, load_format="dummy", seed=0)
    for name, p in params(d).items():
        assert torch.equal(p, params(a)[name].to(p.dtype)), name  # (the KV scales stay float32)


# ------------------------------------------------------------------------------------- errors


def load_error(folder: str, model_folder: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load(folder, model_folder=model_folder)
    return str(info.value)


def test_missing_fused_shard(qwen3_checkpoint, tmp_path):
    folder = make_variant(qwen3_checkpoint, str(tmp_path / "v"),
                          remove=("model.layers.1.self_attn.k_proj.weight", "model.norm.weight"))
    message = load_error(folder, qwen3_checkpoint)
    assert folder in message and "2 parameter(s) found no tensor" in message
    assert "model.layers.1.self_attn.qkv_proj.weight (shard 'k')" in message
    assert "model.norm.weight" in message
    assert "shard 'q'" not in message and "shard 'v'" not in message


def test_unexpected_tensor(qwen3_checkpoint, tmp_path):
    folder = make_variant(qwen3_checkpoint, str(tmp_path / "v"),
                          rename={"model.norm.weight": "model.final_norm.weight"})
    message = load_error(folder, qwen3_checkpoint)
    assert "model.final_norm.weight (in model.safetensors)" in message
    assert "match no parameter of Qwen3ForCausalLM" in message
    assert "model.norm.weight" in message  # and so it is also missing


def test_shape_mismatch_fused(qwen3_checkpoint, tmp_path):
    key = "model.layers.0.self_attn.v_proj.weight"
    folder = make_variant(qwen3_checkpoint, str(tmp_path / "v"), reshape={key: (16, 64)})
    message = load_error(folder, qwen3_checkpoint)
    assert os.path.join(folder, "model.safetensors") in message and repr(key) in message
    assert ("model.layers.0.self_attn.qkv_proj.weight: shard 'v': "
            "expected shape (32, 64), found shape (16, 64)") in message


def test_shape_mismatch_unfused(qwen3_checkpoint, tmp_path):
    key = "model.embed_tokens.weight"
    folder = make_variant(qwen3_checkpoint, str(tmp_path / "v"), reshape={key: (500, 64)})
    message = load_error(folder, qwen3_checkpoint)
    assert repr(key) in message and "model.safetensors" in message
    assert "expected shape (512, 64), found shape (500, 64)" in message


def test_truncated_safetensors(qwen3_checkpoint, tmp_path):
    folder = make_variant(qwen3_checkpoint, str(tmp_path / "v"), truncate="model.safetensors")
    message = load_error(folder, qwen3_checkpoint)
    assert os.path.join(folder, "model.safetensors") in message
    assert "not a readable safetensors file" in message


def test_truncated_shard(qwen3_sharded_checkpoint, tmp_path):
    shard = "model-00002-of-00002.safetensors"
    folder = make_variant(qwen3_sharded_checkpoint, str(tmp_path / "v"), truncate=shard)
    message = load_error(folder, qwen3_sharded_checkpoint)
    assert os.path.join(folder, shard) in message


def test_truncated_bin(llama2_bin_checkpoint, tmp_path):
    folder = make_variant(llama2_bin_checkpoint, str(tmp_path / "v"), truncate="pytorch_model.bin")
    message = load_error(folder, llama2_bin_checkpoint)
    assert os.path.join(folder, "pytorch_model.bin") in message
    assert "not a readable PyTorch weights file" in message


def test_no_weight_files(qwen3_checkpoint, tmp_path):
    folder = make_variant(
        qwen3_checkpoint, str(tmp_path / "v"), delete_files=("model.safetensors",)
    )
    message = load_error(folder, qwen3_checkpoint)
    assert f"no weight files in {folder}" in message
    for name in ("model.safetensors.index.json", "model.safetensors", "*.safetensors",
                 "pytorch_model.bin.index.json", "pytorch_model.bin"):
        assert name in message
    with pytest.raises(CheckpointError, match="does not exist"):
        load(str(tmp_path / "absent"), model_folder=qwen3_checkpoint)


def test_index_names_a_missing_shard(qwen3_sharded_checkpoint, tmp_path):
    shard = "model-00001-of-00002.safetensors"
    folder = make_variant(qwen3_sharded_checkpoint, str(tmp_path / "v"), delete_files=(shard,))
    message = load_error(folder, qwen3_sharded_checkpoint)
    assert "model.safetensors.index.json" in message and repr(shard) in message


def test_index_lists_a_key_its_shard_lacks(qwen3_sharded_checkpoint, tmp_path):
    folder = make_variant(qwen3_sharded_checkpoint, str(tmp_path / "v"))
    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["weight_map"]["model.layers.0.extra.weight"] = "model-00002-of-00002.safetensors"
    json.dump(index, open(index_path, "w"))
    message = load_error(folder, qwen3_sharded_checkpoint)
    assert "model-00002-of-00002.safetensors" in message
    assert "model.layers.0.extra.weight" in message


def test_unreadable_index(qwen3_sharded_checkpoint, tmp_path):
    folder = make_variant(qwen3_sharded_checkpoint, str(tmp_path / "v"))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write("{not json")
    message = load_error(folder, qwen3_sharded_checkpoint)
    assert "model.safetensors.index.json is not a readable weight index" in message


def test_duplicate_tensor_across_shards(qwen3_sharded_checkpoint, tmp_path):
    from safetensors.torch import save_file

    folder = make_variant(qwen3_sharded_checkpoint, str(tmp_path / "v"))
    first = os.path.join(folder, "model-00001-of-00002.safetensors")
    second = os.path.join(folder, "model-00002-of-00002.safetensors")
    a, b = load_file(first), load_file(second)
    key = next(iter(b))
    a[key] = b[key]
    save_file(a, first, metadata={"format": "pt"})
    message = load_error(folder, qwen3_sharded_checkpoint)
    assert "already loaded" in message and repr(key) in message


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)
