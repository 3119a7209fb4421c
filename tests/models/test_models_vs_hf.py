"""Each Llama-family model against transformers' implementation, on the same tiny checkpoints.

float32 logits must match HF's `model(input_ids).logits` for a single prefill, a varlen batch of
sequences with different prompt lengths, and prefixes already in the paged cache (chunked prefill,
decode steps); aux hidden states must equal HF's `hidden_states[i]` (the input of layer i).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fixtures import PagedRunner
from foretell.ops.attention.reference import TorchAttentionBackend
from foretell.models.base import HFConfig, ModelOptions, side_by_side
from foretell.models.registry import resolve_model_class
from foretell.models import loading as model_loading

FAMILIES = ["llama31", "qwen3", "qwen3_tied", "qwen2", "mistral", "llama2_bin"]
ATOL = 1e-4
TOKENIZER_SIZE = 448


def build_model(folder: str, dtype=torch.float32, aux_layers=()):
    options = ModelOptions(dtype, torch.device("cpu"), TorchAttentionBackend(), tuple(aux_layers))
    return model_loading.build_model(folder, HFConfig.from_folder(folder), options)


_HF_CACHE: dict[str, torch.nn.Module] = {}


def hf_model(folder: str):
    if folder not in _HF_CACHE:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        )
        _HF_CACHE[folder] = model.eval()
    return _HF_CACHE[folder]


@torch.no_grad()
def hf_run(folder: str, tokens: list[int], output_hidden_states: bool = False):
    return hf_model(folder)(torch.tensor([tokens]), output_hidden_states=output_hidden_states)


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TOKENIZER_SIZE, (length,), generator=generator).tolist()


@pytest.fixture(params=FAMILIES)
def family_checkpoint(request) -> str:
    return request.getfixturevalue(f"{request.param}_checkpoint")


def test_single_prefill_matches_hf(family_checkpoint):
    tokens = prompt(11, seed=1)
    runner = PagedRunner(build_model(family_checkpoint))
    logits, _, aux = runner.step([("a", tokens)])
    assert aux == []
    expected = hf_run(family_checkpoint, tokens).logits[0]
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)


def test_varlen_batch_matches_hf(family_checkpoint):
    chunks = [("a", prompt(7, seed=2)), ("b", prompt(13, seed=3)), ("c", prompt(1, seed=4))]
    runner = PagedRunner(build_model(family_checkpoint), block_size=4)
    logits, _, _ = runner.step(chunks)
    for rows, (_, tokens) in zip(runner.split(logits, chunks), chunks):
        expected = hf_run(family_checkpoint, tokens).logits[0]
        torch.testing.assert_close(rows, expected, rtol=0, atol=ATOL)


def test_cached_prefix_matches_hf(family_checkpoint):
    """Prefill part of each prompt, then the rest (mixed with a decode and a fresh prompt), then
    single-token decodes: every row equals HF's logits for the full sequence at that position."""
    full = {"a": prompt(14, seed=5), "b": prompt(10, seed=6), "c": prompt(5, seed=7)}
    steps = [
        [("a", full["a"][:6]), ("b", full["b"][:9])],
        [("b", full["b"][9:]), ("a", full["a"][6:12]), ("c", full["c"][:4])],
        [("a", full["a"][12:13]), ("c", full["c"][4:])],
        [("a", full["a"][13:])],
    ]
    runner = PagedRunner(build_model(family_checkpoint), block_size=4)
    expected = {s: hf_run(family_checkpoint, t).logits[0] for s, t in full.items()}
    done = {s: 0 for s in full}
    for chunks in steps:
        logits, _, _ = runner.step(chunks)
        for rows, (seq, tokens) in zip(runner.split(logits, chunks), chunks):
            want = expected[seq][done[seq] : done[seq] + len(tokens)]
            torch.testing.assert_close(rows, want, rtol=0, atol=ATOL)
            done[seq] += len(tokens)
    assert done == {s: len(t) for s, t in full.items()}


@pytest.mark.parametrize("family", ["llama31", "qwen3", "qwen2"])
def test_aux_hidden_states_match_hf(request, family):
    folder = request.getfixturevalue(f"{family}_checkpoint")
    num_layers = HFConfig.from_folder(folder).num_hidden_layers
    aux_layers = (1, 2, num_layers - 1, 0)  # any order, returned in that order
    model = build_model(folder, aux_layers=aux_layers)
    chunks = [("a", prompt(9, seed=8)), ("b", prompt(4, seed=9))]
    runner = PagedRunner(model)
    _, hidden, aux = runner.step(chunks)
    assert len(aux) == len(aux_layers)
    for seq_index, (_, tokens) in enumerate(chunks):
        out = hf_run(folder, tokens, output_hidden_states=True)
        for layer, captured in zip(aux_layers, aux):
            rows = runner.split(captured, chunks)[seq_index]
            torch.testing.assert_close(rows, out.hidden_states[layer][0], rtol=0, atol=ATOL)
        # the returned hidden is after the final norm: HF's last hidden state
        rows = runner.split(hidden, chunks)[seq_index]
        torch.testing.assert_close(rows, out.hidden_states[-1][0], rtol=0, atol=ATOL)


def test_aux_states_sit_side_by_side_for_the_eagle3_fc():
    """run_decoder_stack's aux states are column blocks of one buffer: side_by_side joins them (and
    row slices of them) without a copy; anything else is concatenated."""
    streams = torch.randn(5, 3, 4)
    parts = [streams[:, j] for j in range(3)]
    joined = side_by_side(parts)
    assert joined.data_ptr() == streams.data_ptr() and torch.equal(joined, torch.cat(parts, dim=-1))
    rows = side_by_side([p[1:4] for p in parts])
    assert rows.data_ptr() == streams[1].data_ptr() and torch.equal(rows, torch.cat(parts, dim=-1)[1:4])
    for others in ([parts[1], parts[0], parts[2]], [parts[0], parts[0], parts[2]], [p.clone() for p in parts]):
        out = side_by_side(others)
        assert torch.equal(out, torch.cat(others, dim=-1)) and out.data_ptr() != streams.data_ptr()


def test_aux_layer_out_of_range_is_rejected(qwen3_checkpoint):
    config = HFConfig.from_folder(qwen3_checkpoint)
    options = ModelOptions(torch.float32, torch.device("cpu"), TorchAttentionBackend(), (1, 4))
    with pytest.raises(ValueError, match=r"aux_hidden_state_layers.*\[0, 4\).*\[4\]"):
        resolve_model_class(config)(config, options)


def test_bf16_model_tracks_hf_bf16(qwen3_checkpoint):
    """In bf16 the two implementations round differently inside attention; they stay close."""
    from transformers import AutoModelForCausalLM

    tokens = prompt(12, seed=10)
    runner = PagedRunner(build_model(qwen3_checkpoint, dtype=torch.bfloat16))
    logits, _, _ = runner.step([("a", tokens)])
    hf = AutoModelForCausalLM.from_pretrained(
        qwen3_checkpoint, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0].float()
    reference = hf_run(qwen3_checkpoint, tokens).logits[0]
    ours_error = (logits - reference).abs().max()
    hf_error = (expected - reference).abs().max()
    # no worse than HF's own bf16 run, measured against float32
    assert ours_error <= 2 * hf_error + 1e-3, (ours_error, hf_error)


def test_tied_model_has_no_lm_head_parameter(qwen3_tied_checkpoint):
    model = build_model(qwen3_tied_checkpoint)
    names = dict(model.named_parameters())
    assert "lm_head.weight" not in names
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sliding_window_warns(mistral_checkpoint):
    data = HFConfig.from_folder(mistral_checkpoint).to_dict()
    options = ModelOptions(torch.float32, torch.device("cpu"), TorchAttentionBackend())
    with pytest.warns(UserWarning, match="sliding_window=8 is not implemented"):
        resolve_model_class(HFConfig(data))(HFConfig({**data, "sliding_window": 8}), options)
    qwen2_like = {**data, "sliding_window": 8, "use_sliding_window": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_model_class(HFConfig(data))(HFConfig(qwen2_like), options)
