"""The trainable twin of foretell.models.eagle3.Eagle3Head, and the config.json it is saved with.

The engine's head runs one packed sequence through a paged KV cache; training runs padded
batches through training-time test (ttt.py), where each step attends to the keys of the steps
before it. So this module has the checkpoint's own parameter names (q_proj/k_proj/v_proj and
gate_proj/up_proj unfused, `midlayer.*`) and takes a list of earlier steps' keys and values, but
computes exactly what the engine's head computes, with the engine's RMSNorm and RotaryEmbedding:
  x = concat(input_layernorm(embed(token)), hidden_norm(g))     [B, T, 2H], embedding first
  h = g + o_proj(attention(x)) ;  h = h + mlp(post_attention_layernorm(h))
  logits = lm_head(norm(h)) over the draft vocabulary; the next step gets h (before the norm)
tests/training/test_train_eagle3.py holds the two together on the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from foretell.models.base import HFConfig
from foretell.training.ttt import ttt_attention_mask

KVCache = list  # [(k, v), ...] one entry per earlier TTT step: [B, num_kv_heads, T, head_dim] each


def head_config(target_config: dict, draft_vocab_size: int, aux_layers: tuple[int, ...]) -> dict:
    """config.json of a head for this target: one Llama layer with the target's widths.

    aux_layers are inputs of layers i (HF hidden_states[i]); they are written in SpecForge's
    convention, "output of layer j" = i - 1, which is how foretell, SGLang and SpecForge read them.
    """
    target = HFConfig(target_config)
    heads = target.num_attention_heads
    rope_theta, rope_scaling = rope_parameters_from_config(target)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads", heads),
        "head_dim": target.get("head_dim") or target.hidden_size // heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta,
        "rope_scaling": None if rope_scaling["rope_type"] == "default" else rope_scaling,
        "max_position_embeddings": target.get("max_position_embeddings", 2048),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": min(draft_vocab_size, target.vocab_size),
        "target_hidden_size": target.hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in aux_layers],
            "use_aux_hidden_state": True,
        },
        "torch_dtype": "bfloat16",
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if target_config.get(key) is not None:
            config[key] = target_config[key]
    return config


def _rms(size: int, eps: float) -> RMSNorm:
    norm = RMSNorm(size, eps)
    norm.weight.requires_grad_(True)
    return norm


class TrainAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)

    def forward(self, x, positions, rotary: RotaryEmbedding, cache: KVCache):  # [B, T, 2H] -> [B, T, H]
        B, T, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(B * T, self.num_heads, d)
        k = self.k_proj(x).view(B * T, self.num_kv_heads, d)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, d).transpose(1, 2)  # [B, nkv, T, d]
        q, k = rotary(positions.reshape(-1), q, k)
        q = q.view(B, T, self.num_heads, d).transpose(1, 2)  # [B, nh, T, d]
        k = k.view(B, T, self.num_kv_heads, d).transpose(1, 2)  # [B, nkv, T, d]
        cache.append((k, v))
        step = len(cache) - 1
        gqa = self.num_heads != self.num_kv_heads
        if step == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5, enable_gqa=gqa)
        else:
            keys = torch.cat([c[0] for c in cache], dim=2)  # [B, nkv, (step+1) T, d]
            values = torch.cat([c[1] for c in cache], dim=2)
            mask = ttt_attention_mask(T, step, x.device)  # [T, (step+1) T]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=d**-0.5, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * d))


class TrainMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):  # [..., H] -> [..., H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TrainLayer(nn.Module):
    def __init__(self, config: HFConfig):
        super().__init__()
        H, eps = config.hidden_size, config.get("rms_norm_eps", 1e-6)
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self.self_attn = TrainAttention(H, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.mlp = TrainMLP(H, config.intermediate_size)
        self.hidden_norm = _rms(H, eps)
        self.input_layernorm = _rms(H, eps)
        self.post_attention_layernorm = _rms(H, eps)

    def forward(self, positions, embeds, g, rotary, cache):  # embeds, g [B, T, H] -> h [B, T, H]
        normed_g, _ = self.hidden_norm(g)
        residual = normed_g if self.norm_before_residual else g
        embeds, _ = self.input_layernorm(embeds)
        x = torch.cat([embeds, normed_g], dim=-1)  # [B, T, 2H], embedding first
        h = residual + self.self_attn(x, positions, rotary, cache)
        normed_h, _ = self.post_attention_layernorm(h)
        return h + self.mlp(normed_h)


class Eagle3TrainHead(nn.Module):
    """Parameters: fc, midlayer.*, norm, lm_head; buffers d2t, t2d (saved), and the target's
    embedding (frozen, not saved: the engine shares the target's)."""

    def __init__(self, config: dict, embedding: torch.Tensor, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = dict(config)
        c = HFConfig(self.config)
        H, Ht = c.hidden_size, c.target_hidden_size
        self.draft_vocab_size = c.draft_vocab_size
        with torch.device(device):
            self.fc = nn.Linear(3 * Ht, H, bias=False)
            self.midlayer = TrainLayer(c)
            self.norm = _rms(H, c.get("rms_norm_eps", 1e-6))
            self.lm_head = nn.Linear(H, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.register_buffer("embed_weight", embedding.detach().to(device), persistent=False)
        rope_theta, rope_scaling = rope_parameters_from_config(c)
        # The same table the engine builds: max(head, target) positions, float32. Kept out of the
        # module tree: casting the head (eval in the engine's dtype) must not round it, and
        # RotaryEmbedding's `_apply` attribute (its rope style) shadows nn.Module._apply.
        object.__setattr__(self, "rotary", RotaryEmbedding(
            c.head_dim, c.get("max_position_embeddings", 2048), rope_theta, rope_scaling, device=device))

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def target_ids(self) -> torch.Tensor:  # [draft_vocab] int64: target id of each draft id
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def combine(self, aux: torch.Tensor) -> torch.Tensor:  # [B, T, 3 Ht] -> g [B, T, H]
        return self.fc(aux)

    def step(self, input_ids, positions, g, cache: KVCache) -> torch.Tensor:
        """One TTT step: input_ids, positions [B, T]; g [B, T, H] -> h [B, T, H] (pre-norm)."""
        embeds = F.embedding(input_ids, self.embed_weight).to(g.dtype)
        return self.midlayer(positions, embeds, g, self.rotary, cache)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., draft_vocab] fp32
        normed, _ = self.norm(h)
        return self.lm_head(normed).float()

    def init_weights(self, target_lm_head: torch.Tensor | None, std: float = 0.02, seed: int = 0) -> None:
        """Llama-style normal(0, std) linears, unit norms; lm_head rows copied from the target's
        (its draft-vocabulary rows) when given, a warm start the draft's final norm matches."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    w = torch.randn(module.weight.shape, generator=g) * std
                    module.weight.copy_(w.to(module.weight.device))
            if target_lm_head is not None:
                rows = target_lm_head.detach()[self.target_ids().to(target_lm_head.device)]
                self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    def export_state(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensors by their published names (embed_weight excluded)."""
        return {k: v.detach() for k, v in self.state_dict().items()}
