"""Shared pytest fixtures: tiny checkpoints in real layouts, built once per test session.

Every checkpoint fixture returns a folder path; the folders share one tokenizer, trained once.
Treat the folders as read-only (copy with `fixtures.checkpoints.make_variant` to break one).
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

from fixtures import checkpoints
from fixtures.triton_interpreter import import_triton_language_first

# Tests that draw random inputs take their seed from `random`. Each test starts from a seed fixed by
# its name, so a CI run is a function of the commit; FORETELL_TEST_FRESH_SEEDS=1 draws fresh seeds
# to hunt for failing inputs (a failure names its seed: see fixtures/seeds.py).
FRESH_SEEDS = os.environ.get("FORETELL_TEST_FRESH_SEEDS") == "1"


@pytest.fixture(autouse=True)
def _seeded_randomness(request):
    seed = random.randrange(2**31) if FRESH_SEEDS else zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch.manual_seed(seed)
    yield


def pytest_configure(config):
    import_triton_language_first()


# The tiny test models run several times faster on one intra-op thread than on two (thread
# start-up costs more than their matmuls); the suite has a time budget on a 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def tokenizer_dir(checkpoint_root) -> str:
    """A folder holding only tokenizer.json and tokenizer_config.json."""
    folder = os.path.join(checkpoint_root, "tokenizer")
    checkpoints.write_tokenizer(folder)
    return folder


def _checkpoint(name: str, checkpoint_root: str, tokenizer_dir: str) -> str:
    folder = os.path.join(checkpoint_root, name)
    if not os.path.isdir(folder):
        checkpoints.WRITERS[name](folder, tokenizer_dir)
    return folder


@pytest.fixture(scope="session")
def llama31_checkpoint(checkpoint_root, tokenizer_dir) -> str:
    """Llama-3.1 layout: bf16 safetensors, rope_scaling llama3, untied, 4 layers."""
    return _checkpoint("llama31", checkpoint_root, tokenizer_dir)


@pytest.fixture(scope="session")
def qwen3_checkpoint(checkpoint_root, tokenizer_dir) -> str:
    """Qwen3-8B layout: bf16 safetensors, q_norm/k_norm, untied lm_head, 4 layers."""
    return _checkpoint("qwen3", checkpoint_root, tokenizer_dir)


@pytest.fixture(scope="session")
def qwen3_tied_checkpoint(checkpoint_root, tokenizer_dir) -> str:
    """Qwen3-0.6B layout: tied embeddings (no lm_head.weight), head_dim 32 != hidden / heads."""
    return _checkpoint("qwen3_tied", checkpoint_root, tokenizer_dir)


@pytest.fixture(scope="session")
def qwen3_sharded_checkpoint(checkpoint_root, tokenizer_dir) -> str:
    """The qwen3_checkpoint weights as 2 safetensors shards + model.safetensors.index.json."""
    return _checkpoint("qwen3_sharded", checkpoint_root, tokenizer_dir)


@pytest.fixture(scope="session")
def qwen2_checkpoint(checkpoint_root, tokenizer_dir) -> str:
    """Qwen2.5 layout: bf16 safetensors, q/k/v biases, 3 layers."""
    return _checkpoint("qwen2", checkpoint_root, tokenizer_dir)


@pytest.fixture(scope="session")
def mistral_checkpoint(checkpoint_root, tokenizer_dir) -> str:
    """Mistral-Nemo layout: explicit head_dim 32 with hidden 64 / 4 heads, 2 layers."""
    return _checkpoint("mistral", checkpoint_root, tokenizer_dir)


@pytest.fixture(scope="session")
def llama2_bin_checkpoint(checkpoint_root, tokenizer_dir) -> str:
    """Llama-2-era pytorch_model.bin (fp16, with per-layer rotary_emb.inv_freq keys), 2 layers."""
    return _checkpoint("llama2_bin", checkpoint_root, tokenizer_dir)


# ---------------------------------------------------------------------- speculative drafters


@pytest.fixture(scope="session")
def eagle3_head(checkpoint_root, qwen3_checkpoint) -> str:
    """EAGLE layout head (midlayer.*, no embed_tokens) for qwen3_checkpoint, draft vocab 256,
    aux ids written SpecForge-style [0, 1, 2] = inputs of layers 1, 2, 3."""
    from fixtures.eagle3 import write_eagle3_head

    folder = os.path.join(checkpoint_root, "eagle3_eagle")
    if not os.path.isdir(folder):
        write_eagle3_head(folder, qwen3_checkpoint, "eagle", draft_vocab_size=256, aux_layer_ids=[0, 1, 2])
    return folder


@pytest.fixture(scope="session")
def eagle3_head_specforge(checkpoint_root, qwen3_checkpoint) -> str:
    """SpecForge layout head (layers.0.*, own embed_tokens), full vocab, no eagle_config."""
    from fixtures.eagle3 import write_eagle3_head

    folder = os.path.join(checkpoint_root, "eagle3_specforge")
    if not os.path.isdir(folder):
        write_eagle3_head(folder, qwen3_checkpoint, "specforge", seed=11)
    return folder
