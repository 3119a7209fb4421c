"""`foretell train-eagle3`: train an EAGLE3 draft head for a target model.

  foretell train-eagle3 --target DIR --data FILE... --out DIR [--draft-vocab-size N]
      [--ttt-steps 7] [--max-len L] [--epochs E] [--max-steps S] [--lr LR] [--batch-size B]
      [--regenerate] [--aux-layer-ids I I I] [--device D] [--dtype T] [--resume]
      [--eval-fraction F] [--save-every S] [--eval-only]
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the trainer (torch) loads only when the command runs, not for --help
    from foretell.training.trainer import TrainConfig


def add_train_parser(sub) -> None:
    p = sub.add_parser("train-eagle3", help="train an EAGLE3 draft head for a target model",
                       description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="the target's Hugging Face model folder")
    p.add_argument("--data", nargs="+", required=True,
                   help="JSONL/JSON records (text, prompt[/response], question/answer, messages, "
                        "conversations) or plain text files")
    p.add_argument("--out", required=True, help="output folder: the head, checkpoint/, metrics")
    p.add_argument("--draft-vocab-size", type=int, default=32000,
                   help="the N most frequent target tokens of the data (>= vocab: the whole vocab)")
    p.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll length")
    p.add_argument("--max-len", type=int, default=2048, help="tokens per example (longer: cut)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the data")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    p.add_argument("--time-budget", type=float, dest="time_budget_s",
                   help="stop training after this many seconds (the LR schedule follows it)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (AdamW, cosine schedule)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor, as a fraction of --lr")
    p.add_argument("--warmup-ratio", type=float, default=0.03,
                   help="share of the steps over which the learning rate rises linearly")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--grad-clip", type=float, default=0.5, help="clip the gradient norm to this")
    p.add_argument("--batch-size", type=int, default=8, help="examples per optimizer step")
    p.add_argument("--chat", action="store_true",
                   help="wrap prompt/response and question/answer records in the chat template")
    p.add_argument("--regenerate", action="store_true",
                   help="the target writes the responses itself (through foretell)")
    p.add_argument("--regen-temperature", type=float, default=0.0, help="--regenerate: 0 is greedy")
    p.add_argument("--regen-max-tokens", type=int, default=256,
                   help="--regenerate: tokens per response at most")
    p.add_argument("--regen-max-num-seqs", type=int, default=256,
                   help="--regenerate: responses generated at once at most")
    p.add_argument("--aux-layer-ids", type=int, nargs=3, metavar="I",
                   help="inputs of these target layers (HF hidden_states[i]); default 2, N//2, N-3")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="the target's dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the saved head")
    p.add_argument("--init-lm-head", default="target", choices=["target", "random"],
                   help="start lm_head from the target's draft-vocabulary rows, or at random")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/state.pt")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="held out for evaluation")
    p.add_argument("--eval-k", type=int, default=3,
                   help="drafts per step when replaying the engine's walk in the evaluation")
    p.add_argument("--eval-only", action="store_true",
                   help="no training: teacher-forced acceptance of the head in --out on all the data")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every S steps (0: at the end)")
    p.add_argument("--seed", type=int, default=0, help="seed of the eval split, batch order, head init and regeneration")
    p.add_argument("--log-every", type=int, default=10, help="log the losses every S steps")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars (training, --regenerate, loading the target)")
    p.set_defaults(func=run_train)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    from foretell.training.trainer import TrainConfig

    fields = TrainConfig.__dataclass_fields__
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})


def run_train(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from foretell.training.trainer import train_eagle3

    # --no-progress silences transformers' bars too (loading the target's weights), for this run.
    hf_bars = hf_logging.is_progress_bar_enabled()
    if not args.progress:
        hf_logging.disable_progress_bar()
    try:
        train_eagle3(config_from_args(args))
    finally:
        if hf_bars:
            hf_logging.enable_progress_bar()
    return 0
