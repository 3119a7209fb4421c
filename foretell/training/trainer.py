"""The EAGLE3 training loop: data -> target features -> TTT loss -> AdamW, with periodic
checkpoints, --resume, and a held-out teacher-forced evaluation at the end.

Master weights are float32; on CUDA with a half-precision --dtype the head runs under autocast.
The learning rate warms up linearly, then follows a cosine down to min_lr_ratio * lr; with a
time budget the schedule runs on max(step / steps, elapsed / budget), so a run that must finish
in N seconds still anneals.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from foretell.training.checkpoint import (head_from_state, load_head_state, load_training_state,
                                          save_head, save_training_state)
from foretell.training.data import ExampleBuilder, build_examples, read_records, split_eval
from foretell.training.evaluate import format_acceptance, teacher_forced_acceptance
from foretell.training.features import Batch, TargetFeatures
from foretell.training.head import Eagle3TrainHead, head_config
from foretell.training.regenerate import RegenerateOptions, regenerate_examples
from foretell.training.ttt import ttt_forward
from foretell.training.vocab import DraftVocab, build_draft_vocab

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
METRICS_FILE = "train_metrics.json"
EVAL_METRICS_FILE = "eval_metrics.json"


@dataclass
class TrainConfig:
    target: str
    data: list[str]
    out: str
    draft_vocab_size: int = 32000
    ttt_steps: int = 7
    max_len: int = 2048
    epochs: int = 1
    max_steps: int | None = None
    time_budget_s: float | None = None
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_size: int = 8
    chat: bool = False
    regenerate: bool = False
    regen_temperature: float = 0.0
    regen_max_tokens: int = 256
    regen_max_num_seqs: int = 256
    aux_layer_ids: list[int] | None = None
    device: str = "auto"
    dtype: str = "auto"
    resume: bool = False
    eval_fraction: float = 0.05
    eval_k: int = 3  # drafts per step in the engine walk of the evaluation
    eval_only: bool = False
    save_every: int = 0
    save_dtype: str = "bfloat16"
    init_lm_head: str = "target"  # target | random
    seed: int = 0
    log_every: int = 10
    progress: bool = True
    extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        checks = [
            (self.ttt_steps >= 1, "--ttt-steps must be >= 1"),
            (self.max_len >= 2, "--max-len must be >= 2"),
            (self.epochs >= 1, "--epochs must be >= 1"),
            (self.batch_size >= 1, "--batch-size must be >= 1"),
            (self.lr > 0, "--lr must be > 0"),
            (self.max_steps is None or self.max_steps >= 1, "--max-steps must be >= 1"),
            (self.eval_k >= 1, "--eval-k must be >= 1"),
            (self.save_every >= 0, "--save-every must be >= 0"),
            (self.init_lm_head in ("target", "random"), "--init-lm-head must be target or random"),
            (self.dtype in ("auto", *DTYPES), f"--dtype must be auto or one of {sorted(DTYPES)}"),
            (self.save_dtype in DTYPES, f"--save-dtype must be one of {sorted(DTYPES)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def resolve_device_dtype(cfg: TrainConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.dtype != "auto":
        return device, DTYPES[cfg.dtype]
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_aux_layers(ids: list[int] | None, num_layers: int) -> tuple[int, int, int]:
    """Inputs of layers i (HF hidden_states[i]); default 2, N//2, N-3 like the engine."""
    from foretell.spec_decode.eagle3 import default_aux_layers

    layers = tuple(int(i) for i in ids) if ids is not None else default_aux_layers(num_layers)
    if len(layers) != 3 or any(not 1 <= i < num_layers for i in layers):
        raise ValueError(
            f"aux layer ids {list(layers)} must be 3 layer inputs in [1, {num_layers}) for a target "
            f"with {num_layers} layers (input of layer 0, the embedding, cannot be written in the "
            f"head's 'output of layer j' convention)"
        )
    return layers


def _read_target_config(target: str) -> dict:
    path = os.path.join(target, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: --target must be a Hugging Face model folder")
    with open(path) as f:
        return json.load(f)


def load_examples(cfg: TrainConfig, device: torch.device):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    builder = ExampleBuilder(tokenizer, cfg.max_len)
    records = read_records(cfg.data, cfg.chat)
    if cfg.regenerate:
        options = RegenerateOptions(cfg.regen_temperature, cfg.regen_max_tokens, cfg.seed, str(device),
                                    cfg.dtype, cfg.regen_max_num_seqs, progress=cfg.progress)
        examples = regenerate_examples(cfg.target, records, builder, options,
                                       os.path.join(cfg.out, "regenerated.jsonl"))
        if not examples:
            raise ValueError("--regenerate produced no examples (every prompt was too long or empty)")
    else:
        examples = build_examples(records, builder)
    for reason, count in builder.skipped.items():
        log.warning("skipped %d examples: %s", count, reason)
    log.info("%d records -> %d examples, %d tokens (%d to learn)", len(records), len(examples),
             sum(len(e.input_ids) for e in examples), sum(sum(e.loss_mask) for e in examples))
    return examples


def make_batches(examples, batch_size: int, seed: int) -> list[list]:
    """Seeded shuffle; batches of similar lengths (sorted within windows of 32 batches) to cut
    padding, in shuffled order."""
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    window = 32 * batch_size
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: len(examples[i].input_ids))
        batches += [[examples[i] for i in chunk[j : j + batch_size]] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def lr_at(cfg: TrainConfig, step: int, total: int, elapsed: float) -> float:
    progress = step / max(total, 1)
    if cfg.time_budget_s:
        progress = max(progress, elapsed / cfg.time_budget_s)
    progress = min(progress, 1.0)
    warmup = cfg.warmup_ratio
    if progress < warmup:
        return cfg.lr * (progress / warmup)
    t = (progress - warmup) / max(1 - warmup, 1e-8)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def evaluate(head, features, examples, cfg: TrainConfig, device, dtype) -> dict:
    batches = (Batch.collate(b, device) for b in make_batches(examples, cfg.batch_size, cfg.seed))
    metrics = teacher_forced_acceptance(head, features, batches, cfg.ttt_steps, dtype, cfg.eval_k)
    metrics["num_examples"] = len(examples)
    return metrics


def train_eagle3(cfg: TrainConfig) -> dict:
    """Train (or with eval_only, evaluate) a head; returns the metrics written to the out dir."""
    device, dtype = resolve_device_dtype(cfg)
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    target_config = _read_target_config(cfg.target)
    num_layers, vocab_size = target_config["num_hidden_layers"], target_config["vocab_size"]
    examples = load_examples(cfg, device)
    if cfg.eval_only:
        return _eval_only(cfg, examples, device, dtype, num_layers)
    aux_layers = resolve_aux_layers(cfg.aux_layer_ids, num_layers)
    train_set, eval_set = split_eval(examples, cfg.eval_fraction, cfg.seed)
    state = load_training_state(cfg.out) if cfg.resume else None
    if state is not None:
        vocab, aux_layers = DraftVocab(state["used"]), tuple(state["aux_layers"])
    else:
        vocab = build_draft_vocab(train_set, cfg.draft_vocab_size, vocab_size)
    features = TargetFeatures(cfg.target, aux_layers, vocab.used, device, dtype)
    head = Eagle3TrainHead(head_config(target_config, vocab.size, aux_layers), features.embedding, device)
    head.set_vocab(vocab.d2t(), vocab.t2d(vocab_size))
    head.init_weights(features.lm_head if cfg.init_lm_head == "target" else None, seed=cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    per_epoch = math.ceil(len(train_set) / cfg.batch_size)
    total = per_epoch * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, per_epoch * cfg.epochs)
    step, epoch, batch_in_epoch, elapsed_before, history = 0, 0, 0, 0.0, []
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        elapsed_before, history = state["elapsed_s"], state["history"]
        log.info("resuming at step %d (epoch %d, batch %d)", step, epoch, batch_in_epoch)
    log.info("training %d steps (%d train / %d eval examples, draft vocab %d, aux layers %s, "
             "%d TTT steps) on %s", total, len(train_set), len(eval_set), vocab.size, list(aux_layers),
             cfg.ttt_steps, device)

    def checkpoint():
        save_training_state(cfg.out, {
            "head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "epoch": epoch, "batch_in_epoch": batch_in_epoch, "used": vocab.used,
            "aux_layers": list(aux_layers), "elapsed_s": elapsed_before + time.time() - start,
            "history": history, "config": asdict(cfg)})
        save_head(head, cfg.out, DTYPES[cfg.save_dtype], cfg.extra_config)

    autocast = (torch.autocast(device.type, dtype=dtype)
                if device.type == "cuda" and dtype != torch.float32 else nullcontext())
    start = time.time()
    bar = tqdm(total=total, initial=step, desc="train-eagle3", disable=not cfg.progress, dynamic_ncols=True)
    tokens, done = 0, False
    while epoch < cfg.epochs and not done:
        batches = make_batches(train_set, cfg.batch_size, cfg.seed + epoch)
        for examples_in_batch in batches[batch_in_epoch:]:
            elapsed = elapsed_before + time.time() - start
            if step >= total or (cfg.time_budget_s and elapsed >= cfg.time_budget_s):
                done = True
                break
            lr = lr_at(cfg, step, total, elapsed)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = Batch.collate(examples_in_batch, device)
            f = features(batch)
            aux = f.aux if device.type == "cuda" and dtype != torch.float32 else f.aux.float()
            with autocast:
                result = ttt_forward(head, aux, batch.input_ids, batch.loss_mask, f.target_logits,
                                     f.target_argmax, cfg.ttt_steps)
            optimizer.zero_grad(set_to_none=True)
            result.loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            step += 1
            batch_in_epoch += 1
            tokens += int(batch.attention_mask.sum())
            if step % cfg.log_every == 0 or step == 1 or step == total:
                acc = [float(s.correct / s.num_positions.clamp(min=1)) for s in result.steps]
                loss = result.loss.item()
                history.append({"step": step, "loss": loss, "lr": lr, "accuracy_per_step": acc})
                bar.set_postfix(loss=f"{loss:.3f}", acc0=f"{acc[0]:.2f}",
                                acc_last=f"{acc[-1]:.2f}", lr=f"{lr:.1e}")
            bar.update(1)
            if cfg.save_every and step % cfg.save_every == 0:
                checkpoint()
        else:
            epoch += 1
            batch_in_epoch = 0
    bar.close()
    train_time = time.time() - start
    checkpoint()
    metrics = {
        "target": os.path.abspath(cfg.target), "data": cfg.data, "steps": step, "epochs_completed": epoch,
        "train_time_s": elapsed_before + train_time,
        "tokens_per_s": tokens / train_time if train_time > 0 else None,
        "num_train_examples": len(train_set), "num_eval_examples": len(eval_set),
        "draft_vocab_size": vocab.size, "aux_layer_ids": list(aux_layers), "ttt_steps": cfg.ttt_steps,
        "loss_history": history, "final_loss": history[-1]["loss"] if history else None,
        "config": asdict(cfg),
    }
    if eval_set:
        metrics["eval"] = evaluate(head, features, eval_set, cfg, device, dtype)
        print(format_acceptance(metrics["eval"]))
    _write_metrics(os.path.join(cfg.out, METRICS_FILE), metrics)
    return metrics


def _eval_only(cfg: TrainConfig, examples, device, dtype, num_layers: int) -> dict:
    """Teacher-forced acceptance of the head already saved in cfg.out, on all of the data."""
    from foretell.models.base import HFConfig
    from foretell.spec_decode.eagle3 import resolve_aux_layers as engine_aux_layers

    config, tensors = load_head_state(cfg.out)
    if "d2t" not in tensors:
        raise ValueError(f"{cfg.out}/model.safetensors has no d2t tensor")
    used = torch.arange(tensors["d2t"].numel()) + tensors["d2t"]
    aux_layers = engine_aux_layers(cfg.aux_layer_ids, HFConfig(config, cfg.out), num_layers)
    features = TargetFeatures(cfg.target, aux_layers, used, device, dtype)
    head = head_from_state(config, tensors, features.embedding, device)
    metrics = evaluate(head, features, examples, cfg, device, dtype)
    metrics.update({"head": os.path.abspath(cfg.out), "target": os.path.abspath(cfg.target),
                    "data": cfg.data, "aux_layer_ids": list(aux_layers)})
    print(format_acceptance(metrics))
    _write_metrics(os.path.join(cfg.out, EVAL_METRICS_FILE), metrics)
    return metrics


def _write_metrics(path: str, metrics: dict) -> None:
    with open(path, "w") as f:
        json.dump(metrics, f, indent=2)
        f.write("\n")
