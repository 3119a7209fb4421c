"""SamplingParams: how one request samples and when it stops. Validated on construction.

The logits controls (presence, frequency and repetition penalties, min_tokens, logit_bias,
bad_words, allowed_token_ids) follow vLLM's and OpenAI's meanings; the runner applies them to each
sampling row (runner/logits_processing.py), under speculation as if the drafts before the row had
been accepted. What needs the model (token ids inside the vocabulary, bad words as token ids) is
checked and resolved when the engine takes the request (`resolved_for`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from foretell.structured.params import StructuredOutputsParams

MAX_ABS_PENALTY = 2.0  # presence_penalty and frequency_penalty: OpenAI's range [-2, 2]
MAX_ABS_LOGIT_BIAS = 100.0  # logit_bias values: OpenAI's range [-100, 100]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's max length
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token (the first has none)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Report each output token's origin under speculation (accepted draft, the target's
    # correction, bonus, plain target token): CompletionOutput.token_origins. Off: nothing built.
    return_token_origins: bool = False
    # False: this request verifies no drafts (its tokens are the target's alone), e.g. to compare
    # one prompt with and without speculation on the same server. The output is the same either way.
    use_speculation: bool = True
    # Subtracted from the logit of every token the output holds so far: once (presence) or once
    # per occurrence (frequency). In [-2, 2]; > 0 discourages repeats.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Tokens seen in the prompt or the output: positive logits divided by it, negative ones
    # multiplied. > 0; 1 is off, > 1 discourages repeats.
    repetition_penalty: float = 1.0
    # EOS and stop_token_ids cannot be generated before the output holds this many tokens (and
    # stop strings do not stop it before then).
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # Words never generated: each is tokenized (as it is and after a space) and the last token of
    # the sequence is banned wherever the tokens before it were just generated.
    bad_words: list[str] | None = None
    # The same as token sequences (no tokenizer needed); the engine adds bad_words' tokens here.
    bad_words_token_ids: list[list[int]] | None = None
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated
    # The output matches a JSON schema, a regex, a choice or a grammar (structured/params.py);
    # a dict with vLLM's keys ({"json": schema} | {"regex": ...} | ...) is converted.
    structured_outputs: StructuredOutputsParams | dict | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        self._validate_logits_controls()
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)

    def _bad(self, field_name: str, expected: str) -> ValueError:
        return ValueError(
            f"SamplingParams.{field_name} must be {expected}, got {getattr(self, field_name)!r}"
        )

    def _validate(self) -> None:
        bad = self._bad
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", ">= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "an integer: -1 or 0 to disable, or >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 (or None for up to the model's max length)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "an integer between 0 and 20")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", "an integer between 0 and 20")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer")
        for flag in ("return_token_origins", "use_speculation"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "True or False")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")

    def _validate_logits_controls(self) -> None:
        bad = self._bad
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise bad(name, f"a number in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}] (0: off)")
        rep = self.repetition_penalty
        if not _is_number(rep) or not 0 < rep < math.inf:
            raise bad("repetition_penalty", "a finite number > 0 (1: off)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"at most max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                _is_int(t) and t >= 0 and _is_number(b) and -MAX_ABS_LOGIT_BIAS <= b <= MAX_ABS_LOGIT_BIAS
                for t, b in self.logit_bias.items()
            ):
                raise bad("logit_bias", f"a dict of non-negative integer token ids to numbers in "
                                        f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()}
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words
            ):
                raise bad("bad_words", "a list of non-blank strings")
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, list) or any(
                not isinstance(seq, list) or not seq or any(not _is_int(t) or t < 0 for t in seq)
                for seq in self.bad_words_token_ids
            ):
                raise bad("bad_words_token_ids", "a list of non-empty lists of non-negative token ids")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids or any(
                not _is_int(t) or t < 0 for t in self.allowed_token_ids
            ):
                raise bad("allowed_token_ids", "a non-empty list of non-negative token ids (or None: all)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_logits_processing(self) -> bool:
        """Whether a sampling row of this request reads more than its logits: its penalties, bans,
        biases or min_tokens depend on the tokens before it (runner/logits_processing.py; on the
        padded device steps runner/padded_logits_controls.py keeps what they need on the device,
        except a grammar's state, which keeps its requests on the host step)."""
        return self.needs_logits_controls or self.structured_outputs is not None  # the grammar: foretell/structured/

    @property
    def needs_logits_controls(self) -> bool:
        """needs_logits_processing without the grammar: what runner/logits_processing.py applies."""
        return bool(
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
            or self.logit_bias
            or self.bad_words
            or self.bad_words_token_ids
            or self.allowed_token_ids is not None
        )

    def token_id_errors(self, vocab_size: int) -> None:
        """Raise ValueError naming the field when a token id of the logits controls is outside
        [0, vocab_size)."""
        fields = {
            "logit_bias": list(self.logit_bias or {}),
            "allowed_token_ids": list(self.allowed_token_ids or []),
            "bad_words_token_ids": [t for seq in self.bad_words_token_ids or [] for t in seq],
        }
        for name, ids in fields.items():
            outside = sorted({t for t in ids if not 0 <= t < vocab_size})
            if outside:
                raise ValueError(
                    f"SamplingParams.{name} holds token ids outside the vocabulary [0, {vocab_size}): "
                    f"{outside[:5]}"
                )

    def resolved_for(self, tokenizer, vocab_size: int) -> "SamplingParams":
        """These parameters as the engine runs them: bad_words tokenized into bad_words_token_ids
        (with `tokenizer`, a foretell Tokenizer; None when the engine has none), every token id
        checked against the vocabulary. Returns self when there is nothing to tokenize."""
        params = self
        if self.bad_words:
            if tokenizer is None:
                raise ValueError(
                    "SamplingParams.bad_words needs a tokenizer, and the engine runs without one "
                    "(skip_tokenizer_init): give bad_words_token_ids instead"
                )
            extra = bad_words_token_ids(self.bad_words, tokenizer.hf.encode)
            params = dataclasses.replace(
                self, bad_words=None, bad_words_token_ids=list(self.bad_words_token_ids or []) + extra
            )
        params.token_id_errors(vocab_size)
        return params


def bad_words_token_ids(words: list[str], encode) -> list[list[int]]:
    """Each word's token sequences, as vLLM makes them: the word as it is, and after a space when
    that spells it with a different first token and as many tokens (the word inside a text).
    `encode(text, add_special_tokens=False)` is a Hugging Face tokenizer's encode."""
    sequences: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip(), add_special_tokens=False)
        spaced = encode(" " + word.lstrip(), add_special_tokens=False)
        if plain:
            sequences.append(list(plain))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            sequences.append(list(spaced))
    return sequences
