"""Fixtures of the grammar tests: the fixture tokenizer's Hugging Face object and a fresh
StructuredOutputs over the fixture checkpoints' vocabulary."""

from __future__ import annotations

import pytest

from fixtures.grammar_stubs import VOCAB
from foretell.structured.runtime import StructuredOutputs


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    from foretell.tokenizer import Tokenizer

    return Tokenizer(tokenizer_dir).hf


@pytest.fixture
def runtime(tokenizer_dir):
    return StructuredOutputs(tokenizer_dir, VOCAB)
