"""The Hugging Face tokenizer of a model folder, plus incremental detokenization.

IncrementalDetokenizer turns a growing list of token ids into text deltas without re-decoding the
whole output each step, and never emits half a multi-byte character: text that decodes to a
trailing U+FFFD is held back until the next token completes it.
"""

from __future__ import annotations

import json
import os

from foretell.sampling_params import SamplingParams


class Tokenizer:
    def __init__(self, folder: str, revision: str | None = None, download_dir: str | None = None):
        """folder: a local folder or a Hugging Face Hub id (resolved by model_source.py)."""
        from transformers import AutoTokenizer

        from foretell.model_source import resolve_model_path

        folder = resolve_model_path(folder, revision, download_dir, what="tokenizer")
        try:
            self.hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as e:  # transformers raises several types for a missing/bad tokenizer
            raise ValueError(
                f"could not load a tokenizer from {folder}: {e}. The folder needs "
                f"tokenizer.json (or the files of a slow tokenizer) and tokenizer_config.json"
            ) from e
        self.folder = folder
        self.eos_token_ids = self._find_eos_ids(folder)
        self._backend = fast_backend(self.hf)

    def _find_eos_ids(self, folder: str) -> frozenset[int]:
        own = {self.hf.eos_token_id} if self.hf.eos_token_id is not None else set()
        return frozenset(own) | eos_ids_from_configs(folder)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None and type(token_ids) is list:  # the same text, minus transformers' Python
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(
                f"the tokenizer in {self.folder} has no chat template: use generate() with a "
                f"plain prompt, or add a chat_template to tokenizer_config.json"
            )
        ids = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)


def fast_backend(hf) -> object | None:
    """The Rust `tokenizers.Tokenizer` under a fast Hugging Face tokenizer when decoding through it
    gives exactly what hf.decode gives: transformers' decode is that backend's decode plus Python
    (argument conversion, an optional clean-up of spaces) on every call, twice per generated token
    in the incremental detokenizer (docs/perf-log.md, "Host work per engine step"). None (use
    hf.decode) for slow tokenizers and for those whose decode cleans up spaces."""
    backend = getattr(hf, "_tokenizer", None)
    if not getattr(hf, "is_fast", False) or backend is None or not hasattr(backend, "decode"):
        return None
    if getattr(hf, "clean_up_tokenization_spaces", False):
        return None
    return backend


def eos_ids_from_configs(folder: str) -> frozenset[int]:
    """EOS ids named by generation_config.json and config.json (int or list)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path) as f:
                value = json.load(f).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


class IncrementalDetokenizer:
    """Text of one sequence's output, grown token by token; applies stop strings."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # tokens before this are fully reflected in self.text
        self._read_offset = 0
        self._max_stop_len = max((len(s) for s in params.stop_strings), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add(self, new_token_ids: list[int]) -> tuple[str | None, int]:
        """Append tokens one at a time until one completes a stop string.

        Returns (the stop string hit or None, how many of new_token_ids were taken). After a hit
        the text is cut at the stop string and the tokens after the one that completed it are not
        taken: a verify step may accept several tokens at once, and the caller drops the untaken
        ones so the output is what one-token-a-step decoding would have produced.
        """
        for taken, token in enumerate(new_token_ids, start=1):
            self.token_ids.append(token)
            prefix_ids = self.token_ids[self._prefix_offset : self._read_offset]
            prefix = self._decode(prefix_ids) if prefix_ids else ""
            full = self._decode(self.token_ids[self._prefix_offset :])
            if full.endswith("\ufffd") or len(full) <= len(prefix):
                continue  # an incomplete multi-byte character, or nothing printable yet
            start = len(self.text)
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            hit = self._check_stop(start) if len(self.token_ids) > self.params.min_tokens else None
            if hit is not None:
                return hit, taken
        return None, len(new_token_ids)

    def _check_stop(self, new_text_start: int) -> str | None:
        if not self._max_stop_len:
            return None
        search_from = max(0, new_text_start - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop_strings:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.params.include_stop_str_in_output else self.text[:at]
        return stop
