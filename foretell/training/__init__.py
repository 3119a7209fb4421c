"""Training EAGLE3 draft heads (`foretell train-eagle3`) and the recipe pieces behind the default
model family.

  data.py        records from JSONL / JSON / text files -> token sequences with a loss mask
  regenerate.py  the target writes the responses itself, through foretell's LLM
  vocab.py       the draft vocabulary (N most frequent target tokens) -> d2t, t2d
  features.py    the target's aux hidden states and logits (Hugging Face transformers)
  head.py        the trainable twin of foretell.models.eagle3.Eagle3Head, and its config
  ttt.py         training-time test: the attention mask, the k-step forward, the loss
  evaluate.py    teacher-forced acceptance per position on held-out data
  checkpoint.py  export in the standard head layout; training state for --resume
  trainer.py     the training loop
  cli.py         the `foretell train-eagle3` command
  pieces of scripts/train_default_models.py (the default family's recipe):
  bpe.py, corpus.py        the tokenizer and the corpus (stdlib source + GSM8K train)
  pretrain.py              the shared pretraining loop; the Qwen3-layout LMs
  deepseek_pretrain.py     the DeepSeek-V3-layout LM trained jointly with one MTP layer
  recipe_measure.py        acceptance of every drafter on GSM8K test prompts, teacher-forced too
  recipe_cards.py          the model cards (README.md) written from what was measured
"""
