"""What the head learns from, computed by the target (Hugging Face transformers, no gradients).

For a padded batch: the aux hidden states (the residual stream ENTERING each chosen layer, HF's
hidden_states[i], concatenated in ascending layer order as the engine does), the target's logits
restricted to the draft vocabulary, and the target's argmax over its full vocabulary (what the
engine's greedy verification compares drafts against).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with 0
    attention_mask: torch.Tensor  # [B, T] int64, 1 on real tokens
    loss_mask: torch.Tensor  # [B, T] float32, 1 on tokens the target writes (0 on padding)

    @classmethod
    def collate(cls, examples, device, pad_to_multiple: int = 64) -> "Batch":
        """Right-pads to the longest example, rounded up to pad_to_multiple so that the kernels
        (attention, cuDNN plans, the allocator) see few distinct shapes."""
        longest = max(len(e.input_ids) for e in examples)
        T = -(-longest // pad_to_multiple) * pad_to_multiple
        ids = torch.zeros(len(examples), T, dtype=torch.int64)
        attn = torch.zeros(len(examples), T, dtype=torch.int64)
        mask = torch.zeros(len(examples), T, dtype=torch.float32)
        for b, e in enumerate(examples):
            n = len(e.input_ids)
            ids[b, :n] = torch.tensor(e.input_ids)
            attn[b, :n] = 1
            mask[b, :n] = torch.tensor(e.loss_mask, dtype=torch.float32)
        return cls(ids.to(device), attn.to(device), mask.to(device))


@dataclass
class Features:
    aux: torch.Tensor  # [B, T, 3 * Ht] target dtype
    target_logits: torch.Tensor  # [B, T, draft_vocab] float32, restricted to the draft vocab
    target_argmax: torch.Tensor  # [B, T] int64, over the full target vocabulary


class TargetFeatures:
    """The frozen target. `embedding` is its input embedding, shared with the head."""

    def __init__(self, target: str, aux_layers: tuple[int, ...], used_ids: torch.Tensor,
                 device: torch.device, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
        self.model.requires_grad_(False)
        self.aux_layers = tuple(aux_layers)
        self.used_ids = used_ids.to(device)
        self.dtype = dtype

    @property
    def embedding(self) -> torch.Tensor:  # [V, Ht]
        return self.model.get_input_embeddings().weight

    @property
    def lm_head(self) -> torch.Tensor:  # [V, Ht]
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def __call__(self, batch: Batch) -> Features:
        out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         output_hidden_states=True, use_cache=False)
        aux = torch.cat([out.hidden_states[i] for i in self.aux_layers], dim=-1)  # [B, T, 3 Ht]
        logits = out.logits  # [B, T, V]
        return Features(aux, logits[..., self.used_ids].float(), logits.argmax(-1))
