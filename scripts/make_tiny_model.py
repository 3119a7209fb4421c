"""Write a tiny random Qwen3-layout checkpoint (with tokenizer) and an EAGLE3 head for it.

Until the trained default models ship, this is what the README's first command runs on.
Usage: python scripts/make_tiny_model.py OUT_DIR   -> OUT_DIR/qwen3, OUT_DIR/qwen3_eagle3
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from fixtures.checkpoints import write_qwen3, write_tokenizer  # noqa: E402
from fixtures.eagle3 import write_eagle3_head  # noqa: E402


def main(out: str) -> None:
    tokenizer = os.path.join(out, "tokenizer")
    if not os.path.isdir(tokenizer):
        write_tokenizer(tokenizer)
    target = os.path.join(out, "qwen3")
    if not os.path.isdir(target):
        write_qwen3(target, tokenizer)
    head = os.path.join(out, "qwen3_eagle3")
    if not os.path.isdir(head):
        write_eagle3_head(head, target, "eagle", draft_vocab_size=256, aux_layer_ids=[0, 1, 2])
    print(target)
    print(head)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/foretell-tiny")
