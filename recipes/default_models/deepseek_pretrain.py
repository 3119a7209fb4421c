"""Pretraining a small DeepSeek-V3-layout LM (MLA + MoE) jointly with one MTP layer, for the
default model family.

The main model is transformers' DeepseekV3ForCausalLM. The MTP layer follows DeepSeek-V3's
multi-token prediction (one depth), laid out like the published checkpoints' model.layers.{N}:
for the pair (final hidden state h_i after the model's norm, token t_{i+1}) at position i,
  x   = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))
  out = shared_head.norm(block(x))            a full decoder block (MLA + MoE), causal over i
  p   = softmax(lm_head(out))                 predicts t_{i+2}; the output head is shared
Loss: CE(main, t_{i+1}) + mtp_weight * CE(mtp, t_{i+2}) (DeepSeek-V3 uses 0.3 early in training).
The routed experts are balanced without an auxiliary loss, as in DeepSeek-V3: after each step
every MoE router's e_score_correction_bias moves by bias_update_speed against its expert's load
error (sign of mean load - load).

save_deepseek_mtp writes the per-expert DeepSeek-V3 checkpoint layout (what foretell, vLLM and
SGLang read; the MTP layer stores copies of the embedding and the output head, like the
published checkpoints), bfloat16 with the router biases in float32, sharded below a size.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from recipes.default_models.pretrain import PretrainOptions, train_on_stream


def deepseek_v3_config(vocab_size: int, hidden: int, layers: int, dense_layers: int, heads: int,
                       q_lora_rank: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                       v_head_dim: int, intermediate: int, moe_intermediate: int, experts: int,
                       shared_experts: int, experts_per_token: int, groups: int, topk_groups: int,
                       max_positions: int, special_ids: dict[str, int]) -> dict:
    """config.json fields of a DeepseekV3ForCausalLM with one MTP layer (untied head, sigmoid
    noaux_tc routing with groups, normalised top-k weights, interleaved RoPE, no YaRN)."""
    eot = special_ids["<|endoftext|>"]
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": intermediate,
        "moe_intermediate_size": moe_intermediate, "num_hidden_layers": layers,
        "num_nextn_predict_layers": 1, "first_k_dense_replace": dense_layers, "moe_layer_freq": 1,
        "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": q_lora_rank,
        "kv_lora_rank": kv_lora_rank, "qk_nope_head_dim": qk_nope_head_dim,
        "qk_rope_head_dim": qk_rope_head_dim, "v_head_dim": v_head_dim,
        "n_routed_experts": experts, "n_shared_experts": shared_experts,
        "num_experts_per_tok": experts_per_token, "n_group": groups, "topk_group": topk_groups,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "hidden_act": "silu", "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "rope_interleave": True,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot,
    }


def hf_deepseek_config(config: dict):
    from transformers import DeepseekV3Config

    hf = DeepseekV3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    hf._attn_implementation = "sdpa"
    return hf


class MTPLayer(nn.Module):
    """One MTP depth; parameter names are the checkpoint's under model.layers.{N}."""

    def __init__(self, hf_config, layer_index: int):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.enorm = DeepseekV3RMSNorm(hidden, eps=eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = DeepseekV3DecoderLayer(hf_config, layer_index)
        self.shared_head_norm = DeepseekV3RMSNorm(hidden, eps=eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, position_embeddings) -> torch.Tensor:
        # hidden, next_embeds: [B, T, H] -> [B, T, H] (after shared_head.norm)
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        T = x.shape[1]
        causal = torch.full((T, T), float("-inf"), device=x.device, dtype=x.dtype).triu(1)[None, None]
        return self.shared_head_norm(self.block(x, attention_mask=causal, position_embeddings=position_embeddings))


class DeepseekWithMTP(nn.Module):
    """The main model and its MTP layer, trained together."""

    def __init__(self, config: dict):
        from transformers import DeepseekV3ForCausalLM

        super().__init__()
        hf = hf_deepseek_config(config)
        self.config = config
        self.lm = DeepseekV3ForCausalLM(hf)
        self.mtp = MTPLayer(hf, config["num_hidden_layers"])
        self.mtp.apply(self.lm._init_weights)  # outside the HF model, so post_init did not reach it
        self._loads: list[torch.Tensor] = []
        for moe in self._moe_layers():
            moe.experts.register_forward_pre_hook(self._record_load, with_kwargs=True)

    def forward(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        """batch [B, L + 2] -> main and MTP logits over the first L positions."""
        L = batch.shape[1] - 2
        inputs = batch[:, :L]
        positions = torch.arange(L, device=batch.device)[None]  # [1, L]
        hidden = self.lm.model(input_ids=inputs, position_ids=positions).last_hidden_state  # [B, L, H] normed
        cos_sin = self.lm.model.rotary_emb(hidden, positions)
        out = self.mtp(hidden, self.lm.model.embed_tokens(batch[:, 1 : L + 1]), cos_sin)
        return {"main": self.lm.lm_head(hidden), "mtp": self.lm.lm_head(out)}  # [B, L, V] each

    def losses(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        L = batch.shape[1] - 2
        logits = self(batch)
        main = F.cross_entropy(logits["main"].float().flatten(0, 1), batch[:, 1 : L + 1].flatten())
        mtp = F.cross_entropy(logits["mtp"].float().flatten(0, 1), batch[:, 2:].flatten())
        return main, mtp

    # ---- aux-loss-free balancing

    def _moe_layers(self) -> list[nn.Module]:
        blocks = list(self.lm.model.layers) + [self.mtp.block]
        return [b.mlp for b in blocks if hasattr(b.mlp, "experts")]

    def _record_load(self, module, args, kwargs) -> None:
        """The experts' call carries the chosen expert ids [tokens, top_k] (the one integer tensor)."""
        tensors = [*args, *kwargs.values()]
        indices = next((a for a in tensors if isinstance(a, torch.Tensor) and not a.is_floating_point()), None)
        if indices is not None and self.training:
            self._loads.append(torch.bincount(indices.flatten(), minlength=module.num_experts)[: module.num_experts])

    @torch.no_grad()
    def balance_experts(self, speed: float) -> None:
        """Raise the routing bias of under-loaded experts and lower it for over-loaded ones."""
        layers, loads = self._moe_layers(), self._loads
        self._loads = []
        if len(loads) != len(layers):  # checkpointed/skipped forwards: nothing reliable to use
            return
        for moe, load in zip(layers, loads):
            load = load.float()
            moe.gate.e_score_correction_bias += speed * torch.sign(load.mean() - load)


def pretrain_deepseek_mtp(config: dict, train_tokens: torch.Tensor, opts: PretrainOptions,
                          eval_tokens: torch.Tensor | None = None, mtp_weight: float = 0.3,
                          bias_update_speed: float = 1e-3):
    """Train a DeepseekWithMTP from scratch on train_tokens [N] int64. Returns (model, stats)."""
    torch.manual_seed(opts.seed)
    model = DeepseekWithMTP(config).to(opts.device)

    def step_loss(batch: torch.Tensor):  # [B, L + 2]
        main, mtp = model.losses(batch)
        return main + mtp_weight * mtp, {"main": main.detach(), "mtp": mtp.detach()}

    stats = train_on_stream(model, step_loss, train_tokens, opts, window=opts.seq_len + 2,
                            after_step=lambda: model.balance_experts(bias_update_speed))
    stats["mtp_weight"] = mtp_weight
    if eval_tokens is not None and eval_tokens.numel() > opts.seq_len + 2:
        stats.update(evaluate_deepseek_mtp(model, eval_tokens.to(opts.device), opts))
    model.eval()
    return model, stats


@torch.no_grad()
def evaluate_deepseek_mtp(model: DeepseekWithMTP, tokens: torch.Tensor, opts: PretrainOptions,
                          max_windows: int = 128) -> dict[str, float]:
    """Held-out losses of both heads, and how often the MTP layer's argmax at i equals the main
    model's argmax at i + 1 (teacher-forced MTP acceptance under greedy verification)."""
    model.eval()
    L = opts.seq_len
    n = min((tokens.numel() - 2) // L, max_windows)
    starts = torch.arange(n, device=tokens.device) * L
    main = mtp = agree = 0.0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=tokens.device.type == "cuda")
    for i in range(0, n, opts.batch_size):
        chunk = starts[i : i + opts.batch_size]
        batch = tokens[chunk[:, None] + torch.arange(L + 2, device=tokens.device)]  # [b, L + 2]
        with autocast:
            logits = model(batch)
        main += F.cross_entropy(logits["main"].float().flatten(0, 1), batch[:, 1 : L + 1].flatten(), reduction="sum").item()
        mtp += F.cross_entropy(logits["mtp"].float().flatten(0, 1), batch[:, 2:].flatten(), reduction="sum").item()
        agree += (logits["mtp"][:, :-1].argmax(-1) == logits["main"][:, 1:].argmax(-1)).sum().item()
    model.train()
    return {"eval_loss": main / (n * L), "eval_mtp_loss": mtp / (n * L), "eval_mtp_acceptance": agree / (n * (L - 1))}


# ----------------------------------------------------------------------------------- saving


def deepseek_checkpoint_state(model: DeepseekWithMTP) -> dict[str, torch.Tensor]:
    """The DeepSeek-V3 checkpoint keys: per-expert weights, the MTP layer as model.layers.{N}."""
    n = model.config["num_hidden_layers"]
    state = {k: v for k, v in model.lm.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    mtp = model.mtp.state_dict()
    prefix = f"model.layers.{n}."
    for key, value in mtp.items():
        if key.startswith("block."):
            state[prefix + key[len("block."):]] = value
        elif key.startswith("shared_head_norm."):
            state[prefix + "shared_head.norm." + key[len("shared_head_norm."):]] = value
        else:
            state[prefix + key] = value
    state[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"]
    state[prefix + "shared_head.head.weight"] = state["lm_head.weight"]
    out = {}
    for key, value in state.items():
        if key.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows first
            base = key[: -len("gate_up_proj")]
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e]
                out[f"{base}{e}.up_proj.weight"] = up[e]
        elif key.endswith("mlp.experts.down_proj"):  # [E, H, I]
            base = key[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    keep_fp32 = ("e_score_correction_bias",)
    return {k: (v.float() if k.endswith(keep_fp32) else v.to(torch.bfloat16)).contiguous().clone()
            for k, v in out.items()}


def save_deepseek_mtp(model: DeepseekWithMTP, folder: str, max_shard_bytes: int = 15_000_000) -> None:
    """model*.safetensors (+ index when sharded) and config.json; no tensor is shared."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    state = deepseek_checkpoint_state(model)
    shards, current, size = [], {}, 0
    for key in sorted(state):
        nbytes = state[key].numel() * state[key].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = state[key]
        size += nbytes
    shards.append(current)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, "model.safetensors"), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(folder, name), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(v.numel() * v.element_size() for v in state.values())
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(model.config, torch_dtype="bfloat16", dtype="bfloat16"), f, indent=2)
        f.write("\n")
