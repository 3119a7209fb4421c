"""The wire form of token origins (request field `return_token_origins`, a foretell extension):
one object per output token in each choice's `token_origins`, per chunk when streaming.

    {"token_id": 62, "token": "_", "origin": "corrected", "step": 3, "position": 1,
     "num_drafts": 3, "replaced_draft": 552, "replaced_draft_token": " b"}

origin is "accepted" (a draft the target verified, at draft position `position`), "corrected"
(the target's token at the first rejected draft, `replaced_draft`), "bonus" (the target's token
after every draft was accepted) or "target" (a step that verified no drafts).

`token` is the text this token adds to the output, so a client can colour the output token by
token: the tokens of one multi-byte character show it on the token that completes it (the others
show ""), and special tokens show as themselves (the choice's text may skip them). Joined, the
tokens spell the decoded output.
`replaced_draft_token` is the rejected draft's own text.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from foretell.engine.token_origins import TokenOrigin

# Tokens of context decoded before each token: more than HOLD_TOKENS plus the byte tokens of a
# character, so a window always reaches back past anything still held.
CONTEXT_TOKENS = 8
# An incomplete UTF-8 character has at most 3 bytes, so only the last 3 tokens can hold one; a
# U+FFFD older than that is final (an invalid byte the model produced) and is shown.
HOLD_TOKENS = 3
REPLACEMENT_CHAR = "\ufffd"  # what a decoder shows for an incomplete or invalid UTF-8 sequence


def settled_text(token_ids: list[int], first: int, end: int, decode: Callable[[list[int]], str]) -> str:
    """decode(token_ids[first:end]) less a trailing run of U+FFFD that the last HOLD_TOKENS
    tokens produced: the start of a character the next tokens may complete."""
    text = decode(token_ids[first:end])
    if not text.endswith(REPLACEMENT_CHAR):
        return text
    older = decode(token_ids[first : max(first, end - HOLD_TOKENS)])
    kept = len(os.path.commonprefix([older, text]))
    return text[: max(kept, len(text.rstrip(REPLACEMENT_CHAR)))]


def token_texts(
    token_ids: list[int], start: int, decode: Callable[[list[int]], str], finished: bool = False
) -> list[str]:
    """The text each of token_ids[start:] adds to the output: the settled text with the token
    less the settled text without it, over a few tokens of context. A character split over
    tokens shows on the token that completes it; once the output is finished nothing is held."""
    texts = []
    for i in range(start, len(token_ids)):
        first = max(0, i - CONTEXT_TOKENS)
        before = settled_text(token_ids, first, i, decode)
        last = finished and i == len(token_ids) - 1
        after = decode(token_ids[first : i + 1]) if last else settled_text(token_ids, first, i + 1, decode)
        texts.append(after[len(before):] if after.startswith(before) else after)
    return texts


def origins_json(
    origins: list[TokenOrigin],
    token_ids: list[int],
    decode: Callable[[list[int]], str],
    token_string: Callable[[int], str],
    finished: bool = False,
) -> list[dict[str, Any]]:
    """The wire objects of `origins`, the origins of the last len(origins) of token_ids (a
    choice's output so far, `finished` or not); decode(ids) spells tokens, special ones kept."""
    texts = token_texts(token_ids, len(token_ids) - len(origins), decode, finished)
    return [
        {
            "token_id": o.token_id,
            "token": text,
            "origin": o.kind,
            "step": o.step,
            "position": o.position,
            "num_drafts": o.num_drafts,
            "replaced_draft": o.replaced_draft,
            "replaced_draft_token": None if o.replaced_draft is None else token_string(o.replaced_draft),
        }
        for o, text in zip(origins, texts)
    ]
