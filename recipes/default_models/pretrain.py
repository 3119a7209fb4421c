"""Pretraining a small causal LM from scratch with transformers' model classes (Qwen3 layout), for
the default model family. Plain next-token cross-entropy on random windows of one token stream.

Master weights are float32; on CUDA the forward runs under bfloat16 autocast. Warmup then cosine
to min_lr_ratio * lr; with a time budget the schedule follows max(step / steps, elapsed / budget)
so a run that must end in N seconds still anneals. The saved folder is a plain HF checkpoint in
bfloat16 (sharded so no file exceeds max_shard_size).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

log = logging.getLogger(__name__)


@dataclass
class PretrainOptions:
    steps: int = 1000
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    time_budget_s: float | None = None
    device: str = "cpu"
    seed: int = 0
    log_every: int = 50
    progress: bool = True


def qwen3_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, max_positions: int, special_ids: dict[str, int]) -> dict:
    """config.json fields of a Qwen3ForCausalLM (tied embeddings, like Qwen3-0.6B)."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": layers,
        "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": special_ids["<|endoftext|>"], "eos_token_id": special_ids["<|endoftext|>"],
        "pad_token_id": special_ids["<|endoftext|>"],
    }


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _lr(opts: PretrainOptions, step: int, elapsed: float) -> float:
    progress = step / max(opts.steps, 1)
    if opts.time_budget_s:
        progress = max(progress, elapsed / opts.time_budget_s)
    if step < opts.warmup_steps:
        return opts.lr * (step + 1) / opts.warmup_steps
    t = min(progress, 1.0)
    return opts.lr * (opts.min_lr_ratio + (1 - opts.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _windows(tokens: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return tokens[starts[:, None] + torch.arange(length, device=tokens.device)]  # [B, length]


def pretrain_causal_lm(config: dict, train_tokens: torch.Tensor, opts: PretrainOptions,
                       eval_tokens: torch.Tensor | None = None):
    """Train a Qwen3ForCausalLM from scratch on train_tokens [N] int64. Returns (model, stats)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(opts.seed)
    hf_config = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    hf_config._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(hf_config).to(opts.device)

    def step_loss(batch: torch.Tensor) -> tuple[torch.Tensor, dict]:  # batch [B, L + 1]
        logits = model(input_ids=batch[:, :-1]).logits  # [B, L, V]
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        return loss, {}

    stats = train_on_stream(model, step_loss, train_tokens, opts, window=opts.seq_len + 1)
    if eval_tokens is not None and eval_tokens.numel() > opts.seq_len + 1:
        stats["eval_loss"] = evaluate_lm(model, eval_tokens.to(opts.device), opts)
    model.eval()
    return model, stats


def train_on_stream(model: torch.nn.Module, step_loss, train_tokens: torch.Tensor, opts: PretrainOptions,
                    window: int, after_step=None) -> dict:
    """The training loop shared by the recipe's models: AdamW (no decay on vectors), warmup +
    cosine on max(step, time) progress, bf16 autocast on CUDA, random windows of `window` tokens.
    step_loss(batch [B, window]) -> (loss, {name: float tensor}) runs under autocast; after_step()
    (if given) runs after each optimizer step (e.g. MoE bias balancing)."""
    device = torch.device(opts.device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opts.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opts.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    tokens = train_tokens.to(device)
    if tokens.numel() <= window:
        raise ValueError(f"the corpus has {tokens.numel()} tokens, fewer than one window of {window}")
    generator = torch.Generator(device=device).manual_seed(opts.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    model.train()
    start, step, losses, parts = time.time(), 0, [], []
    bar = tqdm(total=opts.steps, desc=f"pretrain {count_parameters(model) / 1e6:.1f}M", disable=not opts.progress)
    while step < opts.steps:
        elapsed = time.time() - start
        if opts.time_budget_s and elapsed >= opts.time_budget_s:
            break
        for group in optimizer.param_groups:
            group["lr"] = _lr(opts, step, elapsed)
        starts = torch.randint(0, tokens.numel() - window, (opts.batch_size,), device=device, generator=generator)
        with autocast:
            loss, logged = step_loss(_windows(tokens, starts, window))  # batch [B, window]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip)
        optimizer.step()
        if after_step is not None:
            after_step()
        step += 1
        if step % opts.log_every == 0 or step == 1:
            losses.append((step, loss.item()))
            parts.append({k: float(v) for k, v in logged.items()})
            bar.set_postfix(loss=f"{losses[-1][1]:.3f}", **{k: f"{v:.3f}" for k, v in parts[-1].items()})
        bar.update(1)
    bar.close()
    return {"steps": step, "train_time_s": time.time() - start, "final_train_loss": losses[-1][1] if losses else None,
            "final_train_parts": parts[-1] if parts else {}, "tokens_seen": step * opts.batch_size * (window - 1),
            "parameters": count_parameters(model), "loss_history": losses}


@torch.no_grad()
def evaluate_lm(model, tokens: torch.Tensor, opts: PretrainOptions, max_windows: int = 256) -> float:
    """Mean next-token loss over consecutive windows of tokens."""
    model.eval()
    n = min((tokens.numel() - 1) // opts.seq_len, max_windows)
    starts = torch.arange(n, device=tokens.device) * opts.seq_len
    total = 0.0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=tokens.device.type == "cuda")
    for i in range(0, n, opts.batch_size):
        batch = _windows(tokens, starts[i : i + opts.batch_size], opts.seq_len + 1)
        with autocast:
            logits = model(input_ids=batch[:, :-1]).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
    model.train()
    return total / (n * opts.seq_len)


def save_lm(model, folder: str, max_shard_size: str = "15MB") -> None:
    """bfloat16 safetensors (sharded above max_shard_size) + config.json + generation_config.json."""
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
