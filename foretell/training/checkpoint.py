"""Saving and loading: the standard head layout, and the training state behind --resume.

Head layout (what foretell, vLLM and SGLang load): config.json (LlamaForCausalLMEagle3,
draft_vocab_size, target_hidden_size, eagle_config with the aux ids in SpecForge's "output of
layer j" convention, torch_dtype) and model.safetensors with fc, midlayer.*, norm, lm_head
(bfloat16 by default), d2t (int64) and t2d (bool); no embed_tokens (the target's is shared).

Training state: OUT/checkpoint/state.pt (head, optimizer, scheduler, step, data position, draft
vocabulary, aux layers); written atomically.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

STATE_DIR = "checkpoint"
STATE_FILE = "state.pt"


def save_head(head, folder: str, dtype: torch.dtype = torch.bfloat16, extra_config: dict | None = None) -> str:
    """Write config.json + model.safetensors; floating tensors cast to dtype."""
    os.makedirs(folder, exist_ok=True)
    config = dict(head.config)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config.update(extra_config or {})
    state = {
        name: (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu()
        for name, t in head.export_state().items()
    }
    _atomic(os.path.join(folder, "model.safetensors"),
            lambda p: save_file(state, p, metadata={"format": "pt"}))
    _atomic(os.path.join(folder, "config.json"),
            lambda p: _write_json(p, config))
    return folder


def load_head_state(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a saved head, with `layers.0.*` renamed to `midlayer.*`."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: not an EAGLE3 head folder")
    with open(path) as f:
        config = json.load(f)
    weights = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{weights} not found: the head's weights are missing")
    tensors = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v
               for k, v in load_file(weights).items()}
    return config, tensors


def save_training_state(out: str, state: dict) -> None:
    folder = os.path.join(out, STATE_DIR)
    os.makedirs(folder, exist_ok=True)
    _atomic(os.path.join(folder, STATE_FILE), lambda p: torch.save(state, p))


def load_training_state(out: str) -> dict:
    path = os.path.join(out, STATE_DIR, STATE_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--resume: no training state at {path} (nothing to resume)")
    return torch.load(path, map_location="cpu", weights_only=False)


def _write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _atomic(path: str, write) -> None:
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def head_from_state(config: dict, tensors: dict[str, torch.Tensor], embedding: torch.Tensor, device):
    """A trainable head (float32) from a saved head's config and tensors; a head that ships its
    own embed_tokens uses it, else the target's `embedding`."""
    from foretell.training.head import Eagle3TrainHead

    tensors = dict(tensors)
    own = tensors.pop("embed_tokens.weight", None)
    head = Eagle3TrainHead(config, own if own is not None else embedding, device)
    if "t2d" not in tensors and "d2t" in tensors:
        t2d = torch.zeros(head.t2d.numel(), dtype=torch.bool)
        t2d[torch.arange(tensors["d2t"].numel()) + tensors["d2t"]] = True
        tensors["t2d"] = t2d
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"head tensors do not match the EAGLE3 layout: missing {missing}, unexpected {unexpected}")
    return head
