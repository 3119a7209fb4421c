"""Each token's text in token_origins (server/token_origins.py): joined, the tokens spell the
decoded output, whatever the chunking of a stream, with characters split over byte tokens shown
on the token that completes them and invalid bytes shown where they stay invalid.

The reference is Python's own UTF-8 decoder (errors="replace", the U+FFFD rule a byte-level
tokenizer's decoder follows) over a toy vocabulary of byte strings."""

from __future__ import annotations

import random

from foretell.server.token_origins import token_texts

SNOWMAN, SIGMA, ROCKET = "☃".encode(), "ϣ".encode(), "🚀".encode()
VOCAB = [b"a", b" the", b"\n", b"", SIGMA, SNOWMAN, ROCKET, SIGMA[:1], SIGMA[1:], SNOWMAN[:1], SNOWMAN[1:2],
         SNOWMAN[2:], SNOWMAN[:2], ROCKET[:2], ROCKET[2:], ROCKET[1:3], ROCKET[3:], b"\xff", b"\x80", b"x\xe2"]


def decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def streamed_texts(ids: list[int], rng: random.Random) -> list[str]:
    """token_texts as a stream computes them: each chunk's new tokens, finished on the last."""
    texts, sent = [], 0
    while sent < len(ids):
        end = min(len(ids), sent + rng.randint(1, 4))
        texts += token_texts(ids[:end], sent, decode, finished=end == len(ids))
        sent = end
    return texts


def test_split_characters_show_on_the_token_that_completes_them():
    ids = [0, 9, 10, 11, 1]  # "a", then the snowman in three byte tokens, then " the"
    assert token_texts(ids, 0, decode, finished=True) == ["a", "", "", "☃", " the"]
    rocket = [13, 14, 0]
    assert token_texts(rocket, 0, decode, finished=True) == ["", "🚀", "a"]


def test_invalid_bytes_show_once_they_cannot_be_completed():
    ids = [0, 17, 0, 9, 0]  # "a", 0xff (never valid), "a", a lone lead byte, "a"
    texts = token_texts(ids, 0, decode, finished=True)
    assert "".join(texts) == decode(ids) == "a\ufffda\ufffda"
    assert texts[0] == "a" and texts[-1].endswith("a")


def test_a_finished_output_holds_nothing_back():
    assert token_texts([0, 9], 0, decode, finished=True) == ["a", "\ufffd"]
    assert token_texts([0, 9], 0, decode, finished=False) == ["a", ""]


def test_tokens_spell_the_output_for_any_tokens_and_chunking():
    rng = random.Random(0)
    for _ in range(400):
        ids = [rng.randrange(len(VOCAB)) for _ in range(rng.randint(1, 30))]
        assert "".join(token_texts(ids, 0, decode, finished=True)) == decode(ids), ids
        assert "".join(streamed_texts(ids, rng)) == decode(ids), ids
