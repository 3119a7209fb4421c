"""Low-precision checkpoints loaded as they ship (issue 25), against the same weights dequantized.

Fixtures (fixtures/low_precision.py): a Qwen3-FP8 layout (128 x 128 blocks), DeepSeek-V3 with its
MTP layer in FP8 (16 x 16 blocks) and Kimi-K2.5 with int4 routed experts (packed by the
compressed-tensors package), each with a float reference folder holding the dequantized weights.
The low-precision model must hold its weights as they ship (FP8 / int4 parameters), each layer
must compute what the dequantized layer computes, and the logits must agree with the reference
model's: within float32 rounding in float32, top-1 at >= 99% of positions in bfloat16. Also
`quantization="fp8"` on a float checkpoint, greedy speculation with FP8 weights (MTP, EAGLE3)
equal to plain decoding, and the errors for configurations foretell cannot load.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from fixtures import PagedRunner
from fixtures import low_precision as lp
from fixtures.checkpoints import make_variant
from fixtures.tensor_parallel import fake_rank
from foretell import LLM, SamplingParams
from foretell.config import ModelConfig
from foretell.layers.packed_experts import expert_format
from foretell.layers.quantization import QuantizedWeights
from foretell.loader import CheckpointError
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.loading import build_model
from foretell.models.mtp import DeepseekMTP
from foretell.models.quantization import resolve_quantization
from foretell.models.registry import resolve_model_class
from foretell.ops.attention.reference import TorchAttentionBackend
from foretell.ops.gemm.fp8_reference import FP8_DTYPE, dequantize_fp8

PROMPT = torch.randint(0, 448, (48,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def pairs(checkpoint_root, tokenizer_dir):
    return lambda name: lp.checkpoint_pair(checkpoint_root, tokenizer_dir, name)


def options(folder, dtype=torch.float32, requested=None, tp=None):
    config = HFConfig.from_folder(folder)
    extra = {} if tp is None else {"tensor_parallel": tp}
    return ModelOptions(dtype, torch.device("cpu"), TorchAttentionBackend(),
                        quantization=resolve_quantization(config, requested), **extra)


def build(folder, dtype=torch.float32, requested=None):
    return build_model(folder, HFConfig.from_folder(folder), options(folder, dtype, requested))


def logits(model, dtype=torch.float32, tokens=PROMPT):
    return PagedRunner(model, dtype=dtype).step([("s", tokens)])[0]


def top1_agreement(a, b) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


# ---------------------------------------------------------------------- FP8 checkpoints


def test_qwen3_fp8_layers_hold_fp8_and_compute_the_dequantized_layers(pairs):
    fp8, ref = pairs("qwen3_fp8")
    model, reference = build(fp8), build(ref)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for layer in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale_inv.dtype == torch.float32
        assert layer.block_size == (128, 128)
    assert attn.qkv_proj.weight_scale_inv.shape == (8, 2)  # (512 + 256 + 256) / 128 rows, 256 / 128 columns
    ref_params = dict(reference.named_parameters())
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))  # wide enough for every layer
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        layer = model.model.layers[1].get_submodule(name)
        want = F.linear(x[:, : layer.input_size], ref_params[f"model.layers.1.{name}.weight"])
        # the layer's own weight dequantized is the reference folder's weight, bit for bit
        assert torch.equal(dequantize_fp8(layer.weight, layer.weight_scale_inv, layer.block_size),
                           ref_params[f"model.layers.1.{name}.weight"]), name
        torch.testing.assert_close(layer(x[:, : layer.input_size]), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(model), logits(reference), rtol=1e-4, atol=1e-4)


LONG_PROMPTS = [torch.randint(0, 448, (100,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]


def long_logits(folder, dtype):  # [300, vocab]: three prompts of 100 tokens in one step
    chunks = [(i, p) for i, p in enumerate(LONG_PROMPTS)]
    return PagedRunner(build(folder, dtype), num_blocks=96, dtype=dtype).step(chunks)[0]


@pytest.mark.parametrize("name", ["qwen3_fp8", "v3_fp8_b16", "kimi_k25_int4"])
def test_top1_agrees_with_the_dequantized_model(pairs, name):
    """float32 (what the engine runs on CPU): top-1 at >= 99% of 300 positions. bfloat16: these random
    tiny models have near-ties (and DeepSeek's router flips experts on them), so the bf16 dequantized
    model itself agrees with its float32 self at only 90-99%; the low-precision model must agree
    with that float32 truth as well as the bf16 dequantized model does (within 2 points)."""
    low, ref = pairs(name)
    truth = long_logits(ref, torch.float32)
    assert top1_agreement(long_logits(low, torch.float32), truth) >= 0.99
    ours, theirs = long_logits(low, torch.bfloat16), long_logits(ref, torch.bfloat16)
    assert top1_agreement(ours, truth) >= top1_agreement(theirs, truth) - 0.02


def test_v3_fp8_keeps_experts_and_projections_in_fp8_and_mtp_too(pairs):
    fp8, ref = pairs("v3_fp8_b16")
    model, reference = build(fp8), build(ref)
    dense, moe = model.model.layers[0], model.model.layers[1]
    assert moe.mlp.experts.format == "fp8" and moe.mlp.experts.gate_up_proj.dtype == FP8_DTYPE
    assert moe.mlp.experts.num_shared == 1  # packed after the routed ones, in FP8 too
    assert moe.mlp.experts.gate_up_proj_scale_inv.shape == (9, 4, 4)  # 2 * 32 / 16 rows, 64 / 16 columns
    assert dense.mlp.gate_up_proj.is_fp8 and dense.self_attn.q_b_proj.is_fp8 and dense.self_attn.o_proj.is_fp8
    assert dense.self_attn.fused_qkv_a_proj.is_fp8  # 48 rows of q_a: three whole 16-row blocks
    assert not dense.self_attn.kv_b_proj.is_fp8  # read by the absorbed attention: dequantized at load
    torch.testing.assert_close(logits(model), logits(reference), rtol=1e-4, atol=1e-4)
    # the MTP layer: its block and experts in FP8, eh_proj in bf16 as DeepSeek ships it
    config = HFConfig.from_folder(fp8)
    mtp = DeepseekMTP(config, options(fp8))
    from foretell.models.loading import load_model_weights

    load_model_weights(mtp, fp8, options(fp8))
    layer = mtp.model.layers["4"]
    assert layer.mlp.experts.format == "fp8" and not layer.eh_proj.is_fp8
    ref_mtp = DeepseekMTP(HFConfig.from_folder(ref), options(ref))
    load_model_weights(ref_mtp, ref, options(ref))
    for m, t in ((mtp, model), (ref_mtp, reference)):
        m.share_embedding(t.get_input_embeddings())
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    outs = []
    for m in (mtp, ref_mtp):
        runner = PagedRunner(m, dtype=torch.float32)
        ids, pos, metadata = runner.metadata([("s", PROMPT[:6])])
        outs.append(m.compute_logits(0, m.step(0, pos, ids, hidden, metadata)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_kimi_k25_int4_experts_load_as_they_ship(pairs):
    int4, ref = pairs("kimi_k25_int4")
    model, reference = build(int4), build(ref)
    moe = model.language_model.model.layers[1].mlp
    assert moe.experts.format == "int4" and moe.experts.gate_up_proj_packed.dtype == torch.int32
    assert moe.experts.num_shared == 0 and moe.shared_experts is not None  # bf16 shared experts apart
    assert not moe.shared_experts.gate_up_proj.is_fp8
    # float32 model: q * scale exact in float32, the reference holds it rounded to bf16
    a, b = logits(model), logits(reference)
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert top1_agreement(a, b) >= 0.99


# ---------------------------------------------------------------------- quantization="fp8"


def test_quantization_fp8_quantizes_a_float_llama_at_load(llama31_checkpoint):
    model = build(llama31_checkpoint, requested="fp8")
    plain = build(llama31_checkpoint)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.is_fp8 and layer.mlp.down_proj.is_fp8 and layer.mlp.gate_up_proj.is_fp8
    assert layer.self_attn.qkv_proj.block_size == (128, 128)
    # the same model with each float weight replaced by its FP8 blocks dequantized
    for name, module in plain.named_modules():
        quantized = model.get_submodule(name)
        if getattr(quantized, "is_fp8", False):
            with torch.no_grad():
                module.weight.copy_(dequantize_fp8(quantized.weight, quantized.weight_scale_inv, quantized.block_size))
    torch.testing.assert_close(logits(model), logits(plain), rtol=1e-4, atol=1e-4)


def test_quantization_fp8_on_an_fp8_checkpoint_changes_nothing(pairs):
    fp8, _ = pairs("qwen3_fp8")
    config = HFConfig.from_folder(fp8)
    assert resolve_quantization(config, "fp8") == resolve_quantization(config) == QuantizedWeights(
        "fp8", fp8_block=(128, 128))


# ---------------------------------------------------------------------- speculation with FP8 weights


def greedy(folder, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT[:9]}, {"prompt_token_ids": PROMPT[20:25]}]
    with LLM(folder, num_kv_blocks=64, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_mtp_with_fp8_weights_equals_plain(pairs):
    fp8, _ = pairs("v3_fp8_b16")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    assert greedy(fp8, speculative_config=spec) == greedy(fp8)


def test_greedy_eagle3_with_quantized_target_equals_plain(qwen3_checkpoint, eagle3_head):
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3}
    assert greedy(qwen3_checkpoint, quantization="fp8", speculative_config=spec) == greedy(
        qwen3_checkpoint, quantization="fp8")


# ---------------------------------------------------------------------- errors


def test_bad_quantization_requests_are_refused(pairs, tmp_path, qwen3_checkpoint):
    with pytest.raises(ValueError, match="quantization must be None or 'fp8', got 'int8'"):
        ModelConfig(model=qwen3_checkpoint, quantization="int8")
    int4, _ = pairs("kimi_k25_int4")
    with pytest.raises(ValueError, match=r"already quantized \(quant_method 'compressed-tensors'\).*leave it unset"):
        resolve_quantization(HFConfig.from_folder(int4), "fp8")
    fp8, _ = pairs("qwen3_fp8")
    config = HFConfig.from_folder(fp8).to_dict()
    cases = {
        "weight_block_size": (None, "per-tensor FP8.*not supported"),
        "activation_scheme": ("static", "activation_scheme is 'static'"),
        "quant_method": ("awq", "quant_method 'awq' is not supported"),
    }
    for field, (value, message) in cases.items():
        qc = dict(config["quantization_config"], **{field: value})
        with pytest.raises(ValueError, match=message):
            resolve_quantization(HFConfig(dict(config, quantization_config=qc), "x/config.json"))
    groups = {"group_0": {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group",
                                      "group_size": 32}, "input_activations": None}}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": groups}
    with pytest.raises(ValueError, match="config_groups.group_0 must quantize weights only"):
        resolve_quantization(HFConfig(dict(config, quantization_config=qc), "x/config.json"))


def test_tensor_parallel_cuts_inside_fp8_blocks_are_refused(checkpoint_root):
    folder = os.path.join(checkpoint_root, "v3_fp8_b32_tp")
    if not os.path.isdir(folder):
        lp.write_v3_fp8_blocks(folder, None, block=(32, 32))
    config = HFConfig.from_folder(folder)
    with pytest.raises(ValueError, match=r"rows 0\.\.48 of 96, which cuts inside the FP8 checkpoint's 32-wide blocks"):
        resolve_model_class(config)(config, options(folder, tp=fake_rank(0, 2)))
    with pytest.raises(ValueError, match=r"moe_intermediate_size = 32 split over tensor_parallel_size = 2 gives 16 "
                                         r"per rank, which cuts inside the FP8 checkpoint's \[32, 32\] blocks"):
        expert_format(32, fake_rank(0, 2), (32, 32), None)
    with pytest.raises(ValueError, match=r"gives 16 columns of int4 down_proj per rank, not a multiple of its 32"):
        expert_format(64, fake_rank(1, 4), None, 32)
    assert expert_format(96, fake_rank(0, 2), (16, 16), None) == "fp8"
    assert expert_format(40, None, (16, 16), None) == "float"  # not whole blocks: dequantized at load


def test_float_tensor_for_an_fp8_layer_names_the_key(pairs, tmp_path):
    fp8, ref = pairs("qwen3_fp8")
    key = "model.layers.0.self_attn.o_proj.weight"
    from safetensors.torch import load_file

    bf16 = load_file(f"{ref}/model.safetensors")[key].to(torch.bfloat16)
    bad = make_variant(fp8, str(tmp_path / "float_o"), remove=(key, key + "_scale_inv"), add={key: bf16})
    with pytest.raises(CheckpointError, match=r"o_proj\.weight.*expected a float8_e4m3fn tensor.*found torch\.bfloat16"):
        build(bad)
    no_scale = make_variant(fp8, str(tmp_path / "no_scale"), remove=(key + "_scale_inv",))
    with pytest.raises(CheckpointError, match=r"FP8 tensor.*without.*o_proj\.weight"):
        build(no_scale)


def test_engine_runs_int4_experts_as_the_reference(pairs):
    int4, ref = pairs("kimi_k25_int4")
    assert greedy(int4) == greedy(ref)


@pytest.mark.parametrize("name", ["v3_fp8_b16", "kimi_k25_int4"])
def test_dummy_weights_in_the_shipped_precisions(pairs, name):
    """load_format="dummy" (the GPU checks at real sizes): FP8 values with 0.02 block scales, int4
    random nibbles with small scales: finite logits, no file read."""
    folder, _ = pairs(name)
    model = build_model(folder, HFConfig.from_folder(folder), options(folder), load_format="dummy")
    experts = model.get_submodule("language_model.model.layers.1.mlp.experts" if name.startswith("kimi")
                                  else "model.layers.1.mlp.experts")
    assert experts.format == ("int4" if name.startswith("kimi") else "fp8")
    out = logits(model)
    assert torch.isfinite(out).all() and out.std() > 0
