"""Training EAGLE3 draft heads (`foretell train-eagle3`).

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

The default model family's recipe (tokenizer, corpus, pretraining, cards) is in recipes/.
"""
