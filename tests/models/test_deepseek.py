"""DeepSeek-V2/V3, Kimi-K2 and the Kimi-K2.5 layout against transformers, plus the MLA, MoE and
YaRN pieces on their own.

Checkpoints (tests/fixtures/deepseek.py) cover: grouped noaux_tc routing with norm_topk_prob and a
dense first layer, yarn (v3); one group, no norm_topk_prob, no dense layer, plain rope (kimi_k2);
q_lora_rank null, softmax greedy routing, yarn with mscale 0.707 (v2_lite); q_lora,
group_limited_greedy, plain rope (v2). Every row of a prefill, of a varlen batch with cached
prefixes and of single-token decodes (the absorbed MLA form) must match HF's float32 logits.
"""

from __future__ import annotations

import math

import pytest
import torch

from fixtures import PagedRunner
from fixtures import deepseek as ds
from fixtures.checkpoints import make_variant
from foretell import LLM, SamplingParams
from foretell.ops.attention.reference import TorchAttentionBackend
from foretell.ops.mla.reference import absorbed_attention, expanded_attention
from foretell.ops.moe.reference import RouterConfig, experts_forward_torch, select_experts
from foretell.ops.pointwise.reference import apply_rope_gptj
from foretell.layers.rotary import RotaryEmbedding, yarn_softmax_scale_factor
from foretell.loader import CheckpointError
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.registry import resolve_model_class
from foretell.models import loading as model_loading

ATOL = 1e-4
VARIANTS = ["v3", "kimi_k2", "v2_lite", "v2", "v2_lite_bias"]
TOKENIZER_SIZE = 448


@pytest.fixture(scope="session")
def deepseek_checkpoint(checkpoint_root, tokenizer_dir):
    return lambda name: ds.checkpoint(checkpoint_root, tokenizer_dir, name)


def build(folder: str, aux_layers=()):
    options = ModelOptions(torch.float32, torch.device("cpu"), TorchAttentionBackend(), tuple(aux_layers))
    return model_loading.build_model(folder, HFConfig.from_folder(folder), options)


_HF: dict[str, torch.nn.Module] = {}


def hf_model(folder: str):
    if folder not in _HF:
        import transformers

        view = ds.hf_view(folder)
        arch = ds.read_config(view)["architectures"][0]
        model, info = getattr(transformers, arch).from_pretrained(
            view, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
        assert not info["missing_keys"], info["missing_keys"]  # our fixtures load in HF as published
        _HF[folder] = model.eval()
    return _HF[folder]


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TOKENIZER_SIZE, (length,), generator=g).tolist()


@torch.no_grad()
def hf_logits(folder: str, tokens: list[int]) -> torch.Tensor:
    return hf_model(folder)(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_hf(deepseek_checkpoint, variant):
    """A long prefill (expanded MLA), a varlen batch over cached prefixes, then decodes and a
    short verify-sized chunk (absorbed MLA): every row equals HF's logits for that position."""
    folder = deepseek_checkpoint(variant)
    full = {"a": prompt(26, 1), "b": prompt(12, 2), "c": prompt(6, 3)}
    steps = [
        [("a", full["a"][:20]), ("b", full["b"][:5])],
        [("b", full["b"][5:9]), ("a", full["a"][20:21]), ("c", full["c"][:6])],
        [("a", full["a"][21:25]), ("b", full["b"][9:10])],
        [("a", full["a"][25:]), ("b", full["b"][10:])],
    ]
    runner = PagedRunner(build(folder), block_size=4)
    expected = {s: hf_logits(folder, t) for s, t in full.items()}
    done = {s: 0 for s in full}
    for chunks in steps:
        logits, _, _ = runner.step(chunks)
        for rows, (seq, tokens) in zip(runner.split(logits, chunks), chunks):
            want = expected[seq][done[seq] : done[seq] + len(tokens)]
            torch.testing.assert_close(rows, want, rtol=0, atol=ATOL)
            done[seq] += len(tokens)
    assert done == {s: len(t) for s, t in full.items()}


@pytest.mark.parametrize("variant", ["v3", "v2_lite"])
def test_greedy_tokens_match_hf_generate(deepseek_checkpoint, variant):
    folder = deepseek_checkpoint(variant)
    prompts = [prompt(9, 4), prompt(3, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(folder, dtype="float32", num_kv_blocks=32, block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = hf_model(folder)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(p):].tolist()


def test_aux_hidden_states_match_hf(deepseek_checkpoint):
    folder = deepseek_checkpoint("v3")
    aux_layers = (3, 0, 2)
    runner = PagedRunner(build(folder, aux_layers))
    chunks = [("a", prompt(9, 6)), ("b", prompt(4, 7))]
    _, hidden, aux = runner.step(chunks)
    for i, (_, tokens) in enumerate(chunks):
        with torch.no_grad():
            out = hf_model(folder)(torch.tensor([tokens]), output_hidden_states=True)
        for layer, captured in zip(aux_layers, aux):
            torch.testing.assert_close(runner.split(captured, chunks)[i], out.hidden_states[layer][0],
                                       rtol=0, atol=ATOL)
        torch.testing.assert_close(runner.split(hidden, chunks)[i], out.hidden_states[-1][0], rtol=0, atol=ATOL)


# ------------------------------------------------------------------------------- Kimi-K2.5


def greedy_model_tokens(model, tokens: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    runner = PagedRunner(model, block_size=4)
    logits, _, _ = runner.step([("s", tokens)])
    rows, out = [logits[-1]], []
    for _ in range(steps):
        out.append(int(rows[-1].argmax()))
        logits, _, _ = runner.step([("s", out[-1:])])
        rows.append(logits[-1])
    return out, torch.stack(rows)


def test_kimi_k25_layout_equals_plain_layout(deepseek_checkpoint):
    k25, plain = deepseek_checkpoint("kimi_k25"), deepseek_checkpoint("kimi_k25_plain")
    model = build(k25)
    assert not any(n.startswith(("vision", "mm_")) for n, _ in model.named_parameters())
    tokens = prompt(11, 8)
    ours, ours_logits = greedy_model_tokens(model, tokens, 8)
    ref, ref_logits = greedy_model_tokens(build(plain), tokens, 8)
    assert ours == ref
    assert torch.equal(ours_logits, ref_logits)
    # and the plain layout is HF's DeepseekV3 (rms_norm_eps 1e-5, yarn factor 64)
    torch.testing.assert_close(ref_logits[0], hf_logits(plain, tokens)[-1], rtol=0, atol=ATOL)


def test_kimi_k25_through_the_engine(deepseek_checkpoint):
    k25, plain = deepseek_checkpoint("kimi_k25"), deepseek_checkpoint("kimi_k25_plain")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    p = [{"prompt_token_ids": prompt(7, 9)}]
    # The fixture's tokenizer_config names Kimi's own tokenizer class, which transformers
    # cannot build offline; token-id prompts need none.
    got = LLM(k25, dtype="float32", num_kv_blocks=16, skip_tokenizer_init=True).generate(p, params, use_tqdm=False)
    want = LLM(plain, dtype="float32", num_kv_blocks=16, skip_tokenizer_init=True).generate(p, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


# ---------------------------------------------------------------------------- loading rules


def test_target_ignores_mtp_layers_and_names_missing_experts(deepseek_checkpoint, tmp_path):
    folder = deepseek_checkpoint("v3")
    model = build(folder)  # model.layers.4.* (the MTP layer) is in the file and ignored
    assert len(model.model.layers) == 4
    broken = make_variant(folder, str(tmp_path / "broken"),
                          remove=("model.layers.2.mlp.experts.3.up_proj.weight",))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.gate_up_proj \(shard \(3, 1\)\)"):
        build(broken)
    bad_expert = make_variant(folder, str(tmp_path / "bad_expert"), rename={
        "model.layers.2.mlp.experts.3.up_proj.weight": "model.layers.2.mlp.experts.8.up_proj.weight"})
    with pytest.raises(CheckpointError, match="experts.8.up_proj.*8 experts"):
        build(bad_expert)


def test_bad_routing_config_names_the_file(deepseek_checkpoint, tmp_path):
    folder = make_variant(deepseek_checkpoint("v3"), str(tmp_path / "bad"))
    ds._write_json(folder, "config.json", dict(ds.v3_config(), topk_method="aux_free"))
    config = HFConfig.from_folder(folder)
    options = ModelOptions(torch.float32, torch.device("cpu"), TorchAttentionBackend())
    with pytest.raises(ValueError, match=r"config\.json: topk_method 'aux_free'.*noaux_tc"):
        resolve_model_class(config)(config, options)


# ----------------------------------------------------------------------------------- layers


def test_absorbed_and_expanded_mla_agree():
    g = torch.Generator().manual_seed(0)
    heads, nope, rope, v, rank, ctx, q_len = 4, 16, 8, 12, 32, 23, 5
    q_nope, q_pe = torch.randn(q_len, heads, nope, generator=g), torch.randn(q_len, heads, rope, generator=g)
    w = torch.randn(heads, nope + v, rank, generator=g) / rank**0.5
    context = torch.randn(ctx, rank + rope, generator=g)
    args = (q_nope, q_pe, w[:, :nope], w[:, nope:], context, 0.2)
    torch.testing.assert_close(absorbed_attention(*args), expanded_attention(*args), rtol=0, atol=1e-5)
    # and the expanded form is plain attention over the explicitly built keys and values
    k = torch.cat([context[:, :rank] @ w[:, :nope].transpose(1, 2), context[None, :, rank:].expand(heads, -1, -1)], -1)
    vals = context[:, :rank] @ w[:, nope:].transpose(1, 2)  # [heads, ctx, v]
    q = torch.cat([q_nope, q_pe], -1).transpose(0, 1)  # [heads, q_len, d]
    scores = (q @ k.transpose(1, 2)) * 0.2
    mask = torch.arange(ctx)[None] > torch.arange(ctx - q_len, ctx)[:, None]
    ref = torch.softmax(scores.masked_fill(mask, -math.inf), -1) @ vals
    torch.testing.assert_close(expanded_attention(*args), ref.transpose(0, 1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("n_group,topk_group,norm", [(4, 2, True), (1, 1, False), (8, 3, True)])
def test_sigmoid_router_matches_hf(n_group, topk_group, norm):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    hf = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(16, 16, generator=g))
        hf.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.2)
    x = torch.randn(50, 16, generator=g)
    _, hf_w, hf_ids = hf(x)
    router = RouterConfig(16, 4, "sigmoid", "noaux_tc", n_group, topk_group, norm, 2.5)
    w, ids = select_experts(x @ hf.weight.T, router, hf.e_score_correction_bias)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order), rtol=0, atol=1e-6)


def test_softmax_group_limited_router():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(40, 8, generator=g)
    w, ids = select_experts(logits, RouterConfig(8, 2, "softmax", "group_limited_greedy", 4, 1))
    scores = logits.softmax(-1)
    best_group = scores.view(40, 4, 2).amax(-1).argmax(-1)
    assert torch.equal(ids.sort(-1).values, torch.stack([best_group * 2, best_group * 2 + 1], -1))
    torch.testing.assert_close(w, scores.gather(1, ids))
    with pytest.raises(ValueError, match="topk_group"):
        RouterConfig(8, 4, "softmax", "group_limited_greedy", 4, 1)


def test_grouped_experts_equal_per_token_loop():
    g = torch.Generator().manual_seed(3)
    tokens, hidden, inter, experts, k = 13, 8, 6, 5, 2
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g)
    down = torch.randn(experts, hidden, inter, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    ids[:, 0] = 1  # an expert shared by every token, and some experts without any
    ids[:, 1] = torch.where(ids[:, 1] == 1, 3, ids[:, 1])
    weights = torch.rand(tokens, k, generator=g)
    ref = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(k):
            gate, up = (gate_up[ids[t, j]] @ x[t]).chunk(2)
            ref[t] += weights[t, j] * (down[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(experts_forward_torch(x, gate_up, down, weights, ids), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaling", [ds.YARN_V3, ds.YARN_K25, {**ds.YARN_V3, "beta_fast": 1, "factor": 32}],
                         ids=["v3", "k25", "k2_betas"])
def test_yarn_matches_hf(scaling):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    max_pos = int(scaling["factor"] * scaling["original_max_position_embeddings"])
    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16, qk_nope_head_dim=16,
                           v_head_dim=16, kv_lora_rank=32, q_lora_rank=32, rope_scaling=dict(scaling),
                           rope_theta=50000.0, max_position_embeddings=max_pos)
    hf = DeepseekV3RotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 5, 63, 500, max_pos - 1])
    hf_cos, hf_sin = hf(torch.zeros(1), positions[None])
    params = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": "yarn"}
    ours = RotaryEmbedding(16, max_pos, 50000.0, params, style="gptj")
    cos, sin = ours.cos_sin(positions)
    torch.testing.assert_close(cos, hf_cos[0, :, :8], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0, :, :8], rtol=0, atol=1e-6)
    scale = (32**-0.5) * yarn_softmax_scale_factor(params)
    assert scale == pytest.approx(DeepseekV3Attention(cfg, 0).scaling, rel=1e-12)


def test_interleaved_rope_is_hf_deinterleaved():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    g = torch.Generator().manual_seed(4)
    rotary = RotaryEmbedding(8, 64, 10000.0, style="gptj")
    positions = torch.tensor([0, 3, 17, 40])
    q, k = torch.randn(4, 3, 8, generator=g), torch.randn(4, 1, 8, generator=g)
    ours_q, ours_k = rotary(positions, q, k)
    cos, sin = rotary.cos_sin(positions)
    full = lambda t: torch.cat([t, t], -1)[None]  # noqa: E731  [1, T, 8]
    hf_q, hf_k = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 full(cos), full(sin))
    hf_q, hf_k = hf_q[0].transpose(0, 1), hf_k[0].transpose(0, 1)
    # HF lays the rotated pairs out as [evens | odds]; we keep them interleaved.
    assert torch.equal(torch.cat([ours_q[..., 0::2], ours_q[..., 1::2]], -1), hf_q)
    assert torch.equal(torch.cat([ours_k[..., 0::2], ours_k[..., 1::2]], -1), hf_k)
    assert torch.equal(apply_rope_gptj(q, cos, sin), ours_q)


def test_ignored_tensors_are_never_read(deepseek_checkpoint, monkeypatch):
    """The target skips the MTP layer's tensors without reading them (on a real checkpoint
    that is a whole decoder layer of experts, and FP8 dequantization besides)."""
    import safetensors

    read: list[str] = []
    real_open = safetensors.safe_open

    class CountingOpen:
        def __init__(self, *args, **kwargs):
            self._file = real_open(*args, **kwargs)

        def __enter__(self):
            self._inner = self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, key):
            read.append(key)
            return self._inner.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", CountingOpen)
    build(deepseek_checkpoint("v3"))
    assert read and not any(key.startswith("model.layers.4.") for key in read)
