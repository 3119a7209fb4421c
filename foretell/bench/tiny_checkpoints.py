"""Tiny random checkpoints in the published formats, for benchmarks that need a real model folder
but no real model (bf16 agreement of speculation with plain decoding): a Qwen3 target and an
EAGLE3 head for it, written as safetensors with Hugging Face key names. No tokenizer: feed them
token ids with skip_tokenizer_init=True.

Weights are normal noise scaled by 1 / sqrt(fan-in) (norms 1 + 0.1 noise, embeddings unscaled), so
that activations stay near unit size and greedy tokens are decided by clear margins, as in a
trained model, rather than by near-ties.
"""

from __future__ import annotations

import json
import os

import torch

QWEN3_TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_hidden_layers": 4, "vocab_size": 512, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None, "attention_bias": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    "use_sliding_window": False, "sliding_window": None,
}


def _noise(shape: tuple[int, ...], gen: torch.Generator, kind: str) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    if kind == "norm":
        x = 1.0 + 0.1 * x
    elif kind == "linear":  # [out, in]
        x = x / shape[-1] ** 0.5
    return x.to(torch.bfloat16).contiguous()


def _save(folder: str, config: dict, state: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


def write_tiny_qwen3(folder: str, seed: int = 0) -> str:
    """A 4-layer Qwen3 (hidden 64, vocab 512) with random weights into folder; returns folder."""
    c = QWEN3_TINY
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_width, kv_width = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": ((c["vocab_size"], hidden), "embedding"),
              "model.norm.weight": ((hidden,), "norm"), "lm_head.weight": ((c["vocab_size"], hidden), "linear")}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": ((hidden,), "norm"), p + "post_attention_layernorm.weight": ((hidden,), "norm"),
            p + "self_attn.q_proj.weight": ((q_width, hidden), "linear"),
            p + "self_attn.k_proj.weight": ((kv_width, hidden), "linear"),
            p + "self_attn.v_proj.weight": ((kv_width, hidden), "linear"),
            p + "self_attn.o_proj.weight": ((hidden, q_width), "linear"),
            p + "self_attn.q_norm.weight": ((head_dim,), "norm"), p + "self_attn.k_norm.weight": ((head_dim,), "norm"),
            p + "mlp.gate_proj.weight": ((inter, hidden), "linear"), p + "mlp.up_proj.weight": ((inter, hidden), "linear"),
            p + "mlp.down_proj.weight": ((hidden, inter), "linear"),
        }
    state = {key: _noise(shape, gen, kind) for key, (shape, kind) in sorted(shapes.items())}
    return _save(folder, dict(c), state)


def write_tiny_eagle3_head(folder: str, target_folder: str, draft_vocab_size: int,
                           aux_layer_ids: list[int], seed: int = 7) -> str:
    """A random EAGLE3 head (the EAGLE repository's layout: midlayer.*, d2t / t2d over a draft
    vocabulary of draft_vocab_size target ids) for the target in target_folder; returns folder."""
    with open(os.path.join(target_folder, "config.json")) as f:
        target = json.load(f)
    vocab, hidden = target["vocab_size"], target["hidden_size"]
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab}] (the target's vocab_size), got {draft_vocab_size}")
    heads, kv_heads, head_dim, inter = 4, 2, 16, 2 * hidden
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": target["max_position_embeddings"], "vocab_size": vocab,
        "draft_vocab_size": draft_vocab_size, "target_hidden_size": hidden, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
    }
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "fc.weight": ((hidden, 3 * hidden), "linear"),
        "midlayer.self_attn.q_proj.weight": ((heads * head_dim, 2 * hidden), "linear"),
        "midlayer.self_attn.k_proj.weight": ((kv_heads * head_dim, 2 * hidden), "linear"),
        "midlayer.self_attn.v_proj.weight": ((kv_heads * head_dim, 2 * hidden), "linear"),
        "midlayer.self_attn.o_proj.weight": ((hidden, heads * head_dim), "linear"),
        "midlayer.mlp.gate_proj.weight": ((inter, hidden), "linear"),
        "midlayer.mlp.up_proj.weight": ((inter, hidden), "linear"),
        "midlayer.mlp.down_proj.weight": ((hidden, inter), "linear"),
        "midlayer.hidden_norm.weight": ((hidden,), "norm"),
        "midlayer.input_layernorm.weight": ((hidden,), "norm"),
        "midlayer.post_attention_layernorm.weight": ((hidden,), "norm"),
        "norm.weight": ((hidden,), "norm"),
        "lm_head.weight": ((draft_vocab_size, hidden), "linear"),
    }
    state = {key: _noise(shape, gen, kind) for key, (shape, kind) in shapes.items()}
    # d2t[i] = target id of draft id i, minus i (the EAGLE repository's offsets); t2d marks the ids.
    used = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab_size]).values
    state["d2t"] = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    state["t2d"] = t2d
    return _save(folder, config, state)
