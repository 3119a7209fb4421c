"""FP8 block-quantized checkpoints (DeepSeek-V3 / Kimi-K2 format) dequantized at load: what the loader
does for a model built without the checkpoint's quantization (ModelOptions.quantization None, as
`build` here) and for the layers an FP8 model keeps in its dtype (tests/models/test_fp8_loading.py holds
the FP8 layers themselves; the engine builds FP8 models, so LLM(...) below runs them).

The float reference multiplies each block by its scale in a Python loop
(fixtures.deepseek.dequantize_reference); the loader must give exactly those values, whichever
shards hold the weight and its weight_scale_inv, and a model loaded from the FP8 folder must equal
the same model loaded from the dequantized float folder.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from fixtures import PagedRunner
from fixtures import deepseek as ds
from fixtures.checkpoints import make_variant
from foretell import LLM, SamplingParams
from foretell.ops.attention.reference import TorchAttentionBackend
from foretell.checkpoint_fp8 import dequantize_fp8_blocks
from foretell.loader import CheckpointError, iter_checkpoint_tensors, load_weights
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.registry import resolve_model_class


@pytest.fixture(scope="module")
def fp8_folders(checkpoint_root, tokenizer_dir):
    fp8 = os.path.join(checkpoint_root, "deepseek_v3_fp8")
    ref = os.path.join(checkpoint_root, "deepseek_v3_fp8_dequantized")
    if not os.path.isdir(fp8):
        ds.write_v3_fp8(fp8, tokenizer_dir, ref)
    return fp8, ref


def build(folder):
    config = HFConfig.from_folder(folder)
    model = resolve_model_class(config)(config, ModelOptions(torch.float32, torch.device("cpu"), TorchAttentionBackend()))
    load_weights(model, folder)
    return model.eval()


@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (7, 129)])
def test_block_dequantization_matches_loop_reference(shape):
    g = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(shape, generator=g) * 3
    q, scales = ds.quantize_fp8_blocks(weight, [128, 128])
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    ours = dequantize_fp8_blocks(q, scales, (128, 128))
    assert torch.equal(ours, ds.dequantize_reference(q, scales, [128, 128]))
    assert (ours - weight).abs().max() <= weight.abs().max() / 8  # e4m3 keeps 3 mantissa bits


def test_pairs_across_shards_and_equals_float_reference(fp8_folders):
    fp8, ref = fp8_folders
    index = json.load(open(os.path.join(fp8, "model.safetensors.index.json")))["weight_map"]
    split = [k for k in index if k.endswith("_scale_inv") and index[k] != index[k[: -len("_scale_inv")]]]
    assert split, "the fixture must put some scales in another shard than their weight"
    ours = {k: t for k, t, _ in iter_checkpoint_tensors(fp8)}
    reference = {k: t for k, t, _ in iter_checkpoint_tensors(ref)}
    assert not any(k.endswith("_scale_inv") for k in ours)
    assert ours.keys() == reference.keys()
    for key, tensor in ours.items():
        assert torch.equal(tensor.float(), reference[key].float()), key
    raw = {k: t.dtype for k, t, _ in iter_checkpoint_tensors(fp8, dequantize_fp8=False)}
    assert raw["model.layers.1.mlp.experts.0.down_proj.weight"] == torch.float8_e4m3fn
    assert raw["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"] == torch.float32


def test_fp8_model_equals_dequantized_model(fp8_folders):
    fp8, ref = fp8_folders
    a, b = build(fp8), build(ref)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    tokens = [5, 77, 300, 12, 9, 41, 8]
    la, _, _ = PagedRunner(a).step([("s", tokens)])
    lb, _, _ = PagedRunner(b).step([("s", tokens)])
    assert torch.equal(la, lb)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": tokens}]
    got = LLM(fp8, dtype="float32", num_kv_blocks=16).generate(prompts, params, use_tqdm=False)
    want = LLM(ref, dtype="float32", num_kv_blocks=16).generate(prompts, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_fp8_errors_name_the_tensor(fp8_folders, tmp_path):
    fp8, _ = fp8_folders
    key = "model.layers.0.self_attn.o_proj.weight"
    no_scale = make_variant(fp8, str(tmp_path / "no_scale"), remove=(key + "_scale_inv",))
    with pytest.raises(CheckpointError, match=r"FP8 tensor.*without.*o_proj\.weight"):
        list(iter_checkpoint_tensors(no_scale))
    bad_shape = make_variant(fp8, str(tmp_path / "bad_shape"), reshape={key + "_scale_inv": (5, 5)})
    with pytest.raises(CheckpointError, match=r"o_proj\.weight_scale_inv.*\(5, 5\), expected \(2, 2\) for a \(64, 64\) weight"):
        list(iter_checkpoint_tensors(bad_shape))
